"""``compression_report(model)``: per-layer ranks and exact parameter counts, whole model and tensorized part.

Counts are exact entries of the active-rank model (docs/method.md section 4): a gated layer holds
``sum_k c_k r_{k-1} r_k`` core entries at its active ranks, 0 with a dead bond; gates are not counted (they
fold into the cores on export). Every other parameter counts its ``numel``, shared parameters once. "Dense"
counts replace each tensorized layer by the dense weight it stands for. MiB are of fp32 values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from comera.nn.gated import GatedTrain
from comera.nn.removed import RemovedLayer
from comera.rank.size import mib
from comera.tensorize import unwrap_model

__all__ = ["LayerReport", "CompressionReport", "compression_report"]


def _ratio(dense: int, params: int) -> float:
    return math.inf if params == 0 else dense / params


def _total_line(label: str, params: int, dense: int) -> str:
    return (
        f"{label + ':':<19}{params:,} params ({mib(params):.3f} MiB) vs {dense:,} dense "
        f"({mib(dense):.3f} MiB), {_ratio(dense, params):.1f}x"
    )


@dataclass(frozen=True)
class LayerReport:
    """One tensorized layer: ``format`` is ``"tt"``, ``"ttm"`` or ``"removed"``; ``shapes`` its mode tuples
    (``(in_shape, out_shape)`` for linears, ``(row_shape, col_shape)`` for TTM, ``(modes,)`` otherwise)."""

    name: str
    format: str
    shapes: tuple[tuple[int, ...], ...]
    max_ranks: tuple[int, ...]
    ranks: tuple[int, ...]
    params: int
    dense_params: int

    @property
    def ratio(self) -> float:
        """Dense over active parameters (``inf`` for a removed layer)."""
        return _ratio(self.dense_params, self.params)


@dataclass(frozen=True)
class CompressionReport:
    """Per-layer rows and totals; ``str(report)`` is a table."""

    layers: tuple[LayerReport, ...]
    model_params: int
    model_dense_params: int

    @property
    def tensorized_params(self) -> int:
        """Active parameters of the tensorized layers."""
        return sum(layer.params for layer in self.layers)

    @property
    def tensorized_dense_params(self) -> int:
        """Parameters the tensorized layers would have as dense weights."""
        return sum(layer.dense_params for layer in self.layers)

    @property
    def tensorized_ratio(self) -> float:
        """Compression of the tensorized layers alone."""
        return _ratio(self.tensorized_dense_params, self.tensorized_params)

    @property
    def model_ratio(self) -> float:
        """Compression of the whole model."""
        return _ratio(self.model_dense_params, self.model_params)

    def __str__(self) -> str:
        header = ("layer", "format", "shapes", "max ranks", "ranks", "params", "dense", "ratio")
        rows = [
            (
                layer.name,
                layer.format,
                " x ".join("(" + ",".join(map(str, s)) + ")" for s in layer.shapes),
                ",".join(map(str, layer.max_ranks)),
                ",".join(map(str, layer.ranks)) or "-",
                f"{layer.params:,}",
                f"{layer.dense_params:,}",
                f"{layer.ratio:.1f}x",
            )
            for layer in self.layers
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        numeric = {5, 6, 7}

        def line(row) -> str:
            cells = [
                cell.rjust(w) if i in numeric else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            ]
            return "  ".join(cells).rstrip()

        rule = "-" * len(line(header))
        totals = [
            _total_line("tensorized layers", self.tensorized_params, self.tensorized_dense_params),
            _total_line("whole model", self.model_params, self.model_dense_params),
        ]
        return "\n".join([line(header), rule, *map(line, rows), rule, *totals])


def _shapes(module: nn.Module) -> tuple[tuple[int, ...], ...]:
    for first, second in (("in_shape", "out_shape"), ("row_shape", "col_shape")):
        if hasattr(module, first) and hasattr(module, second):
            return (tuple(getattr(module, first)), tuple(getattr(module, second)))
    if isinstance(module, GatedTrain):
        cores = list(module.cores)
        if cores[0].dim() == 4:
            return (tuple(c.shape[1] for c in cores), tuple(c.shape[2] for c in cores))
        return (tuple(c.shape[1] for c in cores),)
    if hasattr(module, "in_features"):
        return ((module.in_features,), (module.out_features,))
    return ((module.num_embeddings,), (module.embedding_dim,))


def _layer_report(name: str, module: nn.Module) -> LayerReport:
    if isinstance(module, RemovedLayer):
        return LayerReport(name, "removed", _shapes(module), (), (), 0, module.dense_num_parameters())
    fmt = "ttm" if module.cores[0].dim() == 4 else "tt"
    return LayerReport(
        name,
        fmt,
        _shapes(module),
        module.max_ranks,
        module.ranks,
        module.num_parameters(),
        module.dense_num_parameters(),
    )


def compression_report(model: nn.Module) -> CompressionReport:
    """Exact parameter counts of ``model`` at its active ranks, per tensorized layer and in total."""
    root = unwrap_model(model)
    layers = [
        _layer_report(name, module)
        for name, module in root.named_modules()
        if isinstance(module, (GatedTrain, RemovedLayer))
    ]
    train_params = {
        id(param)
        for module in root.modules()
        if isinstance(module, GatedTrain)
        for param in (*module.cores, *module.gates)
    }
    other = sum(param.numel() for param in root.parameters() if id(param) not in train_params)
    active = sum(layer.params for layer in layers)
    dense = sum(layer.dense_params for layer in layers)
    return CompressionReport(tuple(layers), other + active, other + dense)
