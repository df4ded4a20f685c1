"""``comera demo``: the sentence-pair workload trained dense and with CoMERA, side by side.

Both runs go through ``comera compare nli --methods dense comera --rerun`` (:mod:`comera.recipes.compare`):
the same recipe (``comera train nli --preset small``) and the same Trainer, each in a fresh process so that
each peak memory is its own: the dense model, and the CoMERA model (tensorized by the
``nli-small`` preset, early stage, late stage toward a smaller size, pruned). The data is the embedded task
(a docstring paired with a function's code from this Python's standard library: does it match?). At the end
one table compares accuracy, parameters, compression, step time and peak memory, and names the plots.

Usage: ``comera demo [--out runs/demo] [--preset small] [--set section.key=value ...]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from comera.recipes.cli import load_recipes
from comera.recipes.compare import compare
from comera.recipes.run import SetupError

__all__ = ["main", "format_table"]

METHODS = ("dense", "comera")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_table(results: dict[str, dict]) -> str:
    """The side-by-side table of the demo's runs (``results``: method -> results.json)."""
    dense = results["dense"]
    rows = [("", *results)]
    split = next(iter(dense["evaluation"]))
    rows.append(("accuracy", *(f"{r['evaluation'][split]['accuracy']:.3f}" for r in results.values())))
    rows.append(("loss", *(f"{r['evaluation'][split]['loss']:.3f}" for r in results.values())))
    rows.append(("parameters", *(f"{r['params']:,}" for r in results.values())))
    rows.append(
        (
            "compression, tensorized layers",
            *(_ratio(r["compression"]["tensorized"]) for r in results.values()),
        )
    )
    rows.append(("compression, whole model", *(_ratio(r["compression"]["whole"]) for r in results.values())))
    rows.append(("step time (ms, median)", *(f"{1e3 * r['step_time_s']:.1f}" for r in results.values())))
    rows.append(
        (
            "speed-up over dense (>1: faster)",
            *(f"{dense['step_time_s'] / r['step_time_s']:.2f}x" for r in results.values()),
        )
    )
    rows.append(("peak memory (MiB)", *(f"{r['peak_memory_mib']:.0f}" for r in results.values())))
    rows.append(("wall time (s)", *(f"{r['wall_time_s']:.0f}" for r in results.values())))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _data_line(results: dict) -> str:
    info = results["data"]
    splits = info.get("splits", {})
    counts = ", ".join(f"{name} {values.get('read', '?')}" for name, values in splits.items())
    majority = info.get("majority_accuracy")
    text = f"data: {info.get('source', 'embedded task')} ({counts})"
    if majority is not None:
        text += f"; majority-class accuracy {majority:.3f}"
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera demo``."""
    parser = argparse.ArgumentParser(prog="comera demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/demo", help="folder of the two runs (default: runs/demo)")
    parser.add_argument("--preset", default="small", help="workload preset (default: small)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    out = Path(args.out)
    load_recipes()
    try:
        runs = compare("nli", METHODS, preset=args.preset, assignments=args.assignments, out=out, rerun=True)
    except SetupError as error:
        print(f"comera demo: {error}", file=sys.stderr)
        return 2
    failed = [item for item in runs if item.results is None]
    if failed:
        raise SystemExit(f"comera demo: the {failed[0].method} run failed: {failed[0].error}")
    results = {item.method: item.results for item in runs}
    print()
    print(f"comera demo: sentence pairs, preset {args.preset}; {_data_line(results['dense'])}")
    print(format_table(results))
    print()
    for method in METHODS:
        print(f"{method}: {out / method}/results.json, plots in {out / method}/plots/")
    print(f"both: {out}/comparison.md, {out}/compare-accuracy.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
