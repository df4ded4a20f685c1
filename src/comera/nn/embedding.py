"""``TTMEmbedding`` and ``TTMEmbeddingBag``: embedding tables ``(num_embeddings, embedding_dim)`` stored as
TTM cores ``(r_{k-1}, m_k, n_k, r_k)`` over ``row_shape`` and ``col_shape``, rows computed on demand by
:mod:`comera.tt.lookup` (``lookup=``: ``"naive"``, ``"split"``, ``"optimized"``, ``"auto"``), padded rows and
columns never returned, ``padding_idx`` as in ``nn.Embedding``. Details: docs/method.md sections 2.4 and 6."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from comera.checks import check_int
from comera.nn.gated import DEFAULT_RANK, DEFAULT_TAU, GatedTrain, autocast_output, check_float_dtype
from comera.nn.layer import NameOf, Resolve, register_layer, spec_arguments
from comera.nn.linear import _INITS, pad_mode_counts
from comera.nn.removed import RemovedEmbedding, RemovedEmbeddingBag
from comera.tt.cores import core_std, ttm_core_shapes, ttm_full
from comera.tt.costs import ORDERS, auto_ttm_order, ttm_merge_split
from comera.tt.lookup import in_graph_capture, rows_at, split_halves, ttm_lookup_rows
from comera.tt.paths import ttm_linear
from comera.tt.shapes import auto_modes, auto_num_modes, check_modes, resolve_ranks
from comera.tt.svd import ttm_svd
from comera.tt.workspace import Workspace

__all__ = ["LOOKUPS", "TTMEmbedding", "TTMEmbeddingBag"]

# lookup name -> (path of comera.tt.lookup, dedup argument: True always, False never, None by repeat rate)
_LOOKUP_SETTINGS = {
    "auto": ("optimized", None),
    "naive": ("naive", False),
    "split": ("optimized", False),
    "optimized": ("optimized", True),
}
LOOKUPS = tuple(_LOOKUP_SETTINGS)
_INDEX_DTYPES = (torch.int64, torch.int32)
_ORDER_CHOICES = ("auto", *ORDERS)
_BAG_MODES = ("sum", "mean", "max")


def _check_padding_idx(padding_idx: object, num_embeddings: int) -> int | None:
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise ValueError(f"padding_idx must be an int or None, got {padding_idx!r}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"padding_idx must be in [{-num_embeddings}, {num_embeddings - 1}] "
            f"(num_embeddings={num_embeddings}), got {padding_idx}"
        )
    return padding_idx % num_embeddings


def _table_shapes(
    num_embeddings: int,
    embedding_dim: int,
    row_shape: Sequence[int] | None,
    col_shape: Sequence[int] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row and column modes: given ones checked (products may exceed the sizes), missing ones chosen."""
    if row_shape is not None:
        row_shape = check_modes(row_shape, num_embeddings, "row_shape", allow_padding=True)
    if col_shape is not None:
        col_shape = check_modes(col_shape, embedding_dim, "col_shape", allow_padding=True)
    if row_shape is not None and col_shape is not None:
        row_shape, col_shape = pad_mode_counts(row_shape, col_shape)
    given = row_shape or col_shape
    order = len(given) if given else auto_num_modes(num_embeddings)
    return (
        row_shape or auto_modes(num_embeddings, order),
        col_shape or auto_modes(embedding_dim, order, descending=True),
    )


class _TTMTable(GatedTrain):
    """Common part of the TTM tables: shapes, cores, gates, index checks, row lookup, tied logits, and the
    layer protocol (:mod:`comera.nn.layer`); ``sparse`` only records the dense module's gradient format (the
    cores' gradients are dense)."""

    role = "embedding"
    format = "ttm"
    report_format = "ttm"
    shape_options = ("row_shape", "col_shape")
    sparse = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None,
        row_shape: Sequence[int] | None,
        col_shape: Sequence[int] | None,
        rank: int | Sequence[int],
        tau: float,
        lookup: str,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.num_embeddings = check_int(num_embeddings, "num_embeddings", 1)
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", 1)
        self.padding_idx = _check_padding_idx(padding_idx, num_embeddings)
        check_float_dtype(dtype)
        self.row_shape, self.col_shape = _table_shapes(num_embeddings, embedding_dim, row_shape, col_shape)
        self.lookup = lookup
        shapes = ttm_core_shapes(self.row_shape, self.col_shape, resolve_ranks(rank, self.bond_sizes))
        self._build_train(shapes, tau, device, dtype)
        self.reset_parameters()

    @property
    def lookup(self) -> str:
        """Lookup path: one of :data:`LOOKUPS` (docs/method.md section 6)."""
        return self._lookup

    @lookup.setter
    def lookup(self, value: str) -> None:
        if value not in _LOOKUP_SETTINGS:
            raise ValueError(f"lookup must be one of {LOOKUPS}, got {value!r}")
        self._lookup = value

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        return tuple(m * n for m, n in zip(self.row_shape, self.col_shape))

    def dense_num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gaussian cores whose reconstructed entries have variance 1 (as ``nn.Embedding``); gates 1."""
        for core, std in zip(self.cores, core_std(1.0, self.max_ranks)):
            core.normal_(0.0, std)
        for gate in self.gates:
            gate.fill_(1.0)

    def _check_indices(self, indices: torch.Tensor) -> None:
        """Raise ``TypeError`` for a non-integer index tensor and ``IndexError`` for an index out of range."""
        valid = f"[0, {self.num_embeddings - 1}] (num_embeddings={self.num_embeddings})"
        if not isinstance(indices, torch.Tensor):
            raise TypeError(
                f"input must be a torch.Tensor of indices in {valid}, got {type(indices).__name__}"
            )
        if indices.dtype not in _INDEX_DTYPES:
            raise TypeError(
                f"input must hold integer indices (torch.int64 or torch.int32) in {valid}, "
                f"got dtype {indices.dtype}"
            )
        if indices.numel() == 0 or indices.is_meta or in_graph_capture():
            return
        low, high = torch.stack(torch.aminmax(indices)).tolist()
        bad = low if low < 0 else high if high >= self.num_embeddings else None
        if bad is not None:
            raise IndexError(f"index {bad} is out of range: indices must be in {valid}")

    def _lookup_rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``(R, embedding_dim)`` for 1-D ``indices`` and where each index finds its row (None: in
        order)."""
        path, dedup = _LOOKUP_SETTINGS[self.lookup]
        if path == "optimized" and self.serves_from_cache():
            rows, position = ttm_lookup_rows(
                self.core_list(), indices, path, dedup, halves=self._cached_halves, workspace=self.workspace
            )
        else:
            rows, position = ttm_lookup_rows(
                self.gated_cores(), indices, path, dedup, workspace=self.workspace
            )
        if rows.shape[1] != self.embedding_dim:
            rows = rows[:, : self.embedding_dim]
        return rows, position

    @property
    def workspace(self) -> Workspace:
        """Scratch buffers of the lookup, reused across calls and sized to the largest call so far."""
        workspace = self.__dict__.get("_workspace")
        if workspace is None:
            workspace = self.__dict__["_workspace"] = Workspace()
        return workspace

    def release_workspace(self) -> None:
        """Free the lookup's scratch buffers (e.g. after a peak batch); later calls regrow them."""
        self.workspace.release()

    def _cached_halves(self, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inference_cached(("halves", split), lambda: split_halves(self.gated_cores(), split))

    def to_dense(self) -> torch.Tensor:
        """The table as ``nn.Embedding.weight`` holds it: ``(num_embeddings, embedding_dim)``, gates applied,
        the ``padding_idx`` row zero."""
        table = ttm_full(self.gated_cores())[: self.num_embeddings, : self.embedding_dim]
        if self.padding_idx is not None:
            table = table.index_fill(0, torch.tensor([self.padding_idx], device=table.device), 0.0)
        return table

    def tied_logits(
        self, hidden: torch.Tensor, bias: torch.Tensor | None = None, order: str = "auto"
    ) -> torch.Tensor:
        """``hidden @ E^T + bias`` with ``E = self.to_dense()``, computed from the cores as the TTM of the
        transposed map (``m_k`` and ``n_k`` swapped) by the orders of :mod:`comera.tt.paths`.

        Args:
            hidden: ``(*, embedding_dim)`` floating-point activations.
            bias: ``(num_embeddings,)`` or None.
            order: ``"auto"`` or one of :data:`comera.tt.costs.ORDERS`.

        Returns:
            ``(*, num_embeddings)`` logits (in the autocast dtype under autocast, as ``nn.Linear``'s).
        """
        if order not in _ORDER_CHOICES:
            raise ValueError(f"order must be one of {_ORDER_CHOICES}, got {order!r}")
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
            raise TypeError(f"hidden must be a floating-point torch.Tensor, got {hidden!r:.80}")
        if hidden.dim() == 0 or hidden.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"hidden must have shape (*, {self.embedding_dim}) (embedding_dim={self.embedding_dim}), "
                f"got {tuple(hidden.shape)}"
            )
        weight_dtype = self.cores[0].dtype
        if hidden.dtype != weight_dtype and not torch.is_autocast_enabled(hidden.device.type):
            raise ValueError(
                f"hidden dtype {hidden.dtype} does not match the table's parameters ({weight_dtype}); "
                "convert one of them, e.g. head.to(hidden.dtype)"
            )
        lead = hidden.shape[:-1]
        if self.shapes_only(hidden):
            return hidden.new_empty(*lead, self.num_embeddings)
        x = hidden.reshape(-1, self.embedding_dim)
        cores = [core.transpose(1, 2) for core in self.gated_cores()]
        backward = torch.is_grad_enabled()
        if order == "auto":
            order = auto_ttm_order(x.shape[0], self.col_shape, self.row_shape, self.max_ranks, backward)
        split = None
        if order == "merge":
            split = ttm_merge_split(x.shape[0], self.col_shape, self.row_shape, self.max_ranks, backward)
        logits = ttm_linear(x, cores, self.num_embeddings, bias, order, split, zero_output=self.padding_idx)
        logits = autocast_output(logits)
        return logits if hidden.dim() == 2 else logits.reshape(*lead, self.num_embeddings)

    @torch.no_grad()
    def _load_table(self, weight: torch.Tensor) -> None:
        """Set the cores to the TT-SVD of ``weight`` (``(num_embeddings, embedding_dim)``), gates to 1."""
        rows, cols = math.prod(self.row_shape), math.prod(self.col_shape)
        padded = functional.pad(
            weight.detach(), (0, cols - self.embedding_dim, 0, rows - self.num_embeddings)
        )
        for param, core in zip(self.cores, ttm_svd(padded, self.row_shape, self.col_shape, self.max_ranks)):
            param.copy_(core)
        for gate in self.gates:
            gate.fill_(1.0)

    def _dense_keywords(self) -> dict[str, Any]:
        """Constructor keywords the dense module and this table share beyond the two sizes."""
        raise NotImplementedError

    def spec(self, name_of: NameOf | None = None) -> dict[str, Any]:
        """``{"kind", num_embeddings, embedding_dim, padding_idx, row_shape, col_shape, rank (stored), tau,
        lookup, sparse}``; a bag adds ``mode`` and ``include_last_offset``."""
        return {
            "kind": self.kind,
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            **self._dense_keywords(),
            "row_shape": list(self.row_shape),
            "col_shape": list(self.col_shape),
            "rank": list(self.max_ranks),
            "tau": self.tau,
            "lookup": self.lookup,
            "sparse": self.sparse,
        }

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        resolve: Resolve | None = None,
    ) -> _TTMTable:
        """A fresh table with the sizes, shapes, stored ranks and settings recorded in ``spec``."""
        arguments = spec_arguments(cls, spec)
        sparse = arguments.pop("sparse", False)
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be a bool, got {sparse!r}")
        size, dim = arguments.pop("num_embeddings"), arguments.pop("embedding_dim")
        layer = cls(size, dim, **arguments, device=device, dtype=dtype)
        layer.sparse = sparse
        layer._restore_stored_ranks(spec["rank"])
        return layer

    @classmethod
    def converts(cls, module: nn.Module) -> bool:
        """Only the exact dense type (subclasses may change the lookup)."""
        return type(module) is cls.dense_type

    @classmethod
    def from_dense(cls, module: nn.Module, *, init: str = "tt_svd", **options: Any) -> _TTMTable:
        """The table standing for the dense ``module``: its sizes, ``padding_idx`` (bag: ``mode``,
        ``include_last_offset``), ``sparse``, device, dtype and training mode; cores by TT-SVD of its weight
        or random at the weight's scale. ``options``: constructor keywords (shapes, rank, tau, lookup).
        ``max_norm`` and ``scale_grad_by_freq`` have no TTM equivalent and are refused."""
        _check_source(module, cls.dense_type)  # type: ignore[arg-type]  # every table class sets dense_type
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        layer = cls._like(module, **options)  # type: ignore[attr-defined]  # defined by each table class
        if init == "tt_svd":
            layer._load_table(module.weight)
        else:
            layer.match_scale_(module.weight)
        layer.sparse = bool(module.sparse)
        return layer.train(module.training)

    def to_dense_module(self, dense_of: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Module:
        """The dense ``nn.Embedding`` / ``nn.EmbeddingBag`` with table :meth:`to_dense` and every attribute
        of this table (``padding_idx``, ``sparse``; bag: ``mode``, ``include_last_offset``)."""
        like = self.cores[0]
        dense = self.dense_type(  # type: ignore[misc]  # every table class sets dense_type
            self.num_embeddings,
            self.embedding_dim,
            **self._dense_keywords(),
            sparse=self.sparse,
            device=like.device,
            dtype=like.dtype,
        )
        with torch.no_grad():
            dense.weight.copy_(self.to_dense())  # type: ignore[operator]  # nn.Module.__getattr__
        return dense.train(self.training)

    def dense_attributes(self) -> dict[str, Any]:
        return {
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            **self._dense_keywords(),
        }

    @property
    def mode_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (tuple(self.row_shape), tuple(self.col_shape))

    def extra_repr(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}{padding}, row_shape={self.row_shape}, "
            f"col_shape={self.col_shape}, ranks={self.ranks}, max_ranks={self.max_ranks}, "
            f"lookup={self.lookup!r}, compression={self.compression:.1f}x"
        )


def _check_source(module: nn.Module, kind: type) -> None:
    if not isinstance(module, kind):
        raise TypeError(f"expected an {kind.__name__}, got {type(module).__name__}")
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise ValueError(
            f"{kind.__name__} with max_norm or scale_grad_by_freq has no TTM equivalent, got "
            f"max_norm={module.max_norm}, scale_grad_by_freq={module.scale_grad_by_freq}"
        )


@register_layer
class TTMEmbedding(_TTMTable):
    """Drop-in for ``nn.Embedding`` whose table is a TTM with rank gates on every bond.

    Args:
        num_embeddings: number of rows ``V``.
        embedding_dim: size of each row ``D``.
        padding_idx: a row that reads as zeros and gets no gradient (negative counts from the end).
        row_shape: row modes ``m_k``, product ``>= V`` (extra rows are never returned); default
            :func:`comera.tt.shapes.auto_modes` (balanced, padded when ``V`` folds badly).
        col_shape: column modes ``n_k``, product ``>= D``; default balanced, descending. Shapes of different
            lengths are padded at the end with modes of size 1.
        rank: max rank per bond (int) or ``d - 1`` ints, clipped to what the shapes allow.
        tau: gate threshold; entries with ``|g| <= tau`` are dead.
        lookup: one of :data:`LOOKUPS` (docs/method.md section 6).

    Shape:
        input: integer tensor of any shape ``(*)``, values in ``[0, V)`` -> output ``(*, D)``.

    Examples:
        >>> import torch
        >>> import comera
        >>> table = comera.TTMEmbedding(10000, 64, rank=16)  # in place of nn.Embedding(10000, 64)
        >>> table(torch.tensor([[1, 2, 3], [4, 5, 6]])).shape
        torch.Size([2, 3, 64])
        >>> table.num_parameters() < 10000 * 64
        True
    """

    dense_type = nn.Embedding

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        row_shape: Sequence[int] | None = None,
        col_shape: Sequence[int] | None = None,
        rank: int | Sequence[int] = DEFAULT_RANK,
        tau: float = DEFAULT_TAU,
        lookup: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, row_shape, col_shape, rank, tau, lookup, device, dtype
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Rows of the table: ``(*) -> (*, embedding_dim)``."""
        self._check_indices(input)
        if self.shapes_only(input):
            return self.cores[0].new_empty(*input.shape, self.embedding_dim, device="meta")
        flat = input.reshape(-1)
        rows, position = self._lookup_rows(flat)
        out = rows if position is None else rows_at(rows, position)
        if self.padding_idx is not None:
            out = out * (flat != self.padding_idx).unsqueeze(1).to(out.dtype)
        return out.reshape(*input.shape, self.embedding_dim)

    def _dense_keywords(self) -> dict[str, Any]:
        return {"padding_idx": self.padding_idx}

    def pruned_stand_in(self) -> RemovedEmbedding:
        """A :class:`RemovedEmbedding` with this table's sizes, ``padding_idx`` and ``sparse``."""
        like = self.cores[0]
        removed = RemovedEmbedding(
            self.num_embeddings,
            self.embedding_dim,
            padding_idx=self.padding_idx,
            sparse=self.sparse,
            device=like.device,
            dtype=like.dtype,
        )
        return removed.train(self.training)

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        *,
        rank: int | Sequence[int] = DEFAULT_RANK,
        row_shape: Sequence[int] | None = None,
        col_shape: Sequence[int] | None = None,
        tau: float = DEFAULT_TAU,
        lookup: str = "auto",
    ) -> TTMEmbedding:
        """A table initialised from ``embedding`` by TT-SVD (exact when ranks are maximal); ``padding_idx``,
        device and dtype follow ``embedding``."""
        _check_source(embedding, nn.Embedding)
        layer = cls._like(
            embedding, row_shape=row_shape, col_shape=col_shape, rank=rank, tau=tau, lookup=lookup
        )
        layer._load_table(embedding.weight)
        return layer

    @classmethod
    def _like(cls, embedding: nn.Embedding, **options: Any) -> TTMEmbedding:
        """A table with ``embedding``'s sizes, ``padding_idx``, device and dtype; cores freshly initialised.
        ``options``: the constructor's keyword arguments (shapes, rank, tau, lookup)."""
        weight = embedding.weight
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            device=weight.device,
            dtype=weight.dtype,
            **options,
        )


@register_layer
class TTMEmbeddingBag(_TTMTable):
    """Drop-in for ``nn.EmbeddingBag``: sums, means or maxima (``functional.embedding_bag``) of bags of TTM
    table rows, looked up as :class:`TTMEmbedding` does.

    Args:
        num_embeddings: table size ``V``.
        embedding_dim: row size ``D``.
        mode: ``"sum"``, ``"mean"`` or ``"max"``.
        include_last_offset: as ``nn.EmbeddingBag`` (``offsets`` has ``B + 1`` entries).
        padding_idx: entries equal to it are left out of their bag (and of the mean's count).
        row_shape: as :class:`TTMEmbedding`.
        col_shape: as :class:`TTMEmbedding`.
        rank: as :class:`TTMEmbedding`.
        tau: as :class:`TTMEmbedding`.
        lookup: as :class:`TTMEmbedding`.

    Shape:
        input ``(B, L)`` (``offsets`` None) or ``(N,)`` with ``offsets`` ``(B,)``; ``per_sample_weights``
        (``mode="sum"`` only) shaped like ``input``; output ``(B, D)``, zeros for an empty bag.

    Examples:
        >>> import torch
        >>> import comera
        >>> bags = comera.TTMEmbeddingBag(1000, 32, mode="sum", rank=8)
        >>> ids, offsets = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 2])  # bags [3, 1] and [4, 1, 5]
        >>> bags(ids, offsets).shape
        torch.Size([2, 32])
    """

    dense_type = nn.EmbeddingBag

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mode: str = "mean",
        *,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        row_shape: Sequence[int] | None = None,
        col_shape: Sequence[int] | None = None,
        rank: int | Sequence[int] = DEFAULT_RANK,
        tau: float = DEFAULT_TAU,
        lookup: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if mode not in _BAG_MODES:
            raise ValueError(f"mode must be one of {_BAG_MODES}, got {mode!r}")
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, row_shape, col_shape, rank, tau, lookup, device, dtype
        )
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled rows of each bag: ``(B, L)`` or ``(N,)`` with ``offsets`` -> ``(B, embedding_dim)``."""
        self._check_indices(input)
        if input.dim() not in (1, 2):
            raise ValueError(
                f"input must be 1-D (with offsets) or 2-D (B, L), got shape {tuple(input.shape)}"
            )
        bags = self._check_offsets(input, offsets)
        if self.shapes_only(input):
            return self.cores[0].new_empty(bags, self.embedding_dim, device="meta")
        flat = input.reshape(-1)
        rows, position = self._lookup_rows(flat)
        if position is None:
            position = torch.arange(flat.shape[0], device=flat.device)
        padding = None
        if self.padding_idx is not None:
            padding = rows.shape[0]
            position = torch.where(flat == self.padding_idx, padding, position)
            rows = torch.cat([rows, rows.new_zeros(1, self.embedding_dim)])
        if isinstance(offsets, torch.Tensor):
            offsets = offsets.to(position.dtype)
        return functional.embedding_bag(
            position.reshape(input.shape),
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )

    def _check_offsets(self, input: torch.Tensor, offsets: torch.Tensor | None) -> int:
        """The number of bags; ``TypeError`` / ``ValueError`` naming ``offsets`` unless they are the starts
        of the bags of a 1-D ``input``: integers, 1-D, from 0, never decreasing, at most ``input.numel()``
        (values are checked with one device sync, skipped inside a captured or compiled graph)."""
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError(f"offsets must be None for a 2-D input (B, L), got {type(offsets).__name__}")
            return input.shape[0]
        if not isinstance(offsets, torch.Tensor):
            raise TypeError(f"a 1-D input needs offsets, a 1-D integer torch.Tensor; got {offsets!r:.40}")
        if offsets.dtype not in _INDEX_DTYPES:
            raise TypeError(
                f"offsets must hold integer positions (torch.int64 or torch.int32), got dtype {offsets.dtype}"
            )
        if offsets.dim() != 1:
            raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
        bags = offsets.shape[0] - (1 if self.include_last_offset else 0)
        if offsets.numel() == 0 or offsets.is_meta or in_graph_capture():
            return max(bags, 0)
        first, last, falls = torch.stack(
            [offsets[0], offsets[-1], (offsets[1:] < offsets[:-1]).any().to(offsets.dtype)]
        ).tolist()
        if first != 0 or falls or last > input.shape[0]:
            raise ValueError(
                f"offsets must start at 0, never decrease and not exceed the number of indices "
                f"({input.shape[0]}); got {offsets.tolist() if offsets.numel() <= 16 else 'other values'}"
            )
        return max(bags, 0)

    def _dense_keywords(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "include_last_offset": self.include_last_offset,
            "padding_idx": self.padding_idx,
        }

    def pruned_stand_in(self) -> RemovedEmbeddingBag:
        """A :class:`RemovedEmbeddingBag` with this bag's sizes, mode, offsets convention, ``padding_idx``
        and ``sparse``."""
        like = self.cores[0]
        removed = RemovedEmbeddingBag(
            self.num_embeddings,
            self.embedding_dim,
            **self._dense_keywords(),
            sparse=self.sparse,
            device=like.device,
            dtype=like.dtype,
        )
        return removed.train(self.training)

    @classmethod
    def from_embedding_bag(
        cls,
        bag: nn.EmbeddingBag,
        *,
        rank: int | Sequence[int] = DEFAULT_RANK,
        row_shape: Sequence[int] | None = None,
        col_shape: Sequence[int] | None = None,
        tau: float = DEFAULT_TAU,
        lookup: str = "auto",
    ) -> TTMEmbeddingBag:
        """A bag initialised from ``bag`` by TT-SVD; mode, ``include_last_offset``, ``padding_idx``, device
        and dtype follow ``bag``."""
        _check_source(bag, nn.EmbeddingBag)
        layer = cls._like(bag, row_shape=row_shape, col_shape=col_shape, rank=rank, tau=tau, lookup=lookup)
        layer._load_table(bag.weight)
        return layer

    @classmethod
    def _like(cls, bag: nn.EmbeddingBag, **options: Any) -> TTMEmbeddingBag:
        """A bag with ``bag``'s sizes, mode, ``include_last_offset``, ``padding_idx``, device and dtype; cores
        freshly initialised. ``options``: the constructor's keyword arguments (shapes, rank, tau, lookup)."""
        weight = bag.weight
        return cls(
            bag.num_embeddings,
            bag.embedding_dim,
            bag.mode,
            include_last_offset=bag.include_last_offset,
            padding_idx=bag.padding_idx,
            device=weight.device,
            dtype=weight.dtype,
            **options,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
