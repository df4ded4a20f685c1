"""Where the language model's training step spends its time, dense against comera, at several widths.

    python benchmarks/profile_llm_step.py [--widths 128 1024] [--threads 1] [--write docs/benchmarks.md]

Each case (method x width) runs in a fresh process through :func:`comera.bench.paper.run_fresh_case`, the
same step ``comera bench llm --sections steps`` times (the ``llm`` recipe at ``--preset``, the width set by
``model.hidden_size`` and the MLP width scaled with it as ``comera frontier`` does, one fixed batch of
``--batch`` blocks): ``--warmup`` steps, ``--repeats`` timed steps (their median is the step time), then
``--steps`` steps under ``torch.profiler``, whose operators' self times are summed per category
(:data:`comera.measure.OPERATOR_CATEGORIES`) and divided by the steps. The table gives, per width, each
category's milliseconds per step for dense and comera and the operator calls per step. A second table
gives the cost model's estimate (:meth:`comera.TTMLinear.order_costs`, this machine's constants) of one
square projection of ``--model-widths`` at each of ``--ranks`` for the step's rows (``batch x seq_len``):
each contraction order's time over the dense product's, which says from which width on a factorized order
is cheaper than rebuilding the weight and multiplying densely. ``--write`` replaces
the section ``llm-step-profile`` of a markdown file; ``--out`` holds every case's result as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from comera.bench.paper import run_fresh_case
from comera.cli.commands.frontier import dense_width_settings
from comera.measure import OPERATOR_CATEGORIES, machine_description, source_commit, update_section
from comera.nn.linear import TTMLinear
from comera.tt.shapes import factorize
from comera.workloads import load_recipe

METHODS = ("dense", "comera")
SECTION = "llm-step-profile"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 1024], help="model widths")
    parser.add_argument("--preset", default="small", help="the llm preset (depth, heads, tokens per block)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per step (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each case (default 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    parser.add_argument(
        "--model-widths",
        type=int,
        nargs="+",
        default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        help="widths of the cost model's table",
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 8], help="the cost table's ranks")
    parser.add_argument("--cache", type=Path, default=None, help="data cache (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("bench-profile"), help="folder for profile.json")
    parser.add_argument("--write", default=None, help="markdown file to update (section llm-step-profile)")
    args = parser.parse_args(argv)
    for name, least in (("batch", 1), ("threads", 1), ("repeats", 5), ("warmup", 1), ("steps", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be >= {least}, got {getattr(args, name)}")
    for name in ("widths", "model_widths", "ranks"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _case(args: argparse.Namespace, method: str, width: int, cache: Path) -> dict[str, Any]:
    model = load_recipe("llm").presets[args.preset]["model"]
    return run_fresh_case(
        "llm",
        args.preset,
        method,
        args.batch,
        repeats=args.repeats,
        warmup=args.warmup,
        cache_dir=cache,
        threads=args.threads,
        assignments=dense_width_settings(width, model),
        profile=args.steps,
    )


def _cell(result: dict[str, Any], category: str) -> float:
    return result["profile"]["categories"].get(category, {}).get("ms", 0.0)


def order_ratios(width: int, rank: int, rows: int) -> dict[str, float]:
    """The cost model's time of each contraction order of a square ``TTMLinear`` of ``width`` (three
    balanced modes, ``rank`` at every bond; built on the meta device) for ``rows`` rows, forward and
    backward, over its ``dense`` order's (rebuild the weight, one dense product)."""
    modes = factorize(width, 3)
    with torch.device("meta"):
        layer = TTMLinear(width, width, bias=False, in_shape=modes, out_shape=modes[::-1], rank=rank)
    costs = layer.order_costs(rows)
    return {order: cost / costs["dense"] for order, cost in costs.items()}


def format_orders(widths: list[int], ranks: list[int], rows: int) -> str:
    """The cost model's table: per width and rank, each order's estimated time over the dense order's."""
    lines = [
        f"Cost model, one square projection, {rows} rows forward and backward: each order's estimated time "
        "over the `dense` order's (rebuild the weight, one dense product); below 1, that order is cheaper.",
        "",
        "| width | rank | sequential | merge | cheapest |",
        "|---|---|---|---|---|",
    ]
    for width in widths:
        for rank in ranks:
            ratios = order_ratios(width, rank, rows)
            cheapest = min(ratios, key=ratios.get)
            lines.append(
                f"| {width} | {rank} | {ratios['sequential']:.2f} | {ratios['merge']:.2f} | {cheapest} |"
            )
    return "\n".join(lines) + "\n"


def format_table(results: dict[int, dict[str, dict[str, Any]]], command: str, commit: str) -> str:
    """The markdown section: one table per width, a row per category, dense and comera side by side;
    ``commit`` is the checkout the cases ran."""
    lines = [
        f"### Where the training step's time goes, dense against comera ({datetime.date.today()}, {commit})",
        "",
        f"Machine: {machine_description()}. Command: `{command}`.",
        "",
    ]
    for width, cases in results.items():
        failed = [method for method in METHODS if "error" in cases[method]]
        if failed:
            lines += [f"Width {width}: failed ({', '.join(failed)}): {cases[failed[0]]['error']}", ""]
            continue
        dense, comera = cases["dense"], cases["comera"]
        lines += [
            f"Width {width}: step {dense['ms']:.0f} ms dense, {comera['ms']:.0f} ms comera "
            f"({dense['ms'] / comera['ms']:.2f}x dense's speed); operator calls per step "
            f"{dense['profile']['operators']:.0f} dense, {comera['profile']['operators']:.0f} comera.",
            "",
            "| category | dense ms/step | comera ms/step | comera - dense |",
            "|---|---|---|---|",
        ]
        for category in [name for name, _ in OPERATOR_CATEGORIES] + ["other"]:
            left, right = _cell(dense, category), _cell(comera, category)
            lines.append(f"| {category} | {left:.1f} | {right:.1f} | {right - left:+.1f} |")
        total_left, total_right = dense["profile"]["ms"], comera["profile"]["ms"]
        change = total_right - total_left
        lines += [f"| all (profiled) | {total_left:.1f} | {total_right:.1f} | {change:+.1f} |", ""]
        top = ", ".join(f"`{entry['op']}` {entry['ms']:.0f} ms" for entry in comera["profile"]["top"][:5])
        lines += [f"comera's top operators: {top}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Profile every case, print the table (and write it with ``--write``); 1 when a case failed."""
    args = _parse(argv)
    command = "python benchmarks/profile_llm_step.py " + " ".join(argv if argv is not None else [])
    cache = args.cache or Path(tempfile.mkdtemp(prefix="comera-profile-"))
    commit = source_commit()  # the code the cases run, before the checkout can move on during the run
    results = {width: {m: _case(args, m, width, cache) for m in METHODS} for width in args.widths}
    rows = args.batch * load_recipe("llm").presets[args.preset]["data"]["seq_len"]
    orders = format_orders(args.model_widths, args.ranks, rows)
    table = format_table(results, command.strip(), commit) + "\n" + orders
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(results) + "\n")
    if args.write:
        update_section(args.write, SECTION, table)
    return 1 if any("error" in case for cases in results.values() for case in cases.values()) else 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
