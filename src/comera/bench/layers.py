"""Forward+backward time of ``nn.Linear`` against ``TTLinear`` (every order, auto, and the published layer)
and ``TTMLinear``, run as ``comera bench layers``, with the checks on the order the cost model picks and the
B=4096, r=30 targets. Details: docs/benchmarks.md, "Linear layers: forward+backward, fp32" and "How the
benchmarks measure"."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from comera.bench.layer_layouts import LAYOUTS, format_layouts, layout_checks, run_layouts
from comera.bench.published_linear import PublishedTTLinear
from comera.cpu import reuse_freed_memory
from comera.measure import (
    add_memory_argument,
    interleaved_medians_ms,
    machine_description,
    markdown_file_argument,
    update_section,
)
from comera.nn.linear import TTLinear, TTMLinear
from comera.tt.blocked import mkl_only, single_gemms
from comera.tt.costs import ORDERS
from comera.tt.paths import FACTORS
from comera.tt.recycle import configure_output_pool

SHAPES = ((768, 768), (768, 3072), (3072, 768))
BATCHES = (1, 128, 4096)
RANKS = (8, 16, 30)
ORDER_TOLERANCE = 0.10
TARGET_BATCH, TARGET_RANK = 4096, 30
TARGET_VS_LINEAR, TARGET_VS_PUBLISHED = 5.0, 1.2
SMALL_BATCH, SMALL_VS_PUBLISHED = 128, 1.0
"""At ``SMALL_BATCH`` rows (rank ``TARGET_RANK``) the auto layer is to be at least as fast as the published
one."""
MIN_SECONDS = 3.0
"""Rounds are added to a row until its runs have taken this long: a B=128 row (about 20 ms a round) gets
some 150 rounds, which its median needs on a noisy machine (with 15 the B=128 ratios swung by 10-20 %);
a B=4096 row reaches it within its first rounds."""
TT_ORDERS = (*ORDERS, FACTORS)


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    def run():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(upstream)

    return run


def _inside(context, run):
    """``run`` made to run inside ``context()`` (a GEMM switch of :mod:`comera.tt.blocked`)."""

    def run_inside():
        with context():
            run()

    return run_inside


def _merge_flops_and_bytes(batch: int, m: int, n: int, rank: int) -> tuple[float, float]:
    flops = 2 * 3 * batch * rank * (m + n)
    traffic = 4 * batch * (3 * m + 3 * n)
    return flops, traffic


def run_layer_benchmark(shapes, batches, ranks, repeats: int, min_seconds: float = 0.0) -> list[dict]:
    """Time every case; one row per (shape, batch, rank) with milliseconds per method, the methods of a row
    (``nn.Linear`` included) timed round-robin for at least ``repeats`` rounds and ``min_seconds``."""
    rows = []
    for m, n in shapes:
        dense = nn.Linear(m, n)
        for batch in batches:
            x = torch.randn(batch, m, requires_grad=True)
            upstream = torch.randn(batch, n)
            for rank in ranks:
                tt = TTLinear(m, n, rank=rank, order="auto")
                fixed = {order: TTLinear(m, n, rank=rank, order=order) for order in TT_ORDERS}
                for layer in fixed.values():
                    layer.load_state_dict(tt.state_dict())
                fns = {"nn.Linear": _fwd_bwd(dense, x, upstream), "tt:auto": _fwd_bwd(tt, x, upstream)}
                fns.update({f"tt:{order}": _fwd_bwd(layer, x, upstream) for order, layer in fixed.items()})
                fns["tt:merge-one-gemm"] = _inside(single_gemms, _fwd_bwd(fixed["merge"], x, upstream))
                fns["tt:merge-mkl"] = _inside(mkl_only, _fwd_bwd(fixed["merge"], x, upstream))
                fns["tt:published"] = _fwd_bwd(PublishedTTLinear(fixed["merge"]), x, upstream)
                fns["ttm:auto"] = _fwd_bwd(TTMLinear(m, n, rank=rank), x, upstream)
                row = {"shape": f"{m}->{n}", "batch": batch, "rank": rank}
                row.update(interleaved_medians_ms(fns, repeats, min_seconds=min_seconds))
                with torch.enable_grad():
                    row["auto picks"] = tt.chosen_order(x)
                middle = tt.max_ranks[len(tt.in_shape) - 1]
                flops, traffic = _merge_flops_and_bytes(batch, m, n, middle)
                row["merge GFLOP/s"] = flops / row["tt:merge"] / 1e6
                row["merge GB/s"] = traffic / row["tt:merge"] / 1e6
                row["dense GFLOP/s"] = 2 * 3 * batch * m * n / row["nn.Linear"] / 1e6
                rows.append(row)
                print(_format_row(row), flush=True)
    return rows


_COLUMNS = (
    "tt:merge",
    "tt:merge-one-gemm",
    "tt:merge-mkl",
    "tt:factors",
    "tt:sequential",
    "tt:dense",
    "tt:auto",
    "tt:published",
    "ttm:auto",
)


def _format_row(row: dict) -> str:
    ratios = " | ".join(f"{row['nn.Linear'] / row[c]:.2f}x" for c in _COLUMNS)
    fastest_tt = min(row[f"tt:{order}"] for order in TT_ORDERS)
    chosen = row[f"tt:{row['auto picks']}"] / fastest_tt
    return (
        f"| {row['shape']} | {row['batch']} | {row['rank']} | {row['nn.Linear']:.3f} | "
        f"{row['tt:auto']:.3f} | "
        f"{ratios} | {row['auto picks']} | {chosen:.2f} | {row['tt:auto'] / fastest_tt:.2f} | "
        f"{row['merge GFLOP/s']:.1f} | {row['merge GB/s']:.1f} | {row['dense GFLOP/s']:.1f} |"
    )


def format_table(rows: list[dict]) -> str:
    """Markdown table: times in ms and speedups over ``nn.Linear`` (fwd+bwd, higher is faster)."""
    header = (
        "| shape | B | r | nn.Linear ms | TT auto ms | TT merge | TT merge, one GEMM | TT merge, no oneDNN "
        "| TT factors "
        "| TT sequential "
        "| TT dense | TT auto | TT published | TTM auto | auto picks | picked / fastest order "
        "| auto / fastest TT | merge GFLOP/s | merge GB/s | nn.Linear GFLOP/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *(_format_row(row) for row in rows)])


def order_violations(rows: list[dict], tolerance: float = ORDER_TOLERANCE) -> list[dict]:
    """Rows whose automatically picked order took more than ``1 + tolerance`` times the fastest order."""
    return [row for row in rows if row[f"tt:{row['auto picks']}"] > (1.0 + tolerance) * _fastest(row)[1]]


def _fastest(row: dict) -> tuple[str, float]:
    return min(((order, row[f"tt:{order}"]) for order in TT_ORDERS), key=lambda item: item[1])


def checks_report(rows: list[dict]) -> str:
    """The order-choice check over every row and the B=4096 and B=128 (r=30) targets, as markdown lines."""
    violators = order_violations(rows)
    lines = [
        f"Order choice: the picked order is within {ORDER_TOLERANCE:.0%} of the fastest order measured in "
        f"this run in {len(rows) - len(violators)} of {len(rows)} cases."
    ]
    for row in violators:
        fastest, fastest_ms = _fastest(row)
        picked = row["auto picks"]
        lines.append(
            f"- {row['shape']}, B={row['batch']}, r={row['rank']}: picked {picked} "
            f"({row[f'tt:{picked}']:.3f} ms), fastest {fastest} ({fastest_ms:.3f} ms), "
            f"{row[f'tt:{picked}'] / fastest_ms:.2f}x"
        )
    targets = [row for row in rows if row["batch"] == TARGET_BATCH and row["rank"] == TARGET_RANK]
    if targets:
        lines += ["", f"Targets at B={TARGET_BATCH}, r={TARGET_RANK} (TT auto):"]
    for row in targets:
        vs_linear = row["nn.Linear"] / row["tt:auto"]
        vs_published = row["tt:published"] / row["tt:auto"]
        lines.append(
            f"- {row['shape']}: {vs_linear:.2f}x faster than nn.Linear (target {TARGET_VS_LINEAR:g}x, "
            f"{'met' if vs_linear >= TARGET_VS_LINEAR else 'missed'}); {vs_published:.2f}x faster than the "
            f"published TT layer (target {TARGET_VS_PUBLISHED:g}x, "
            f"{'met' if vs_published >= TARGET_VS_PUBLISHED else 'missed'})"
        )
    small = [row for row in rows if row["batch"] == SMALL_BATCH and row["rank"] == TARGET_RANK]
    if small:
        lines += ["", f"Target at B={SMALL_BATCH}, r={TARGET_RANK} (TT auto against the published TT layer):"]
    for row in small:
        vs_published = row["tt:published"] / row["tt:auto"]
        lines.append(
            f"- {row['shape']}: {vs_published:.2f}x (target {SMALL_VS_PUBLISHED:g}x, "
            f"{'met' if vs_published >= SMALL_VS_PUBLISHED else 'missed'})"
        )
    return "\n".join(lines)


_ALLOCATION_SETTINGS = {
    "default": ({}, ["--memory", "default"]),
    "default, output pool off": ({}, ["--memory", "default", "--no-output-pool"]),
    "THP_MEM_ALLOC_ENABLE=1": ({"THP_MEM_ALLOC_ENABLE": "1"}, ["--memory", "default"]),
    "reuse_freed_memory()": ({}, ["--memory", "reuse"]),
}


def _allocator_rows(repeats: int, env_update: dict, flags: list[str]) -> list[dict]:
    """The B=4096, r=30 rows measured in a fresh process with one allocation setting."""
    env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
    env.update(env_update)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, "-m", "comera.bench.layers", "--large-only", "--repeats", str(repeats)]
        subprocess.run([*command, *flags, "--json", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def allocator_table(repeats: int) -> str:
    """B=4096, r=30 rows under PyTorch's default CPU allocation, transparent huge pages, and heap reuse."""
    lines = [
        "| shape | allocation | nn.Linear ms | TT auto ms | nn.Linear / TT auto |",
        "|---|---|---|---|---|",
    ]
    for name, (env_update, flags) in _ALLOCATION_SETTINGS.items():
        for row in _allocator_rows(repeats, env_update, flags):
            ratio = row["nn.Linear"] / row["tt:auto"]
            lines.append(
                f"| {row['shape']} | {name} | {row['nn.Linear']:.1f} | {row['tt:auto']:.1f} | {ratio:.2f}x |"
            )
    return "\n".join(lines)


def _parse_shape(text: str, parser: argparse.ArgumentParser) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        parser.error(f"--shapes takes IN x OUT pairs of positive ints such as 768x3072, got {text!r}")
    return int(parts[0]), int(parts[1])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``comera bench layers [--quick] [--repeats N] [--write docs/benchmarks.md]``."""
    parser = argparse.ArgumentParser(prog="comera bench layers", description=__doc__)
    parser.add_argument("--repeats", type=int, default=9, help="fewest timed runs per case (median reported)")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=MIN_SECONDS,
        help=f"add runs until a row's runs took this long (default {MIN_SECONDS}; at most 1000 runs)",
    )
    parser.add_argument("--quick", action="store_true", help="one shape, B=128, r=16: a smoke run")
    parser.add_argument("--large-only", action="store_true", help="only the B=4096, r=30 rows")
    parser.add_argument(
        "--shapes", nargs="+", default=None, metavar="INxOUT", help="shapes to run instead, e.g. 64x128"
    )
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="batch sizes to run instead")
    parser.add_argument("--ranks", nargs="+", type=int, default=None, help="ranks to run instead")
    parser.add_argument("--allocator", action="store_true", help="also compare CPU allocation settings")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument(
        "--layouts",
        nargs="*",
        default=None,
        choices=list(LAYOUTS),
        help="time each layer per input/gradient layout instead (no value: all of them)",
    )
    parser.add_argument("--no-tied-head", action="store_true", help="with --layouts: leave out the tied head")
    add_memory_argument(parser)
    parser.add_argument(
        "--no-output-pool",
        action="store_true",
        help="turn off the TT paths' output pool (comera.tt.configure_output_pool(max_bytes=0))",
    )
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        metavar="MARKDOWN",
        help="update the --section section of this file",
    )
    parser.add_argument(
        "--section", default="layers", help="name of the section --write replaces (default: layers)"
    )
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.min_seconds >= 0:
        parser.error(f"--min-seconds must be >= 0, got {args.min_seconds}")
    if args.memory == "reuse":
        reuse_freed_memory()
    if args.no_output_pool:
        configure_output_pool(max_bytes=0)
    torch.manual_seed(0)
    shapes, batches, ranks = SHAPES, BATCHES, RANKS
    if args.quick:
        shapes, batches, ranks = SHAPES[:1], (128,), (16,)
    elif args.large_only:
        batches, ranks = (TARGET_BATCH,), (TARGET_RANK,)
    if args.shapes:
        shapes = tuple(_parse_shape(text, parser) for text in args.shapes)
    batches = tuple(args.batches) if args.batches else batches
    ranks = tuple(args.ranks) if args.ranks else ranks
    print(machine_description())
    if args.layouts is not None:
        return _layouts_main(args, given, shapes, batches, ranks)
    rows = run_layer_benchmark(shapes, batches, ranks, args.repeats, args.min_seconds)
    table = format_table(rows)
    print(table)
    checks = checks_report(rows)
    print(checks)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    allocation = allocator_table(args.repeats) if args.allocator else ""
    if allocation:
        print(allocation)
    if args.write:
        body = (
            "## Linear layers: forward+backward, fp32\n\n"
            f"Machine: {machine_description()}. Command: `comera bench layers {shlex.join(given)}` "
            "(allocation: "
            f"{'comera.cpu.reuse_freed_memory()' if args.memory == 'reuse' else 'glibc default'}"
            f"{'; output pool off' if args.no_output_pool else ''}).\n"
            "Columns after the times are speedups over `nn.Linear` (higher is faster), medians of at least "
            f"{args.repeats} runs after 2 warm-up runs (more, up to 1000, until a row's runs took "
            f"{args.min_seconds:g} s), all measured in one process; within a row the "
            "methods are timed round-robin so load changes hit all of them alike. Shapes are the defaults "
            "`TTLinear` picks (in modes ascending, out modes descending); `rank` is the max rank per bond. "
            "`picked / fastest order` divides the fixed-order time of the order auto picks by the fastest "
            "fixed-order time (the quality of the choice); `auto / fastest TT` times the auto layer itself, "
            "so it also carries run-to-run noise between identical computations. "
            "`TT merge, one GEMM` runs every batch-sized GEMM as one `torch.mm`, `TT merge, no oneDNN` "
            "leaves oneDNN's kernel out of the measured GEMM choices (`comera/tt/onednn.py`). "
            "GFLOP/s and GB/s count the 6 batch-sized GEMMs of the merge path and the minimal traffic "
            f"(read X twice, dY twice, write Y and dX). `TT published` is the paper code's layer rebuilt "
            "from its description (`comera/bench/published_linear.py`).\n\n"
            f"{table}\n\n{checks}\n"
        )
        if allocation:
            body += (
                "\n### CPU allocation settings\n\n"
                "The B=4096, r=30 rows again, each setting in a fresh process: glibc's default (with the TT "
                "paths' output pool, `comera.tt.recycle`, and without it), PyTorch's transparent huge pages "
                "(`THP_MEM_ALLOC_ENABLE=1`), and `comera.cpu.reuse_freed_memory()` (freed blocks stay in the "
                "heap). Both layers share the setting.\n\n" + allocation + "\n"
            )
        update_section(args.write, args.section, body)
    return 0


def _layouts_main(args: argparse.Namespace, given: list[str], shapes, batches, ranks) -> int:
    """``--layouts``: the layout table, its check, and (``--write``) the section holding them."""
    layouts = tuple(args.layouts) or LAYOUTS
    if "contiguous" not in layouts:
        layouts = ("contiguous", *layouts)
    rows = run_layouts(shapes, batches, ranks, args.repeats, layouts, tied_head=not args.no_tied_head)
    table, checks = format_layouts(rows, layouts), layout_checks(rows, layouts)
    print(table)
    print(checks)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    if args.write:
        body = (
            "## Linear layers and the tied head: input and gradient layouts, forward+backward, fp32\n\n"
            f"Machine: {machine_description()}. Command: `comera bench layers {shlex.join(given)}` "
            f"(allocation: {'comera.cpu.reuse_freed_memory()' if args.memory == 'reuse' else 'glibc default'}"
            f"{'; output pool off' if args.no_output_pool else ''}).\n"
            f"Medians of {args.repeats} runs after 2 warm-up runs; each layer's layouts timed round-robin in "
            "one process; in parentheses the ratio to the contiguous layout. A batch of B rows is B/128 "
            "sequences of 128 steps; `transposed` is a sequence-first `(T, B/T, features)` tensor seen "
            "through `.transpose(0, 1)`, `input broadcast` one sequence expanded over the batch, "
            "`gradient broadcast` the expanded gradient of `out.sum().backward()`, `sequence-first` input "
            "and gradient both transposed (`comera/bench/layer_layouts.py`).\n\n"
            f"{table}\n\n{checks}\n"
        )
        update_section(args.write, args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
