"""Inference benchmark: forward time and memory of dense and comera layers, with and without the cache.
Run as ``comera bench inference``: ``nn.Linear`` against ``TTLinear`` merging per call or cached, and
``nn.Embedding`` against ``TTMEmbedding``, under ``torch.no_grad()``. Details: docs/benchmarks.md,
"Inference: comera layers with and without their cache".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

from comera.bench.embedding import TABLES, build_table
from comera.measure import (
    interleaved_medians_ms,
    machine_description,
    markdown_file_argument,
    peak_rise_mib,
    update_section,
)
from comera.nn.linear import TTLinear

__all__ = ["SHAPES", "METHODS", "EMBEDDING_METHODS", "build", "main"]

SHAPES = ((768, 768), (768, 3072), (3072, 768))
BATCHES = (1, 8, 128)
RANK = 30
METHODS = ("nn.Linear", "TT merge", "TT cached")
EMBEDDING_METHODS = ("nn.Embedding", "TTM lookup", "TTM cached")
EMBEDDING_IDS = (1, 64, 512)


def build(method: str, in_features: int, out_features: int) -> nn.Module:
    """The layer of ``method``, in the mode the method names (the embedding methods ignore the sizes)."""
    if method == "nn.Linear":
        return nn.Linear(in_features, out_features).eval()
    if method == "nn.Embedding":
        return nn.Embedding(TABLES["paper"]["rows"], TABLES["paper"]["dim"]).eval()
    if method in EMBEDDING_METHODS:
        table = build_table("paper")
        return table.train() if method == "TTM lookup" else table.eval()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS + EMBEDDING_METHODS}, got {method!r}")
    layer = TTLinear(in_features, out_features, rank=RANK)
    return layer.train() if method == "TT merge" else layer.eval()


def _calls(layer: nn.Module, x: torch.Tensor, calls: int) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            for _ in range(calls):
                layer(x)

    return run


def time_row(in_features: int, out_features: int, batch: int, calls: int, repeats: int) -> dict[str, float]:
    """Milliseconds per forward call of every method at one shape and batch."""
    torch.manual_seed(0)
    x = torch.randn(batch, in_features)
    runs = {method: _calls(build(method, in_features, out_features), x, calls) for method in METHODS}
    return {name: ms / calls for name, ms in interleaved_medians_ms(runs, repeats=repeats).items()}


def time_embedding_row(count: int, calls: int, repeats: int) -> dict[str, float]:
    """Milliseconds per lookup call of ``count`` uniform ids for every embedding method."""
    torch.manual_seed(0)
    ids = torch.randint(0, TABLES["paper"]["rows"], (count,))
    runs = {method: _calls(build(method, 0, 0), ids, calls) for method in EMBEDDING_METHODS}
    return {name: ms / calls for name, ms in interleaved_medians_ms(runs, repeats=repeats).items()}


def memory_case(method: str, in_features: int, out_features: int) -> float:
    """MiB the process's peak resident size rises by while building the layer and running one call."""
    x = (
        torch.randint(0, TABLES["paper"]["rows"], (1,))
        if method in EMBEDDING_METHODS
        else torch.randn(1, in_features)
    )
    _calls(nn.Linear(8, 8), torch.randn(1, 8), 1)()  # loads kernels before the measurement

    def step() -> None:
        _calls(build(method, in_features, out_features), x, 1)()

    return peak_rise_mib(step)


def _memory_in_fresh_process(method: str, in_features: int, out_features: int) -> float:
    command = [sys.executable, "-m", "comera.bench.inference", "--memory-case"]
    command += [method, str(in_features), str(out_features)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _speed_table(rows: list[dict], label: str, key: str, methods: Sequence[str]) -> list[str]:
    """Markdown rows: per-call times of ``methods`` and the cached method's speed-ups over the other two."""
    first, second, cache = methods
    lines = [
        f"| {label} | {first} ms | {second} ms | {cache} ms | cached vs {first} | cached vs {second} |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        times = [row["ms"][method] for method in methods]
        cells = " | ".join(f"{value:.4f}" for value in times)
        lines.append(f"| {row[key]} | {cells} | {times[0] / times[2]:.2f}x | {times[1] / times[2]:.2f}x |")
    return lines


def format_report(
    linear_rows: list[dict],
    embedding_rows: list[dict],
    memory: dict[str, dict[str, float]],
    command: str,
    calls: int,
    repeats: int,
) -> str:
    """Markdown section: per-call times, speed-ups and memory of the linear and embedding methods."""
    lines = [
        "## Inference: comera layers with and without their cache, fp32",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. Forward only under `torch.no_grad()`; "
        f"time per call = median of {repeats} samples of {calls} calls, the methods of a row sampled "
        "round-robin in one process. `TT merge` / `TTM lookup` merge the cores on every call (train mode); "
        "`TT cached` / `TTM cached` are the eval-mode layers answering from their cache. Memory: rise of "
        "peak RSS while a fresh process builds the layer and runs one call (1 row, or 1 id).",
        "",
        f"Linear layers (rank {RANK}):",
        "",
        *_speed_table(linear_rows, "shape, B", "case", METHODS),
        "",
        "Embedding (30522 x 768, rank 32), uniform ids:",
        "",
        *_speed_table(embedding_rows, "ids", "case", EMBEDDING_METHODS),
        "",
        "Memory (MiB):",
        "",
        "| layer | dense | uncached | cached |",
        "|---|---|---|---|",
    ]
    for layer, values in memory.items():
        lines.append(f"| {layer} | " + " | ".join(f"{value:.2f}" for value in values.values()) + " |")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench inference", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="forward calls per timed sample (>= 1)")
    parser.add_argument("--repeats", type=int, default=9, help="timed samples per method (>= 1)")
    parser.add_argument("--quick", action="store_true", help="one shape, B=1, few samples: a smoke run")
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        metavar="MARKDOWN",
        help="update the 'inference' section of this file",
    )
    parser.add_argument("--memory-case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("calls", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``comera bench inference [--quick] [--write docs/benchmarks.md]``."""
    args = _parse(argv)
    if args.memory_case is not None:
        method, in_features, out_features = args.memory_case
        print(json.dumps(memory_case(method, int(in_features), int(out_features))))
        return 0
    shapes, batches, repeats = (SHAPES[:1], BATCHES[:1], 3) if args.quick else (SHAPES, BATCHES, args.repeats)
    print(machine_description())
    linear_rows, embedding_rows, memory = [], [], {}
    for in_features, out_features in shapes:
        for batch in batches:
            times = time_row(in_features, out_features, batch, args.calls, repeats)
            linear_rows.append({"case": f"{in_features}->{out_features}, {batch}", "ms": times})
            print(f"{in_features}->{out_features} B={batch}: {times}")
        memory[f"{in_features}->{out_features}"] = {
            method: _memory_in_fresh_process(method, in_features, out_features) for method in METHODS
        }
    for count in EMBEDDING_IDS[:1] if args.quick else EMBEDDING_IDS:
        times = time_embedding_row(count, args.calls, repeats)
        embedding_rows.append({"case": count, "ms": times})
        print(f"embedding ids={count}: {times}")
    memory["embedding"] = {method: _memory_in_fresh_process(method, 0, 0) for method in EMBEDDING_METHODS}
    command = "comera bench inference " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(linear_rows, embedding_rows, memory, command.strip(), args.calls, repeats)
    print(report)
    if args.write:
        update_section(args.write, "inference", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
