"""``compression_report(model)``: per-layer ranks and exact parameter counts (active-rank core entries, other
parameters once each, "dense" counts with each tensorized layer's dense weight, MiB of fp32), whole model and
tensorized part; ``saved_compression_report`` and ``describe_folder`` for saved and run folders. Details:
docs/method.md section 4.1."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from comera.io import CONFIG_NAME, SavedModel, read_saved, rebuild_layers
from comera.modules import unwrap_model
from comera.nn.layer import is_layer
from comera.tt.cores import mib

__all__ = [
    "LayerReport",
    "CompressionReport",
    "compression_report",
    "saved_compression_report",
    "describe_folder",
    "RUN_MODEL_DIR",
    "RESULTS_NAME",
]

RUN_MODEL_DIR = "model"
RESULTS_NAME = "results.json"


def _ratio(dense: int, params: int) -> float:
    return math.inf if params == 0 else dense / params


def _total_line(label: str, params: int, dense: int) -> str:
    if dense == 0:
        return f"{label + ':':<19}none"
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
    """Per-layer rows and totals; ``str(report)`` is a table.

    Examples:
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        >>> report = comera.compression_report(comera.tensorize_(model, target_modules=["0"], rank=8))
        >>> [(row.name, row.format, row.ranks, row.params, row.dense_params) for row in report.layers]
        [('0', 'tt', (8, 8, 8), 2304, 65536)]
        >>> round(report.tensorized_ratio, 1), round(report.model_ratio, 1)
        (28.4, 18.6)
    """

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


def _layer_report(name: str, layer: nn.Module) -> LayerReport:
    # layer follows the layer protocol (comera.nn.layer), whose attributes nn.Module does not declare
    protocol: Any = layer
    return LayerReport(
        name,
        protocol.report_format,
        protocol.mode_shapes,
        tuple(protocol.max_ranks),
        tuple(protocol.ranks),
        protocol.num_parameters(),
        protocol.dense_num_parameters(),
    )


def _report(layers: list[tuple[str, nn.Module]], other: int) -> CompressionReport:
    """The report of ``layers`` (those owning their weight) plus ``other`` parameters outside them."""
    rows = [_layer_report(name, layer) for name, layer in layers if layer.owns_weight]
    active = sum(row.params for row in rows)
    dense = sum(row.dense_params for row in rows)
    return CompressionReport(tuple(rows), other + active, other + dense)


def compression_report(model: nn.Module) -> CompressionReport:
    """Exact parameter counts of ``model`` at its active ranks, per tensorized layer and in total.

    Examples:
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> report = comera.compression_report(model)
        >>> report.model_dense_params, report.model_params
        (66820, 3588)
        >>> print(report)
        layer  format  shapes             max ranks  ranks  params   dense  ratio
        -------------------------------------------------------------------------
        0      tt      (16,16) x (16,16)  8,8,8      8,8,8   2,304  65,536  28.4x
        -------------------------------------------------------------------------
        tensorized layers: 2,304 params (0.009 MiB) vs 65,536 dense (0.250 MiB), 28.4x
        whole model:       3,588 params (0.014 MiB) vs 66,820 dense (0.255 MiB), 18.6x
    """
    root = unwrap_model(model)
    layers = [(name, module) for name, module in root.named_modules() if is_layer(module)]
    counted = {id(param) for _, layer in layers for param in layer.weight_parameters()}
    other = sum(param.numel() for param in root.parameters() if id(param) not in counted)
    return _report(layers, other)


def _load_layer_state(saved: SavedModel, name: str, layer: nn.Module) -> None:
    prefix = f"{name}."
    state = {key[len(prefix) :]: value for key, value in saved.tensors.items() if key.startswith(prefix)}
    try:
        layer.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(
            f"{saved.directory}: the weights of layer {name!r} do not match its spec ({error})"
        ) from None


def saved_compression_report(directory: str | os.PathLike) -> CompressionReport:
    """:func:`compression_report` of the model saved in ``directory``, from its files alone.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is corrupt or does not match its config.
    """
    saved = read_saved(directory)
    layers = rebuild_layers(saved.config, saved.directory / CONFIG_NAME, lambda name: ("cpu", saved.dtype))
    weight_keys = set()
    for name, layer in layers.items():
        _load_layer_state(saved, name, layer)
        counted = {id(param) for param in layer.weight_parameters()}  # type: ignore[operator]  # a comera layer
        weight_keys |= {f"{name}.{key}" for key, param in layer.named_parameters() if id(param) in counted}
    counted_stored = {saved.stored_name(key) for key in weight_keys}
    skipped = counted_stored | {saved.stored_name(key) for key in saved.config.get("buffers", [])}
    other = sum(
        tensor.numel()
        for key, tensor in saved.tensors.items()
        if key not in saved.config["aliases"] and key not in skipped
    )
    return _report(list(layers.items()), other)


def _results_lines(path: Path) -> list[str]:
    try:
        results = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    lines: list[str] = []

    def add(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            lines.append(f"{prefix}: {json.dumps(value)}")

    add("", results)
    return lines


def _divergence(metrics: Path) -> str | None:
    """The reason of the last ``diverged`` event in a run's ``metrics.jsonl`` when no record follows it (the
    run stopped there), else None."""
    try:
        lines = metrics.read_bytes().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("kind") == "event" and record.get("event") == "diverged":
            return str(record.get("reason", "non-finite steps"))
        return None
    return None


def describe_folder(directory: str | os.PathLike) -> str:
    """The text ``comera report`` prints: the compression report of a :func:`comera.save_pretrained` folder,
    or of a training run folder's ``model/`` save followed by its ``results.json`` (whichever are there).

    Raises:
        FileNotFoundError: ``directory`` holds neither a save nor run results (naming what was looked for).
        ValueError: a file is corrupt.
    """
    directory = Path(directory)
    if (directory / CONFIG_NAME).is_file():
        return str(saved_compression_report(directory))
    model_dir, results = directory / RUN_MODEL_DIR, directory / RESULTS_NAME
    parts = []
    if (model_dir / CONFIG_NAME).is_file():
        parts.append(f"model ({model_dir}):\n{saved_compression_report(model_dir)}")
    if results.is_file():
        parts.append(f"results ({results}):\n" + "\n".join(_results_lines(results)))
    if not parts and (directory / "config.json").is_file():
        diverged = _divergence(directory / "metrics.jsonl")
        if diverged is not None:
            raise FileNotFoundError(
                f"{directory}: a run that diverged ({diverged}), so it has no model; resuming it diverges "
                "again: start it again with other settings (a lower learning rate) and --restart"
            )
        raise FileNotFoundError(
            f"{directory}: a run that has not finished (no {RUN_MODEL_DIR}/ or {RESULTS_NAME} yet); continue "
            "it with comera train ... --resume, or see its progress with comera plot"
        )
    if not parts:
        raise FileNotFoundError(
            f"{directory}: neither a saved model ({CONFIG_NAME}) nor a run folder "
            f"({RUN_MODEL_DIR}/{CONFIG_NAME} or {RESULTS_NAME})"
        )
    return "\n\n".join(parts)
