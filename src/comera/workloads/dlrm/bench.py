"""DLRM training-step benchmark: time and peak memory of dense and CoMERA DLRM at batch 10k, 20k and 40k.
Run as ``comera bench dlrm``: one step (forward, binary cross-entropy, backward, AdamW) of the Criteo Kaggle
DLRM with dense bags and with TTM bags (``comera``, ``comera-split``, ``comera-naive`` lookups), each case in
a fresh process, on synthetic batches; ``--write FILE`` replaces the ``dlrm`` section of a markdown file.
Details: docs/benchmarks.md, 'DLRM training step'.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional

from comera.measure import (
    fmt,
    machine_description,
    markdown_file_argument,
    median_ms,
    ratio,
    status_kib,
    update_section,
)
from comera.nn.embedding import TTMEmbeddingBag
from comera.workloads.dlrm.model import DLRM, dlrm_preset, reference_table
from comera.workloads.dlrm.presets import TENSORIZE_PRESETS
from comera.workloads.dlrm.synthetic import synthetic_criteo

__all__ = [
    "METHODS",
    "SIZES",
    "BATCHES",
    "WARMUP_ROWS",
    "build_model",
    "run_case",
    "run_cases",
    "format_report",
    "main",
]

METHODS = ("dense", "comera", "comera-split", "comera-naive")
_LOOKUP = {"comera": "auto", "comera-split": "split", "comera-naive": "naive"}
SIZES = ("paper", "small", "smoke")
BATCHES = (10_000, 20_000, 40_000)
WARMUP_ROWS = 64
"""Rows of the step run before the measured one (allocating gradients and AdamW state); the least batch."""


def build_model(size: str, method: str, device: str = "cpu") -> DLRM:
    """The DLRM of preset ``size``; for a ``comera*`` method the tables of the ``dlrm-SIZE`` preset are TTM
    bags built directly with the preset's shapes and rank (random cores), with the method's lookup."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    kwargs = dlrm_preset(size)
    if method == "dense":
        return DLRM(**kwargs).to(device)
    config = TENSORIZE_PRESETS[f"dlrm-{size}"]
    selected = set(config.target_modules)

    def table(index: int, rows: int, dim: int) -> torch.nn.Module:
        name = f"tables.{index}"
        if name not in selected:
            return reference_table(index, rows, dim)
        return TTMEmbeddingBag(
            rows,
            dim,
            "sum",
            rank=config.rank_for(name),
            tau=config.tau,
            lookup=_LOOKUP[method],
            **config.shapes_for(name),
        )

    return DLRM(**kwargs, table_factory=table).to(device)


def _peak_mib(step, device: str, baseline_kb: int) -> float | None:
    """Peak memory while ``step()`` runs: CUDA allocated bytes, or resident size over ``baseline_kb``."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        step()
        return None
    step()
    high = status_kib("VmHWM")
    return None if high is None else (high - baseline_kb) / 1024


def _load_runtime(device: str) -> None:
    """One step of a tiny DLRM, so that code, thread pools and allocator arenas are loaded before the
    memory baseline is taken."""
    tiny = DLRM((2,) * 26, (13, 4), (1,)).to(device)
    optimizer = torch.optim.AdamW(tiny.parameters())
    dense, ids = torch.zeros(2, 13, device=device), torch.zeros(26, 2, dtype=torch.int64, device=device)
    functional.binary_cross_entropy_with_logits(tiny(dense, ids), torch.ones(2, device=device)).backward()
    optimizer.step()


def run_case(size: str, method: str, batch: int, repeats: int, device: str = "cpu") -> dict:
    """Train-step time (median ms) and peak memory (MiB over the post-import baseline), in this process."""
    rows = dlrm_preset(size)["cardinalities"]
    full = synthetic_criteo(batch, seed=0, max_table_rows=max(rows)).data.gather(np.arange(batch)).to(device)
    _load_runtime(device)
    baseline_kb = status_kib("VmRSS") or 0
    model = build_model(size, method, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(rows: int = batch) -> None:
        optimizer.zero_grad(set_to_none=False)
        logits = model(full.dense[:rows], full.ids[:, :rows])
        functional.binary_cross_entropy_with_logits(logits, full.labels[:rows]).backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step(WARMUP_ROWS)
    peak = _peak_mib(step, device, baseline_kb)
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "size": size,
        "method": method,
        "batch": batch,
        "device": device,
        "ms": median_ms(step, repeats=repeats, warmup=1),
        "peak_mb": peak,
        "parameters": parameters,
    }


def _run_in_fresh_process(case: str, repeats: int, threads: int | None, device: str) -> dict:
    command = [sys.executable, "-m", "comera.workloads.dlrm.bench", "--case", case, "--repeats", str(repeats)]
    command += ["--device", device]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {**_parse_case(case), "device": device, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cases(
    size: str,
    batches: Sequence[int],
    methods: Sequence[str],
    *,
    repeats: int,
    threads: int | None = None,
    device: str = "cpu",
) -> list[dict]:
    """Every batch x method case of DLRM preset ``size``, each in a fresh process, with a progress line per
    case; a failed case is an entry with ``error`` (the last line of its stderr)."""
    results = []
    for batch in batches:
        for method in methods:
            start = time.perf_counter()
            result = _run_in_fresh_process(f"{size}:{method}:{batch}", repeats, threads, device)
            results.append(result)
            print(
                f"{size} {batch:6d} {method:13s} {fmt(result.get('ms')):>10s} ms "
                f"{fmt(result.get('peak_mb')):>10s} MiB ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return results


def _parse_case(case: str) -> dict:
    size, method, batch = case.split(":")
    return {"size": size, "method": method, "batch": int(batch)}


def format_report(results: list[dict], command: str) -> str:
    """Markdown section: time and peak memory per method and batch, dense/CoMERA ratios, parameters."""
    ok = [r for r in results if "error" not in r]
    by_key = {(r["size"], r["batch"], r["method"]): r for r in ok}
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]

    def value(size, batch, method, field):
        entry = by_key.get((size, batch, method))
        return None if entry is None else entry[field]

    lines = [
        "## DLRM training step (forward, BCE, backward, AdamW)",
        "",
        f"Machine: {machine_description()}.",
        f"Command: `{command}`. Each case ran in a fresh process; peak = the process's peak resident size",
        "during one full step minus its size before the model was built (parameters, gradients, AdamW",
        "state and activations; on CUDA the peak allocated memory); time = median of the repeats that",
        "follow. `comera` uses the default TTM lookup, `comera-split` the split lookup without",
        "deduplication, `comera-naive` the unoptimized one. `n/a`: the case failed (e.g. out of memory).",
        "",
        "| size | batch | " + " | ".join(f"{m} ms | {m} MiB" for m in methods) + " | time dense/comera | "
        "memory dense/comera |",
        "|---|---|" + "---|---|" * len(methods) + "---|---|",
    ]
    for size, batch in sorted({(r["size"], r["batch"]) for r in results}):
        cells = []
        for method in methods:
            cells += [fmt(value(size, batch, method, "ms")), fmt(value(size, batch, method, "peak_mb"))]
        cells += [
            ratio(value(size, batch, "dense", "ms"), value(size, batch, "comera", "ms")),
            ratio(value(size, batch, "dense", "peak_mb"), value(size, batch, "comera", "peak_mb")),
        ]
        lines.append(f"| {size} | {batch} | " + " | ".join(cells) + " |")
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", "Failed cases:", ""]
        lines += [f"- {r['size']} {r['method']} {r['batch']}: {' '.join(r['error'])}" for r in failed]
    lines += ["", "| size | dense parameters | comera parameters | compression |", "|---|---|---|---|"]
    for size in sorted({r["size"] for r in ok}):
        dense = next((r["parameters"] for r in ok if r["size"] == size and r["method"] == "dense"), None)
        ours = next((r["parameters"] for r in ok if r["size"] == size and r["method"] != "dense"), None)
        lines.append(f"| {size} | {dense or 'n/a'} | {ours or 'n/a'} | {ratio(dense, ours)} |")
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench dlrm", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="paper", help="model preset (default: paper)")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["dense", "comera", "comera-naive"])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per case (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="markdown file whose 'dlrm' section is replaced",
    )
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(b < WARMUP_ROWS for b in args.batches):
        parser.error(f"--repeats must be >= 1 and every batch >= {WARMUP_ROWS}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every case in a fresh process, print the table, optionally write it into a markdown file."""
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.case is not None:
        case = _parse_case(args.case)
        print(json.dumps(run_case(case["size"], case["method"], case["batch"], args.repeats, args.device)))
        return 0
    results = run_cases(
        args.size, args.batches, args.methods, repeats=args.repeats, threads=args.threads, device=args.device
    )
    command = "comera bench dlrm " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(results, command.strip())
    print(report)
    if args.write:
        update_section(args.write, "dlrm", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
