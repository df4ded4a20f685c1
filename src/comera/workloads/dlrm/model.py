"""DLRM for click-through prediction on Criteo-format data (Naumov et al., 2019, the public DLRM reference for
Criteo Kaggle): bottom MLP, one embedding bag per categorical field (``tables.0`` ... ``tables.25``), dot
interaction, top MLP. Details: docs/method.md, 'Experiments and workloads'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from comera.io import MODEL_ATTRIBUTE, register_model
from comera.workloads.dlrm.criteo import KAGGLE_CARDINALITIES

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "DLRM",
    "DotInteraction",
    "MODEL_PRESETS",
    "dlrm_preset",
    "reference_table",
]

# Rows of the 26 Criteo Kaggle tables in the DLRM reference (kept with the parser,
# comera.workloads.dlrm.criteo).
CRITEO_KAGGLE_CARDINALITIES = KAGGLE_CARDINALITIES


def _capped(cap: int) -> tuple[int, ...]:
    return tuple(min(rows, cap) for rows in CRITEO_KAGGLE_CARDINALITIES)


# Model presets: keyword arguments of DLRM. "paper" is the reference architecture at full Kaggle size; "small"
# caps the tables for a CPU demo of a few minutes; "smoke" is tiny, for tests.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "cardinalities": CRITEO_KAGGLE_CARDINALITIES,
        "bottom_mlp": (13, 512, 256, 64, 16),
        "top_mlp": (512, 256, 1),
    },
    "small": {
        "cardinalities": _capped(200_000),
        "bottom_mlp": (13, 512, 256, 64, 16),
        "top_mlp": (512, 256, 1),
    },
    "smoke": {
        "cardinalities": _capped(1_000),
        "bottom_mlp": (13, 16, 8),
        "top_mlp": (16, 1),
    },
}


def dlrm_preset(name: str) -> dict[str, Any]:
    """Keyword arguments of :class:`DLRM` for preset ``name``: ``"paper"``, ``"small"`` or ``"smoke"``."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown DLRM preset {name!r}; valid presets: {sorted(MODEL_PRESETS)}")
    return {key: tuple(value) for key, value in MODEL_PRESETS[name].items()}


def _check_sizes(value: object, name: str, minimum_length: int) -> tuple[int, ...]:
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or len(value) < minimum_length
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        raise ValueError(f"{name} must be a sequence of at least {minimum_length} ints >= 1, got {value!r}")
    return tuple(value)


class DotInteraction(nn.Module):
    """Pairwise dot products of the bottom-MLP output and the field embeddings, after the bottom output.

    Shape:
        ``bottom`` ``(B, D)`` and ``embedded`` ``(B, F, D)`` -> ``(B, D + (F + 1) F / 2)``: the ``bottom``
        vector, then ``<v_i, v_j>`` for ``i < j`` in row-major order over the ``F + 1`` vectors
        ``v = (bottom, embedded_0, ..., embedded_{F-1})``.
    """

    def __init__(self, num_fields: int) -> None:
        super().__init__()
        vectors = num_fields + 1
        first, second = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("first", first, persistent=False)
        self.register_buffer("second", second, persistent=False)

    @property
    def num_outputs(self) -> int:
        """Pairwise products: ``(F + 1) F / 2``."""
        return self.first.numel()

    def forward(self, bottom: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """``(B, D), (B, F, D) -> (B, D + (F + 1) F / 2)``."""
        vectors = torch.cat([bottom.unsqueeze(1), embedded], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([bottom, gram[:, self.first, self.second]], dim=1)


def _mlp(sizes: Sequence[int], last_activation: bool) -> nn.Sequential:
    """Linear layers ``sizes[0] -> ... -> sizes[-1]`` with ReLU between them (and after the last if asked),
    initialised as the DLRM reference (weights ``N(0, 2 / (fan_in + fan_out))``, biases ``N(0, 1 /
    fan_out)``).
    """
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
        layers.append(linear)
        if last_activation or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def reference_table(index: int, rows: int, dim: int) -> nn.EmbeddingBag:
    """Table ``index`` of the DLRM reference: a sum bag ``rows x dim`` initialised ``U(+-sqrt(1 / rows))``."""
    table = nn.EmbeddingBag(rows, dim, mode="sum")
    with torch.no_grad():
        table.weight.uniform_(-math.sqrt(1.0 / rows), math.sqrt(1.0 / rows))
    return table


@register_model("dlrm")
class DLRM(nn.Module):
    """DLRM: bottom MLP, one sum-pooled embedding bag per categorical field, dot interaction, top MLP.

    Args:
        cardinalities: rows of each categorical table (26 for Criteo).
        bottom_mlp: sizes of the bottom MLP including its input (the dense features) and output (the
            embedding size ``D``), e.g. ``(13, 512, 256, 64, 16)``.
        top_mlp: sizes of the top MLP after its input (``D + (F + 1) F / 2``, computed), ending in 1,
            e.g. ``(512, 256, 1)``.
        table_factory: ``table_factory(index, rows, dim)`` builds table ``index`` instead of the default
            ``nn.EmbeddingBag(rows, dim, mode="sum")`` with the reference's uniform initialisation (e.g. a
            :class:`comera.TTMEmbeddingBag` built directly, without allocating the dense table). Not
            recorded for :func:`comera.save_pretrained`, which records tensorized layers itself.

    Shape:
        ``dense`` ``(B, bottom_mlp[0])`` float; ``ids`` one of

        - ``(F, B)`` integer tensor: one id per field and sample;
        - ``(F, B, L)`` integer tensor: bags of ``L`` ids;
        - a sequence of ``F`` 1-D id tensors with ``offsets`` ``F`` 1-D tensors (or an ``(F, B)`` tensor)
          giving where each sample's bag starts, as ``nn.EmbeddingBag``.

        Output: ``(B,)`` logits.
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        bottom_mlp: Sequence[int] = (13, 512, 256, 64, 16),
        top_mlp: Sequence[int] = (512, 256, 1),
        table_factory: Callable[[int, int, int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        cardinalities = _check_sizes(cardinalities, "cardinalities", 1)
        bottom_mlp = _check_sizes(bottom_mlp, "bottom_mlp", 2)
        top_mlp = _check_sizes(top_mlp, "top_mlp", 1)
        if top_mlp[-1] != 1:
            raise ValueError(f"top_mlp must end in 1 (one logit), got {top_mlp}")
        self.cardinalities = cardinalities
        self.embedding_dim = bottom_mlp[-1]
        self.num_dense = bottom_mlp[0]
        self.bottom = _mlp(bottom_mlp, last_activation=True)
        build = table_factory or reference_table
        self.tables = nn.ModuleList(
            build(index, rows, self.embedding_dim) for index, rows in enumerate(cardinalities)
        )
        self.interaction = DotInteraction(len(cardinalities))
        self.top = _mlp((self.embedding_dim + self.interaction.num_outputs, *top_mlp), last_activation=False)
        setattr(
            self,
            MODEL_ATTRIBUTE,
            {
                "name": "dlrm",
                "kwargs": {
                    "cardinalities": list(cardinalities),
                    "bottom_mlp": list(bottom_mlp),
                    "top_mlp": list(top_mlp),
                },
            },
        )

    @classmethod
    def from_preset(cls, name: str) -> DLRM:
        """The dense model of preset ``name`` (``"paper"``, ``"small"`` or ``"smoke"``)."""
        return cls(**dlrm_preset(name))

    @property
    def num_fields(self) -> int:
        """Categorical fields ``F``."""
        return len(self.tables)

    def embed(
        self,
        ids: torch.Tensor | Sequence[torch.Tensor],
        offsets: torch.Tensor | Sequence[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Pooled embeddings of every field: ``(B, F, D)`` (see the class docstring for ``ids``)."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() not in (2, 3) or ids.shape[0] != self.num_fields:
                raise ValueError(
                    f"ids must have shape ({self.num_fields}, B) or ({self.num_fields}, B, L), "
                    f"got {tuple(ids.shape)}"
                )
            if offsets is not None:
                raise ValueError("offsets must be None when ids is an (F, B) or (F, B, L) tensor")
            bags = ids.unsqueeze(2) if ids.dim() == 2 else ids
            pooled = [table(bags[field]) for field, table in enumerate(self.tables)]
        else:
            if len(ids) != self.num_fields or offsets is None or len(offsets) != self.num_fields:
                raise ValueError(
                    f"ids given per field must come as {self.num_fields} id tensors with {self.num_fields} "
                    f"offset tensors, got {len(ids)} and {None if offsets is None else len(offsets)}"
                )
            pooled = [table(ids[field], offsets[field]) for field, table in enumerate(self.tables)]
        return torch.stack(pooled, dim=1)

    def forward(
        self,
        dense: torch.Tensor,
        ids: torch.Tensor | Sequence[torch.Tensor],
        offsets: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Click logits ``(B,)`` for dense features ``(B, num_dense)`` and the categorical ``ids``."""
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must have shape (B, {self.num_dense}), got {tuple(dense.shape)}")
        bottom = self.bottom(dense)
        embedded = self.embed(ids, offsets)
        if embedded.shape[0] != bottom.shape[0]:
            raise ValueError(
                f"ids give {embedded.shape[0]} samples but dense has {bottom.shape[0]} (batch sizes differ)"
            )
        logits = self.top(self.interaction(bottom, embedded))
        return logits.squeeze(1).clone()  # not a view: FSDP2 loses its backward hook on in-place ops to one
