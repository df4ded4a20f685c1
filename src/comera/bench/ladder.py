"""The rank ladder of ``comera bench paper`` (the paper's Fig. 12): every bond cut to each rung's rank (the
highest-scored entries kept, then :func:`comera.prune_`), rungs from the preset's rank
(:func:`default_ladder`: 30 -> 30, 24, 16, 12, 8, 4, 2), and the table and plot of step time against
compression. Details: docs/benchmarks.md, "Time per step against compression"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.measure import allocation_of, fmt, machine_description, pyplot, ratio
from comera.rank import entry_scores, gated_trains, hold_entries, prune_
from comera.rank.prune import PruneResult
from comera.report import compression_report
from comera.tensorize_config import TensorizeConfig

__all__ = [
    "LADDER_FRACTIONS",
    "TARGET_COMPRESSION",
    "TARGET_SPEEDUP",
    "default_ladder",
    "preset_rank",
    "truncate_ranks_",
    "compression_fields",
    "ladder_targets",
    "format_ladder",
    "plot_ladder",
]

LADDER_FRACTIONS = (1.0, 4 / 5, 8 / 15, 2 / 5, 4 / 15, 2 / 15, 1 / 15)
"""Rungs as fractions of the preset's rank: the paper's 30, 24, 16, 12, 8, 4, 2 over 30."""
TARGET_COMPRESSION = 100.0
"""The issue's target is read at the first rung whose tensorized layers are compressed at least this much."""
TARGET_SPEEDUP = 8.0
"""The speed-up over dense the issue asks for at :data:`TARGET_COMPRESSION`."""


def default_ladder(rank: int) -> list[int]:
    """The rungs for a preset of rank ``rank``: :data:`LADDER_FRACTIONS` of it, rounded, at least 1, each
    once, largest first."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    return sorted({max(1, round(rank * fraction)) for fraction in LADDER_FRACTIONS}, reverse=True)


def preset_rank(config: TensorizeConfig) -> int:
    """The rank of a tensorization config (the largest bond of ``config.rank``; ``rank_pattern`` aside)."""
    return config.rank if isinstance(config.rank, int) else max(config.rank)


def _strongest(scores: torch.Tensor, rank: int) -> torch.Tensor:
    keep = torch.zeros(scores.numel(), dtype=torch.bool)
    keep[scores.topk(min(rank, scores.numel())).indices] = True
    return keep


def truncate_ranks_(model: nn.Module, rank: int) -> PruneResult:
    """Cap every bond of every gated layer of ``model`` at ``rank``, in place: the strongest ``rank`` gate
    entries of a bond stay (at least just above ``tau``), the others are zeroed, then :func:`comera.prune_`
    slices the cores. Returns what :func:`comera.prune_` changed."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    trains = [train for _, train in gated_trains(model)]
    keep = [[_strongest(scores, rank) for scores in entry_scores(train)] for train in trains]
    floor = max([1e-3, *(2 * train.tau for train in trains)])
    hold_entries(trains, keep, floor)
    return prune_(model)


def compression_fields(model: nn.Module) -> dict[str, Any]:
    """The model's compression for a ladder row: ``tensorized_ratio`` (the tensorized layers alone),
    ``model_ratio`` (the whole model) and ``max_rank`` (its largest active bond rank)."""
    report = compression_report(model)
    ranks = [rank for layer in report.layers for rank in layer.ranks]
    return {
        "tensorized_ratio": report.tensorized_ratio,
        "model_ratio": report.model_ratio,
        "max_rank": max(ranks, default=0),
    }


def _split(results: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The dense case (None if missing or failed) and the measured rungs, largest rank first."""
    dense = next((r for r in results if r["method"] == "dense" and "error" not in r), None)
    rungs = [r for r in results if r["method"] != "dense" and "error" not in r]
    return dense, sorted(rungs, key=lambda r: -r["rank"])


def _speedup_line(dense: dict[str, Any] | None, rungs: list[dict[str, Any]], field: str, label: str) -> str:
    """The speed-up over dense at the first rung whose ``field`` compression reaches the target."""
    reached = [rung for rung in rungs if rung[field] >= TARGET_COMPRESSION]
    head = f"- speed-up over dense at {TARGET_COMPRESSION:g}x compression of {label}:"
    if not reached:
        largest = max((rung[field] for rung in rungs), default=None)
        return f"{head} no rung reaches it (largest {fmt(largest)}x; target >= {TARGET_SPEEDUP:g}x)"
    first = reached[0]
    speedup = ratio(dense["ms"] if dense else None, first["ms"])
    return f"{head} {speedup} at rank {first['rank']} ({first[field]:.1f}x; target >= {TARGET_SPEEDUP:g}x)"


def ladder_targets(results: list[dict[str, Any]]) -> list[str]:
    """The issue's targets as report lines: whether the step time falls at every rung as compression
    rises, and the speed-up over dense at the first rung compressed :data:`TARGET_COMPRESSION` times (of
    the tensorized layers, then of the whole model)."""
    dense, rungs = _split(results)
    rises = [
        f"rank {a['rank']} -> {b['rank']}: {a['ms']:.1f} -> {b['ms']:.1f} ms"
        for a, b in zip(rungs, rungs[1:])
        if b["ms"] >= a["ms"]
    ]
    falls = "yes" if not rises else "no (" + "; ".join(rises) + ")"
    return [
        f"- time falls at every rung as compression rises: {falls}",
        _speedup_line(dense, rungs, "tensorized_ratio", "the tensorized layers"),
        _speedup_line(dense, rungs, "model_ratio", "the whole model"),
    ]


def _row(result: dict[str, Any], dense: dict[str, Any] | None) -> str:
    name = "dense" if result["method"] == "dense" else str(result["rank"])
    if "error" in result:
        return f"| {name} | - | - | - | - | - | - | failed: {' '.join(result['error'])} |"
    ratios = (
        ("1.00x", "1.00x")
        if result["method"] == "dense"
        else (
            f"{result['tensorized_ratio']:.2f}x",
            f"{result['model_ratio']:.2f}x",
        )
    )
    speedup = ratio(dense["ms"] if dense else None, result["ms"], 2)
    note = "the preset's ranks, nothing pruned" if result.get("pruned_layers") == 0 else ""
    return (
        f"| {name} | {ratios[0]} | {ratios[1]} | {result['ms']:.1f} | {speedup} | {result['train_mib']:.1f} "
        f"| {result['peak_mib']:.1f} | {note} |"
    )


def format_ladder(results: list[dict[str, Any]], command: str) -> str:
    """Markdown: per rung (and the dense model), compression of the tensorized layers and of the whole model,
    median step time, speed-up over dense, memory rise during a step and process peak; then the targets."""
    dense, _ = _split(results)
    first = results[0]
    lines = [
        "## Time per step against compression (physical pruning to a rank ladder)",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. Workload `{first['workload']}`, preset "
        f"`{first['preset']}`, batch {first['batch']}. The comera model is built at the preset's ranks, then "
        "every bond is cut to at most the rung's rank (the entries of highest score kept, the model sliced "
        "by `comera.prune_`); each rung and the dense model in a fresh process; median step time (forward, "
        "objective, backward, optimizer step) after warm-up; timed steps' allocation: "
        f"{allocation_of(results)}. Compression = dense over active parameters of "
        "the tensorized layers / of the whole model; speed-up = dense ms / rung ms; `train MiB` = peak "
        "resident rise during a step; `peak MiB` = the process's peak.",
        "",
        "| rank | tensorized compression | model compression | ms | speed-up vs dense | train MiB | peak MiB "
        "| note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    dense_rows = [r for r in results if r["method"] == "dense"]
    rungs = sorted((r for r in results if r["method"] != "dense"), key=lambda r: -r["rank"])
    lines += [_row(result, dense) for result in dense_rows + rungs]
    lines += ["", "Targets (reported, not asserted):", "", *ladder_targets(results)]
    return "\n".join(lines)


def plot_ladder(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """``ladder_time.png``: median step time against the tensorized layers' compression (log-log), each rung
    labelled with its rank, the dense model's time as a dashed line; none without matplotlib or rungs."""
    plt = pyplot()
    dense, rungs = _split(results)
    if plt is None or not rungs:
        return []
    figure, axes = plt.subplots(figsize=(7, 4))
    ratios, times = [r["tensorized_ratio"] for r in rungs], [r["ms"] for r in rungs]
    axes.plot(ratios, times, marker="o", label="comera, pruned")
    for rung in rungs:
        axes.annotate(f"r={rung['rank']}", (rung["tensorized_ratio"], rung["ms"]), fontsize="small")
    if dense is not None:
        axes.axhline(dense["ms"], linestyle="--", color="gray", label="dense")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("compression of the tensorized layers")
    axes.set_ylabel("ms per training step")
    axes.legend(fontsize="small")
    figure.tight_layout()
    path = out / "ladder_time.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return [path]
