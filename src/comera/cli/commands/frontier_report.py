"""The frontier's table and plots: validation perplexity against weights + optimizer memory and against
training time, every point drawn and each method's lower envelope joined
(:mod:`comera.cli.commands.frontier`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from comera.atomic import atomic_write_bytes

__all__ = ["lower_envelope", "frontier_table", "plot_frontier", "training_time_s"]

AXES = {
    "memory": ("weights_optimizer_mib", "weights + optimizer MiB"),
    "time": ("training_time_s", "training time (s, median step x steps)"),
}
"""The frontier's plots: ``{name: (value, axis label)}``."""


def training_time_s(results: dict[str, Any]) -> float:
    """Median step time x steps of a run's ``results.json`` (NaN when either is missing)."""
    step, steps = results.get("step_time_s"), results.get("steps")
    return float(step) * int(steps) if isinstance(step, (int, float)) and isinstance(steps, int) else math.nan


def lower_envelope(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points ``(x, y)`` that no other point beats on both (smaller or equal ``x`` with smaller ``y``),
    sorted by ``x``: each method's best perplexity for its cost. Non-finite points are left out."""
    finite = sorted((x, y) for x, y in points if math.isfinite(x) and math.isfinite(y))
    envelope: list[tuple[float, float]] = []
    for x, y in finite:
        if not envelope or y < envelope[-1][1]:
            envelope.append((x, y))
    return envelope


def _cell(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f} (n={len(values)})"


def frontier_table(points: Sequence[Any]) -> str:
    """A markdown table of :class:`comera.cli.commands.frontier.FrontierPoint` rows (seeds pooled: mean ±
    sample std); a point whose runs failed stays as a row that says so."""
    lines = [
        "| point | method | role | settings | perplexity | params | non-embedding params "
        "| weights+optimizer MiB | training time s | runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        failed = [run for run in point.runs if run.results is None]
        times = [training_time_s(run.results) for run in point.runs if run.results is not None]
        status = f"{len(point.runs) - len(failed)} finished" + (f", {len(failed)} failed" if failed else "")
        lines.append(
            f"| {point.name} | {point.method} | {point.role} | {' '.join(point.assignments)} "
            f"| {_cell(point.values('perplexity'), 2)} | {_cell(point.values('params'), 0)} "
            f"| {_cell(point.values('non_embedding_params'), 0)} "
            f"| {_cell(point.values('weights_optimizer_mib'), 2)} "
            f"| {_cell([t for t in times if math.isfinite(t)], 0)} | {status} |"
        )
    return "\n".join(lines)


def plot_frontier(points: Sequence[Any], axis: str, path: Path) -> Path:
    """Perplexity of every finished point against ``axis`` (a key of :data:`AXES`), one colour per method,
    the method's lower envelope joined; seeds pooled as their mean with the spread as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    key, label = AXES[axis]
    figure, ax = plt.subplots(figsize=(7, 4.5))
    for method in sorted({point.method for point in points}):
        drawn = []
        for point in (p for p in points if p.method == method):
            ys = point.values("perplexity")
            xs = point.values(key)
            if not ys or not xs:
                continue
            x, y = statistics.fmean(xs), statistics.fmean(ys)
            spread = statistics.stdev(ys) if len(ys) > 1 else 0.0
            marker = "s" if point.role != "sweep" else "o"
            ax.errorbar(x, y, yerr=spread, fmt=marker, color=f"C{0 if method == 'dense' else 1}", alpha=0.7)
            ax.annotate(point.name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            drawn.append((x, y))
        envelope = lower_envelope(drawn)
        if envelope:
            ax.plot(
                *zip(*envelope), color=f"C{0 if method == 'dense' else 1}", label=f"{method} (lower envelope)"
            )
    ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("validation perplexity")
    ax.legend()
    ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_frontier(out: Path, header: str, points: Sequence[Any], log: Callable[[str], None]) -> None:
    """``out/frontier.md`` (``header``, the table, the plots) and the two plots."""
    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_frontier(points, axis, out / f"frontier-{axis}.png") for axis in AXES]
    text = [header, "", frontier_table(points), ""]
    text += [f"![perplexity against {AXES[axis][1]}]({path.name})" for axis, path in zip(AXES, plots)]
    atomic_write_bytes(out / "frontier.md", ("\n".join(text) + "\n").encode())
    log(f"[frontier] wrote {out / 'frontier.md'}, {', '.join(str(path) for path in plots)}")
