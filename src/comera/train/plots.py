"""PNG plots of a run folder's ``metrics.jsonl`` (``loss.png``, ``ratio.png``, ``ranks.png``, with stage
switches and prunes marked; needs matplotlib, the ``bench`` extra). Details: docs/recipes.md, 'The run
folder'.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from comera.train.metrics import METRICS_NAME, carries_ranks, read_metrics, record_problem

__all__ = [
    "COMPARISON_AXES",
    "NoTrainingRecordError",
    "plot_run",
    "plot_comparison",
    "plot_finished_run",
    "rank_history",
]


class NoTrainingRecordError(ValueError):
    """A run's ``metrics.jsonl`` holds no training record, so there is nothing to plot."""


def rank_history(records: list[dict[str, Any]]) -> tuple[list[str], list[int], np.ndarray]:
    """Rows ``"layer[bond]"``, the logged steps, and the ``(rows, steps)`` matrix of active ranks (0 where a
    layer or bond is missing from a record).
    """
    train = [record for record in records if record.get("kind") == "train"]
    labels: list[str] = []
    for record in train:
        for name, ranks in record["ranks"].items():
            for bond in range(len(ranks)):
                label = f"{name}[{bond}]"
                if label not in labels:
                    labels.append(label)
    matrix = np.zeros((len(labels), len(train)), dtype=np.int64)
    row = {label: index for index, label in enumerate(labels)}
    for column, record in enumerate(train):
        for name, ranks in record["ranks"].items():
            for bond, rank in enumerate(ranks):
                matrix[row[f"{name}[{bond}]"], column] = rank
    return labels, [record["step"] for record in train], matrix


_EVENT_STYLES = {"late_stage": ("tab:red", "late stage"), "prune": ("tab:gray", "prune")}


def _has_events(records: list[dict[str, Any]]) -> bool:
    return any(r.get("kind") == "event" and r.get("event") in _EVENT_STYLES for r in records)


def _events(axes, records: list[dict[str, Any]], prefix: str = "") -> None:
    shown: set[str] = set()
    for record in records:
        style = _EVENT_STYLES.get(record.get("event"))  # type: ignore[arg-type]  # a missing event gives None
        if record.get("kind") != "event" or style is None:
            continue
        color, label = style[0], prefix + style[1]
        axes.axvline(
            record["step"],
            color=color,
            linestyle="--",
            linewidth=0.8,
            label=None if label in shown else label,
        )
        shown.add(label)


def _checked_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records; ``ValueError`` naming the line of one that is not an object (:func:`read_metrics`)
    or the record that lacks a key or holds a value of the wrong type (:func:`record_problem`)."""
    records = read_metrics(run_dir)
    ranked = carries_ranks(records)
    for number, record in enumerate(records, 1):
        problem = record_problem(record, ranked)
        if problem is not None:
            raise ValueError(f"{run_dir / METRICS_NAME}: record {number} ({record.get('kind')}) {problem}")
    return records


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write ``loss.png``, ``ratio.png`` and ``ranks.png`` (runs whose records carry ranks) for the run in
    ``run_dir``; returns their paths.

    Args:
        run_dir: folder holding ``metrics.jsonl``.
        out_dir: where to write; default ``run_dir/plots``.

    Raises:
        FileNotFoundError: no ``metrics.jsonl``. NoTrainingRecordError (a ``ValueError``): it holds no
            training record. ValueError: a record is not an object or lacks a key.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(8, 2))
        >>> data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
        >>> def loss_fn(model, batch):
        ...     return nn.functional.cross_entropy(model(batch[0]), batch[1])
        >>> with tempfile.TemporaryDirectory() as run:
        ...     config = comera.TrainConfig(early=2, batch_size=8, run_dir=run, plot=False, progress=False)
        ...     _ = comera.Trainer(model, loss_fn, data, config=config).fit()  # writes run/metrics.jsonl
        ...     sorted(path.name for path in comera.plot_run(run))  # into run/plots
        ['loss.png', 'ratio.png']
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    run_dir = Path(run_dir)
    records = _checked_records(run_dir)
    train = [record for record in records if record.get("kind") == "train"]
    if not train:
        raise NoTrainingRecordError(f"{run_dir}: metrics.jsonl holds no training record to plot")
    evals = [
        record
        for record in records
        if record.get("kind") == "eval" and isinstance(record.get("metrics"), dict)
    ]
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    if out.exists() and not out.is_dir():
        raise ValueError(f"the plot folder {out} is a file; give a folder (--out)")
    out.mkdir(parents=True, exist_ok=True)
    steps = [record["step"] for record in train]
    written = []

    figure, axes = plt.subplots(1, 2 if evals else 1, figsize=(11 if evals else 6, 4), squeeze=False)
    axes[0, 0].plot(steps, [record["loss"] for record in train], label="train loss")
    axes[0, 0].set(xlabel="step", ylabel="task loss", title="training loss")
    _events(axes[0, 0], records)
    axes[0, 0].legend()
    if evals:
        names = sorted({name for record in evals for name in record["metrics"]})
        for name in names:
            points = [(r["step"], r["metrics"][name]) for r in evals if name in r["metrics"]]
            axes[0, 1].plot(*zip(*points), marker="o", label=name)
        axes[0, 1].set(xlabel="step", title="evaluation")
        _events(axes[0, 1], records)
        axes[0, 1].legend()
    written.append(_save(figure, out / "loss.png", plt))

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(steps, [record["ratio"] for record in train])
    axis.set(xlabel="step", ylabel="size / initial size", title="compression ratio", ylim=(0, None))
    _events(axis, records)
    if axis.get_legend_handles_labels()[1]:
        axis.legend()
    written.append(_save(figure, out / "ratio.png", plt))

    if not any("ranks" in record for record in train):
        return written
    labels, rank_steps, matrix = rank_history(records)
    figure, axis = plt.subplots(figsize=(8, max(3.0, 0.25 * len(labels) + 1.5)))
    image = axis.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    ticks = np.linspace(0, len(rank_steps) - 1, min(len(rank_steps), 8)).round().astype(int)
    axis.set_xticks(ticks, [str(rank_steps[i]) for i in ticks])
    axis.set(xlabel="step", title="active rank per layer bond")
    figure.colorbar(image, ax=axis, label="rank")
    written.append(_save(figure, out / "ranks.png", plt))
    return written


def plot_finished_run(run_dir: Path) -> None:
    """:func:`plot_run` at the end of a training run, a by-product: a log with no training record (a resume
    at the last step of a run whose log was lost), a record the plots cannot read or a ``plots/`` path that
    cannot be written warns instead of failing the run."""
    try:
        plot_run(run_dir)
    except NoTrainingRecordError:
        warnings.warn(
            f"{run_dir}: metrics.jsonl holds no training record, so no plot was drawn",
            RuntimeWarning,
            stacklevel=4,
        )
    except (ValueError, OSError) as error:  # a record the plots cannot read, a plots/ path in the way
        warnings.warn(f"not every plot was drawn: {error}", RuntimeWarning, stacklevel=4)


def _save(figure, path: Path, plt) -> Path:
    """Write ``figure`` to ``path`` and close it; ``OSError`` naming the path when it cannot be written (a
    folder or a pipe in its place)."""
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise OSError(f"{path}: cannot write the plot ({error.strerror or error})") from None
    finally:
        plt.close(figure)
    return path


COMPARISON_AXES = ("step", "tokens", "time")
"""The x axes :func:`plot_comparison` draws against: the step, the tokens trained on, the training time."""

_AXIS_LABELS = {"step": "step", "tokens": "tokens trained on", "time": "training time (s)"}


def _x_value(record: dict[str, Any], x: str, tokens_per_step: float | None, run_dir: Path) -> float:
    if x == "step":
        return record["step"]
    if x == "tokens":
        return record["step"] * tokens_per_step
    if "train_time_s" not in record:
        raise ValueError(f"{run_dir}: its evaluation records have no train_time_s (a run from before it)")
    return record["train_time_s"]


def plot_comparison(
    run_dirs: list[str | os.PathLike],
    metric: str,
    path: str | os.PathLike,
    *,
    x: str = "step",
    tokens_per_step: dict[str, float] | None = None,
) -> Path:
    """One figure of the evaluation ``metric`` of several runs against ``x``, with the first run's events
    against the step, or each run's final value when every run was evaluated once.

    Args:
        run_dirs: the run folders; each is labelled by its folder name.
        metric: an evaluation metric every run recorded.
        path: the PNG to write.
        x: ``"step"``, ``"tokens"`` (step times the run's ``tokens_per_step``) or ``"time"`` (the eval
            records' ``train_time_s``).
        tokens_per_step: ``{folder name: tokens per step}``, required for ``x="tokens"``.

    Raises:
        ValueError: an unknown ``x``; a run without an evaluation record with ``metric``, without
            ``tokens_per_step`` (``x="tokens"``) or without ``train_time_s`` (``x="time"``), named.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if x not in COMPARISON_AXES:
        raise ValueError(f"x must be one of {COMPARISON_AXES}, got {x!r}")
    series = []
    for run_dir in map(Path, run_dirs):
        per_step = (tokens_per_step or {}).get(run_dir.name)
        if x == "tokens" and per_step is None:
            raise ValueError(f"{run_dir}: x='tokens' needs its tokens_per_step")
        records = _checked_records(run_dir)
        points = [
            (_x_value(record, x, per_step, run_dir), record["metrics"][metric])
            for record in records
            if record.get("kind") == "eval" and metric in record["metrics"]
        ]
        if not points:
            raise ValueError(f"{run_dir}: no evaluation record has the metric {metric!r}")
        series.append((run_dir.name, records, points))
    figure, axis = plt.subplots(figsize=(8.5, 4))
    if all(len(points) == 1 for _, _, points in series):
        return _final_values(figure, axis, series, metric, Path(path), plt, x)
    events_drawn = x != "step"
    for name, records, points in series:
        axis.plot(*zip(*points), marker="o", label=name)
        if not events_drawn and _has_events(records):
            _events(axis, records, prefix=f"{name}: " if len(series) > 1 else "")
            events_drawn = True
    axis.set(xlabel=_AXIS_LABELS[x], ylabel=metric, title=f"{metric} on the evaluation split")
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(figure, path, plt)


def _final_values(figure, axis, series, metric: str, path: Path, plt, x: str) -> Path:
    """One marker per run at its only evaluation, labelled with the value."""
    names = [name for name, _, _ in series]
    values = [points[0][1] for _, _, points in series]
    axis.plot(names, values, marker="o", linestyle="none", markersize=9)
    for name, value in zip(names, values):
        axis.annotate(f"{value:.4g}", (name, value), textcoords="offset points", xytext=(0, 8), ha="center")
    steps = sorted({points[0][0] for _, _, points in series})
    at = f"step {steps[0]}" if len(steps) == 1 and x == "step" else "the last evaluation"
    axis.set(ylabel=metric, title=f"{metric} on the evaluation split at {at}")
    axis.margins(y=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(figure, path, plt)
