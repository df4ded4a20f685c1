"""Embedding lookup benchmark: forward+backward time and peak memory of ``nn.Embedding`` and the TTM lookups.
Run as ``comera bench embedding``: the paper's word table and a DLRM-size table, uniform or Zipf ids, every
lookup and the published order, each case in a fresh process, ``--layouts`` for the upstream-gradient layouts.
Details: docs/benchmarks.md, "Embedding lookup (forward + backward)" and "How the benchmarks measure"."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from comera.bench.published_lookup import PublishedOrderLookup
from comera.cpu import reuse_freed_memory
from comera.measure import (
    ALLOCATION,
    add_memory_argument,
    backward_step,
    fmt,
    interleaved_medians_ms,
    machine_description,
    markdown_file_argument,
    median_ms,
    peak_rise_mib,
    ratio,
    update_section,
)
from comera.nn.embedding import TTMEmbedding

__all__ = [
    "TABLES",
    "METHODS",
    "PUBLISHED_METHODS",
    "LAYOUTS",
    "applies",
    "layout_batch",
    "build_table",
    "make_indices",
    "run_case",
    "run_cases",
    "format_report",
    "main",
]

TABLES = {
    "paper": {
        "rows": 30522,
        "dim": 768,
        "rank": 32,
        "row_shape": (16, 20, 10, 10),
        "col_shape": (4, 4, 8, 6),
    },
    "dlrm": {"rows": 10_000_000, "dim": 16, "rank": 16, "row_shape": None, "col_shape": None},
}
METHODS = ("nn.Embedding", "naive", "split", "optimized", "auto", "published", "published+unique")
PUBLISHED_METHODS = ("published", "published+unique")
DISTRIBUTIONS = ("uniform", "zipf")
SIZES = (10_000, 20_000, 40_000)
ZIPF_EXPONENT = 1.05
# The paper authors' own order-4 lookup (their code) and nn.Embedding, fwd+bwd on the paper's table with
# uniform ids, measured on the development machine in one run (2026-11-22); milliseconds by batch size. Shown
# for scale beside the same-run timing of the rebuilt published order (PublishedOrderLookup).
AUTHORS_MS = {10_000: 262.0, 20_000: 564.0, 40_000: 1163.0}
AUTHORS_UNIQUE_MS = {10_000: 128.0, 20_000: 276.0, 40_000: 476.0}
TARGET_VS_PUBLISHED = 1.5
LAYOUTS = ("contiguous", "broadcast", "column-major", "sequence-first")
TARGET_VS_CONTIGUOUS = 1.2
SEQUENCE_LENGTH = 100
"""Steps ``T`` of a ``sequence-first`` batch (when it divides the batch; else one step per id)."""


def make_indices(rows: int, count: int, distribution: str, seed: int = 0) -> torch.Tensor:
    """``count`` ids in ``[0, rows)``: uniform, or Zipf(1.05) ranks mapped through a fixed shuffle of ids."""
    generator = torch.Generator().manual_seed(seed)
    if distribution == "uniform":
        return torch.randint(0, rows, (count,), generator=generator)
    if distribution != "zipf":
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-ZIPF_EXPONENT)
    cdf = weights.cumsum_(0)
    cdf /= cdf[-1].clone()
    ranks = torch.searchsorted(cdf, torch.rand(count, generator=generator, dtype=torch.float64))
    shuffle = torch.randperm(rows, generator=generator)
    return shuffle[ranks.clamp_(max=rows - 1)]


def layout_batch(indices: torch.Tensor, dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ids and upstream gradient of one :data:`LAYOUTS` entry for ``indices`` (``(N,)``) and rows of ``dim``:
    ``contiguous`` ``(N, dim)``; ``broadcast`` None (the step calls ``out.sum().backward()``);
    ``column-major`` a transposed ``(dim, N)``; ``sequence-first`` ids ``(T, N / T)`` and gradient ``(T, N /
    T, dim)`` seen batch-first (``T =`` :data:`SEQUENCE_LENGTH`)."""
    count = indices.shape[0]
    generator = torch.Generator().manual_seed(1)
    if layout == "contiguous":
        return indices, torch.randn(count, dim, generator=generator)
    if layout == "broadcast":
        return indices, None
    if layout == "column-major":
        return indices, torch.randn(dim, count, generator=generator).t()
    if layout != "sequence-first":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    steps = SEQUENCE_LENGTH if count % SEQUENCE_LENGTH == 0 else count
    grad = torch.randn(steps, count // steps, dim, generator=generator).transpose(0, 1)
    return indices.reshape(steps, count // steps).t(), grad


def applies(table: str, method: str) -> bool:
    """Whether ``method`` runs on ``table``: the published order needs an order-4 table."""
    row_shape = TABLES[table]["row_shape"]
    return method not in PUBLISHED_METHODS or (row_shape is not None and len(row_shape) == 4)


def build_table(table: str, lookup: str = "auto") -> TTMEmbedding:
    """The ``TTMEmbedding`` of :data:`TABLES` entry ``table``."""
    spec = TABLES[table]
    return TTMEmbedding(
        spec["rows"],
        spec["dim"],
        row_shape=spec["row_shape"],
        col_shape=spec["col_shape"],
        rank=spec["rank"],
        lookup=lookup,
    )


def _build(table: str, method: str) -> nn.Module:
    spec = TABLES[table]
    if method == "nn.Embedding":
        return nn.Embedding(spec["rows"], spec["dim"])
    embedding = build_table(table, "auto" if method in PUBLISHED_METHODS else method)
    if method in PUBLISHED_METHODS:
        return PublishedOrderLookup(embedding, unique=method == "published+unique")
    return embedding


def _timed_layouts(method: str, layouts: Sequence[str]) -> tuple[str, ...]:
    """The layouts a case times: none for the published lookup (1-D ids only; its contiguous time is the
    reference of the targets)."""
    return () if method in PUBLISHED_METHODS else tuple(layouts)


def run_case(
    table: str,
    method: str,
    distribution: str,
    count: int,
    repeats: int,
    memory: str = "reuse",
    layouts: Sequence[str] = (),
) -> dict:
    """Peak memory of the first step (glibc's allocation setting) and median time of ``repeats`` more steps
    (after :func:`comera.cpu.reuse_freed_memory` with ``memory="reuse"`` and one more warm-up step), in this
    process; with ``layouts`` the timed steps run per layout, round-robin, into ``layout_ms``."""
    module = _build(table, method)
    indices = make_indices(TABLES[table]["rows"], count, distribution)
    upstream = torch.randn(count, TABLES[table]["dim"])

    def step(ids: torch.Tensor = indices, grad: torch.Tensor = upstream) -> None:
        module.zero_grad(set_to_none=True)
        module(ids).backward(grad)

    step(indices[:64], upstream[:64])  # loads code and starts threads outside the measured step
    module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    peak = peak_rise_mib(step)
    first = time.perf_counter() - start
    repeats = max(3, min(repeats, int(30.0 / max(first, 1e-3))))
    warmup = 0
    if memory == "reuse":
        reuse_freed_memory()
        warmup = 1
    layout_ms = {}
    layouts = _timed_layouts(method, layouts)
    if layouts:
        dim = TABLES[table]["dim"]
        steps = {layout: backward_step(module, *layout_batch(indices, dim, layout)) for layout in layouts}
        layout_ms = interleaved_medians_ms(steps, repeats=repeats, warmup=max(warmup, 1))
    return {
        "table": table,
        "method": method,
        "distribution": distribution,
        "count": count,
        "layout_ms": layout_ms,
        "ms": layout_ms["contiguous"] if "contiguous" in layout_ms else median_ms(step, repeats, warmup),
        "peak_mb": peak,
        "distinct": int(torch.unique(indices).numel()),
        "parameters": sum(param.numel() for param in module.parameters() if param.dim() > 1),
    }


def _run_in_fresh_process(
    case: str, repeats: int, threads: int | None, memory: str, layouts: Sequence[str] = (), attempts: int = 3
) -> dict:
    """Run one case in a new interpreter; retried after a pause if it fails (e.g. a half-saved checkout)."""
    command = [sys.executable, "-m", "comera.bench.embedding", "--case", case, "--repeats", str(repeats)]
    command += ["--memory", memory]
    if layouts:
        command += ["--layouts", *layouts]
    if threads is not None:
        command += ["--threads", str(threads)]
    for attempt in range(attempts):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        if attempt + 1 < attempts:
            time.sleep(20)
    raise RuntimeError(f"case {case} failed {attempts} times:\n{done.stderr[-2000:]}")


def run_cases(
    tables: Sequence[str],
    distributions: Sequence[str],
    sizes: Sequence[int],
    methods: Sequence[str],
    *,
    repeats: int,
    threads: int | None = None,
    memory: str = "reuse",
    results_path: str | None = None,
    layouts: Sequence[str] = (),
) -> list[dict]:
    """Every case (table x distribution x size x method where it :func:`applies`), each in a fresh process,
    with a progress line per case; cases found in the JSON-lines file ``results_path`` are reused, new ones
    appended to it."""
    done = _load_results(results_path)
    results = []
    for table in tables:
        for distribution in distributions:
            for count in sizes:
                for method in [m for m in methods if applies(table, m)]:
                    case = f"{table}:{method}:{distribution}:{count}"
                    result = done.get(case)
                    if result is None or set(result.get("layout_ms", {})) != set(
                        _timed_layouts(method, layouts)
                    ):
                        result = _run_in_fresh_process(case, repeats, threads, memory, layouts)
                        if results_path:
                            with open(results_path, "a") as handle:
                                handle.write(json.dumps(result) + "\n")
                    results.append(result)
                    by_layout = " ".join(f"{k}={v:.1f}" for k, v in result.get("layout_ms", {}).items())
                    print(
                        f"{table:6s} {distribution:8s} {count:6d} {method:13s} {result['ms']:10.1f} ms "
                        f"{result['peak_mb']:9.1f} MiB {by_layout}",
                        flush=True,
                    )
    return results


def _load_results(path: str | None) -> dict[str, dict]:
    if path is None or not Path(path).exists():
        return {}
    entries = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {_case_name(entry): entry for entry in entries}


def _case_name(entry: dict) -> str:
    return f"{entry['table']}:{entry['method']}:{entry['distribution']}:{entry['count']}"


def _quotient(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _least(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def format_report(results: list[dict], command: str, memory: str = "reuse") -> str:
    """Markdown section: times, peak memory, ratios, the authors' lookup, parameter counts."""
    by_key = {(r["table"], r["distribution"], r["count"], r["method"]): r for r in results}
    cases = sorted(
        {(r["table"], r["distribution"], r["count"]) for r in results}, key=lambda c: (c[0], c[1], c[2])
    )
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]

    def value(case, method, field):
        entry = by_key.get((*case, method))
        return None if entry is None else entry[field]

    lines = [
        "## Embedding lookup (forward + backward)"
        + ("" if memory == "reuse" else ", glibc's default allocation"),
        "",
        f"Machine: {machine_description()}.",
        f"Command: `{command}` ({torch.get_num_threads()} torch thread(s) per case). Each case ran in a",
        f"fresh process (timed steps' allocation: {ALLOCATION[memory]}, the same for every method); after a",
        "64-id step that loads code, one full step measures memory with glibc's default setting: peak =",
        "rise of the process's peak RSS over its RSS just before that step (kernel",
        "high-water mark reset through `/proc/self/clear_refs`), so it counts everything the step allocated:",
        "output, upstream-gradient use, autograd state, parameter gradients (the dense table's gradient for",
        "`nn.Embedding`). Then the allocation setting is applied, one more warm-up step runs, and time =",
        "median of the repeats that follow. `split` is the optimized lookup without deduplication, `auto`",
        "the default lookup.",
        "Tables: `paper` = 30522 x 768 (rows 16*20*10*10, columns 4*4*8*6, rank 32); `dlrm` = 10M x 16",
        "(default shapes, rank 16). Zipf ids follow a Zipf(1.05) law over a shuffled vocabulary.",
        "",
        "Time (ms):",
        "",
        "| table | ids | batch | distinct | " + " | ".join(methods) + " |",
        "|---|---|---|---|" + "---|" * len(methods),
    ]
    for case in cases:
        distinct = next(by_key[(*case, m)]["distinct"] for m in methods if (*case, m) in by_key)
        cells = " | ".join(fmt(value(case, m, "ms")) for m in methods)
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {distinct} | {cells} |")
    lines += ["", "Peak memory (MiB):", "", "| table | ids | batch | " + " | ".join(methods) + " |"]
    lines.append("|---|---|---|" + "---|" * len(methods))
    for case in cases:
        cells = " | ".join(fmt(value(case, m, "peak_mb")) for m in methods)
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {cells} |")
    lines += [
        "",
        "Ratios (higher is better for the second-named method):",
        "",
        "| table | ids | batch | time naive/optimized | memory naive/optimized | time naive/split | "
        "memory naive/split | time naive/auto | time nn.Embedding/auto | memory nn.Embedding/auto |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        cells = [
            ratio(value(case, "naive", "ms"), value(case, "optimized", "ms")),
            ratio(value(case, "naive", "peak_mb"), value(case, "optimized", "peak_mb")),
            ratio(value(case, "naive", "ms"), value(case, "split", "ms")),
            ratio(value(case, "naive", "peak_mb"), value(case, "split", "peak_mb")),
            ratio(value(case, "naive", "ms"), value(case, "auto", "ms")),
            ratio(value(case, "nn.Embedding", "ms"), value(case, "auto", "ms")),
            ratio(value(case, "nn.Embedding", "peak_mb"), value(case, "auto", "peak_mb")),
        ]
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Against the published order-4 lookup (paper table, uniform ids, same run): `published` is the",
        "paper code's pair-merge order rebuilt from its description (`comera/bench/published_lookup.py`),",
        "`published+unique` adds its row-level unique step. For scale, a timing of the authors' own code on",
        "the development machine: `authors ms` (and with their unique option).",
        "",
        "| batch | published ms | published+unique ms | auto ms | auto vs published | "
        "auto vs published+unique | authors ms | authors+unique ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for count in sorted({case[2] for case in cases if case[:2] == ("paper", "uniform")}):
        case = ("paper", "uniform", count)
        ours = value(case, "auto", "ms")
        published, published_unique = value(case, "published", "ms"), value(case, "published+unique", "ms")
        cells = [
            fmt(published),
            fmt(published_unique),
            fmt(ours),
            ratio(published, ours),
            ratio(published_unique, ours),
            fmt(AUTHORS_MS.get(count), 0),
            fmt(AUTHORS_UNIQUE_MS.get(count), 0),
        ]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""]
    for table in sorted({case[0] for case in cases}):
        table_cases = [case for case in cases if case[0] == table]
        speed = [_quotient(value(c, "naive", "ms"), value(c, "optimized", "ms")) for c in table_cases]
        memory = [
            _quotient(value(c, "naive", "peak_mb"), value(c, "optimized", "peak_mb")) for c in table_cases
        ]
        if _least(speed) is None or _least(memory) is None:
            continue
        lines.append(
            f"- {table}: optimized vs naive, smallest time ratio {fmt(_least(speed))}x (target 5x), "
            f"smallest memory ratio {fmt(_least(memory))}x (target 3x)."
        )
    published = [
        (_quotient(value(case, "published", "ms"), value(case, "auto", "ms")), case[2])
        for case in cases
        if case[:2] == ("paper", "uniform")
    ]
    listed = ", ".join(f"{ratio:.1f}x at {n}" for ratio, n in published if ratio is not None)
    if listed:
        lines.append(f"- default lookup vs the published order-4 lookup (same run): {listed}.")
    with_unique = [
        (_quotient(value(case, "published+unique", "ms"), value(case, "auto", "ms")), case[2])
        for case in cases
        if case[:2] == ("paper", "uniform")
    ]
    listed = ", ".join(f"{ratio:.1f}x at {n}" for ratio, n in with_unique if ratio is not None)
    if listed:
        met = all(ratio >= TARGET_VS_PUBLISHED for ratio, _ in with_unique if ratio is not None)
        lines.append(
            f"- default lookup vs the published order-4 lookup with its unique step (same run): {listed} "
            f"(target {TARGET_VS_PUBLISHED:g}x at every batch: {'met' if met else 'missed'})."
        )
    lines.extend(_monotonic_lines(cases, value))
    lines.extend(_layout_lines(results, cases, value))
    lines += ["", "Parameters:", "", "| table | dense | TTM | compression |", "|---|---|---|---|"]
    for table in sorted({r["table"] for r in results}):
        dense = next(
            (r["parameters"] for r in results if r["table"] == table and r["method"] == "nn.Embedding"), None
        )
        ttm = next(
            (r["parameters"] for r in results if r["table"] == table and r["method"] != "nn.Embedding"),
            None,
        )
        spec = TABLES[table]
        dense = dense or spec["rows"] * spec["dim"]
        lines.append(f"| {table} | {dense} | {ttm} | {ratio(dense, ttm)} |")
    return "\n".join(lines)


def _monotonic_lines(cases: list[tuple], value) -> list[str]:
    """One line per (table, ids): whether the default lookup's time never falls as the batch grows."""
    lines = []
    for table, distribution in sorted({case[:2] for case in cases}):
        times = [(case[2], value(case, "auto", "ms")) for case in cases if case[:2] == (table, distribution)]
        times = [(count, ms) for count, ms in sorted(times) if ms is not None]
        if len(times) < 2:
            continue
        drops = [
            f"{smaller} -> {larger} ids: {before:.1f} -> {after:.1f} ms"
            for (smaller, before), (larger, after) in zip(times, times[1:])
            if after < before
        ]
        verdict = "never falls as the batch grows" if not drops else "falls: " + "; ".join(drops)
        lines.append(f"- {table}, {distribution} ids: the default lookup's time {verdict}.")
    return lines


def _layout_lines(results: list[dict], cases: list[tuple], value) -> list[str]:
    """The gradient-layout table (cases timed with ``--layouts``) and its targets, as markdown lines."""
    timed = [r for r in results if r.get("layout_ms")]
    if not timed:
        return []
    layouts = [layout for layout in LAYOUTS if any(layout in r["layout_ms"] for r in timed)]
    header = " | ".join(f"{layout} ms" for layout in layouts)
    lines = [
        "",
        "Upstream-gradient layouts (each case's layouts timed round-robin in its process; ratio to the",
        "contiguous time of the same method in parentheses; `broadcast` is `out.sum().backward()`'s expanded",
        "gradient, `column-major` a transposed `(dim, N)` tensor, `sequence-first` ids `(T, B).t()` and a",
        f"gradient `(T, B, dim).transpose(0, 1)` with T = {SEQUENCE_LENGTH}):",
        "",
        f"| table | ids | batch | method | {header} | published+unique / slowest layout |",
        "|---|---|---|---|" + "---|" * (len(layouts) + 1),
    ]
    verdicts = []
    for entry in timed:
        case = (entry["table"], entry["distribution"], entry["count"])
        times = entry["layout_ms"]
        contiguous = times.get("contiguous")
        cells = [
            fmt(times.get(layout))
            + (f" ({times[layout] / contiguous:.2f})" if layout in times and contiguous else "")
            for layout in layouts
        ]
        published = value(case, "published+unique", "ms")
        slowest = max(times.values())
        lines.append(
            f"| {case[0]} | {case[1]} | {case[2]} | {entry['method']} | "
            + " | ".join(cells)
            + f" | {ratio(published, slowest)} |"
        )
        if entry["method"] == "auto" and contiguous:
            within = slowest / contiguous <= TARGET_VS_CONTIGUOUS
            faster = published is not None and published / slowest >= TARGET_VS_PUBLISHED
            verdicts.append((case, within, faster if published is not None else None))
    lines.append("")
    for case, within, faster in verdicts:
        against = (
            ""
            if faster is None
            else (
                f"; >= {TARGET_VS_PUBLISHED:g}x faster than published+unique: {'met' if faster else 'missed'}"
            )
        )
        lines.append(
            f"- {case[0]}, {case[1]} ids, {case[2]}: every layout of the default lookup within "
            f"{TARGET_VS_CONTIGUOUS:g}x of contiguous: {'met' if within else 'missed'}{against}."
        )
    return lines


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench embedding", description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=list(DISTRIBUTIONS)
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed steps per case (fewer, >= 3, for slow cases)"
    )
    parser.add_argument("--quick", action="store_true", help="10k ids only, 2 repeats")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per case (default: torch's)")
    add_memory_argument(parser)
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="markdown file whose section (--section) is replaced",
    )
    parser.add_argument("--section", default="embedding", help="name of the section --write replaces")
    parser.add_argument(
        "--results",
        default=None,
        help="JSON-lines file: each case is appended as it finishes and reused on rerun",
    )
    parser.add_argument(
        "--layouts",
        nargs="*",
        default=None,
        choices=list(LAYOUTS),
        help="time each case with these upstream-gradient layouts (no value: all of them)",
    )
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (every case in a fresh process), print the tables, optionally write them."""
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    layouts = () if args.layouts is None else tuple(args.layouts or LAYOUTS)
    if args.case is not None:
        table, method, distribution, count = args.case.split(":")
        result = run_case(table, method, distribution, int(count), args.repeats, args.memory, layouts)
        print(json.dumps(result))
        return 0
    results = run_cases(
        args.tables,
        args.distributions,
        SIZES[:1] if args.quick else args.sizes,
        args.methods,
        repeats=2 if args.quick else args.repeats,
        threads=args.threads,
        memory=args.memory,
        results_path=args.results,
        layouts=layouts,
    )
    command = "comera bench embedding " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(results, command.strip(), args.memory)
    print(report)
    if args.write:
        update_section(args.write, args.section, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
