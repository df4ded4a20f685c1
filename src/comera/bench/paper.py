"""``comera bench paper``: the paper's time and memory comparison of training methods, on this machine.

For each method (dense, comera and the baselines of :mod:`comera.baselines`) and each batch size, one case
runs in a fresh Python process (so its peak memory is its own): the workload's recipe builds its data and
dense model at the chosen preset, the method turns the model into what it trains (:meth:`Method.prepare`)
and brings its objective and optimizer, exactly as ``comera train`` does; then one fixed batch of the
training data is trained on for ``--warmup`` steps and timed for ``--repeats`` more (forward, objective,
backward, optimizer step). Reported per case: the median step time, every timed step, the rise of the
resident set during one step over the built model (``train_mib``: activations, gradients, optimizer state),
the process's peak resident set (``peak_mib``), and the trained and dense parameter counts.

LTE splits a batch across its heads, so a batch its heads do not divide runs with ``method.heads`` set to
the largest divisor of the batch not above the method's default (1 at batch 1); the row says so. Periodic
work is not in the medians: GaLore's SVD (first step, then every ``update_proj_gap`` = 200 steps) falls in
the warm-up, and LTE's merge runs every ``merge_every`` = 10 steps (never in the default 2 + 1 + 5 steps).

Writes ``paper.json`` (the cases), ``paper.md`` (a table per batch, each method's time and memory against
comera's) and ``paper_time.png`` / ``paper_memory.png`` (grouped bars) into ``--out``; ``--write FILE``
also updates the ``paper-transformer`` section of a markdown file (``docs/benchmarks.md``).

Usage: ``comera bench paper [--workload nli] [--preset paper] [--methods ...] [--batches 1 32 64 128]
[--repeats 5] [--warmup 2] [--threads 2] [--out bench-paper] [--write docs/benchmarks.md] [--quick]``.
``--quick`` is the smoke check: the ``smoke`` preset, batches 1 and 8, 5 timed steps after 1 warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from comera.bench.report import machine_description, peak_rise_mib, update_section
from comera.methods import MethodContext, get_method
from comera.recipes.base import get_recipe
from comera.recipes.cli import load_recipes
from comera.recipes.settings import resolve_settings, tensorize_config
from comera.report import compression_report
from comera.train.config import TrainConfig
from comera.train.setup import default_optimizer

__all__ = ["METHODS", "BATCHES", "run_case", "lte_heads", "format_report", "plot_report", "main"]

METHODS = ("dense", "comera", "galore", "lte", "apollo", "cola")
"""The methods compared, in table order (the paper's Fig. 1 has dense, CoMERA, GaLore, LTE)."""
BATCHES = (1, 32, 64, 128)
"""The paper's batch sizes."""
QUICK = {"preset": "smoke", "batches": [1, 8], "repeats": 5, "warmup": 1}
"""What ``--quick`` sets."""


def _status_mib(field: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def lte_heads(batch: int, default: int) -> int:
    """The largest number of LTE heads <= ``default`` that divides ``batch``."""
    return max(heads for heads in range(1, default + 1) if batch % heads == 0)


def _assignments(method: str, batch: int) -> list[str]:
    assignments = [f"train.batch_size={batch}"]
    if method == "lte":
        default = get_method("lte").defaults["heads"]
        if batch % default:
            assignments.append(f"method.heads={lte_heads(batch, default)}")
    return assignments


def run_case(
    workload: str, preset: str, method_name: str, batch: int, *, repeats: int, warmup: int, cache_dir: Path
) -> dict[str, Any]:
    """Time and memory of training steps of one method at one batch size, in this process (module doc)."""
    recipe, method = get_recipe(workload), get_method(method_name)
    assignments = _assignments(method_name, batch)
    settings = resolve_settings(recipe.presets, preset, method, assignments=assignments)
    data = recipe.build_data(settings["data"], None, cache_dir)
    torch.manual_seed(settings["train"].get("seed", 0))
    model = recipe.build_model(settings["model"], data)
    dense_params = compression_report(model).model_dense_params
    train = TrainConfig.from_dict(settings["train"])
    context = MethodContext(tensorize=tensorize_config(settings), settings=settings["method"], train=train)
    model = method.prepare(model, context)
    model.train()
    objective = method.objective(model, context)
    optimizer = method.optimizer(model, context) or default_optimizer(objective, train)
    collate = data.collate_fn or default_collate
    inputs = collate([data.train[i % len(data.train)] for i in range(batch)])

    def step() -> None:
        loss = objective.loss(recipe.loss_fn(model, inputs))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    built = _status_mib("VmRSS")
    rise = peak_rise_mib(step)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    return {
        "workload": workload,
        "preset": preset,
        "method": method_name,
        "batch": batch,
        "settings": assignments[1:],
        "ms": statistics.median(times),
        "times_ms": times,
        "train_mib": rise,
        "model_mib": built,
        "peak_mib": _status_mib("VmHWM"),
        "params": sum(param.numel() for param in model.parameters() if param.requires_grad),
        "stored_params": sum(param.numel() for param in model.parameters()),
        "dense_params": dense_params,
        "threads": torch.get_num_threads(),
    }


def _fresh(args: argparse.Namespace, method: str, batch: int, cache_dir: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "comera.bench.paper", "--case", f"{method}:{batch}"]
    command += ["--workload", args.workload, "--preset", args.preset, "--cache", str(cache_dir)]
    command += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    for module in args.imports:
        command += ["--import", module]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"method": method, "batch": batch, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(value: float, reference: float | None) -> str:
    return "-" if reference is None or reference <= 0 else f"{value / reference:.2f}x"


def format_report(results: list[dict[str, Any]], command: str) -> str:
    """Markdown: per batch size, each method's median step time and memory rise, their ratios to comera's
    (``method / comera``: above 1 means comera is faster or leaner), and its whole-model compression (dense
    parameters over the parameters it stores, frozen ones included)."""
    lines = [
        "## Training methods: time and memory per step",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. Each case in a fresh process; median step "
        "time after warm-up; `train MiB` = peak resident rise during a step over the built model; ratios are "
        "method / comera.",
        "",
        "| batch | method | ms | time / comera | train MiB | memory / comera | trained params | compression "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_case = {(r["method"], r["batch"]): r for r in results}
    for batch in sorted({r["batch"] for r in results}):
        reference = by_case.get(("comera", batch))
        for method in [m for m in METHODS if (m, batch) in by_case] + sorted(
            {m for m, b in by_case if b == batch} - set(METHODS)
        ):
            row = by_case[(method, batch)]
            if "error" in row:
                lines.append(
                    f"| {batch} | {method} | - | - | - | - | - | - | failed: {' '.join(row['error'])} |"
                )
                continue
            ok = reference is not None and "error" not in reference
            time_ratio = _ratio(row["ms"], reference["ms"] if ok else None)
            memory_ratio = _ratio(row["train_mib"], reference["train_mib"] if ok else None)
            lines.append(
                f"| {batch} | {method} | {row['ms']:.1f} | {time_ratio} | {row['train_mib']:.1f} "
                f"| {memory_ratio} | {row['params']:,} | {row['dense_params'] / row['stored_params']:.2f}x "
                f"| {' '.join(row['settings'])} |"
            )
    return "\n".join(lines)


def plot_report(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """``paper_time.png`` and ``paper_memory.png``: grouped bars, batch sizes on x, one bar per method, log
    scale; returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in results if "error" not in r]
    batches = sorted({r["batch"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    written = []
    for key, label, name in (
        ("ms", "ms per step", "paper_time.png"),
        ("train_mib", "MiB", "paper_memory.png"),
    ):
        figure, axes = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(len(methods), 1)
        for index, method in enumerate(methods):
            values = {r["batch"]: r[key] for r in rows if r["method"] == method}
            positions = [i + index * width for i, b in enumerate(batches) if b in values]
            axes.bar(positions, [max(values[b], 1e-3) for b in batches if b in values], width, label=method)
        axes.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [str(b) for b in batches])
        axes.set_xlabel("batch size")
        axes.set_ylabel(label)
        axes.set_yscale("log")
        axes.legend(fontsize="small")
        figure.tight_layout()
        path = out / name
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench paper", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="nli", help="the workload recipe (default: nli)")
    parser.add_argument("--preset", default="paper", help="model/data preset (paper, small, smoke)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="methods to compare")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case (>= 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each case")
    parser.add_argument("--out", default="bench-paper", help="folder for paper.json, paper.md and plots")
    parser.add_argument("--write", default=None, help="update the 'paper-transformer' section of this file")
    parser.add_argument("--quick", action="store_true", help="smoke preset, batches 1 and 8, 1 warm-up step")
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], help="import a module first (own recipes)"
    )
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.repeats < 5 or args.warmup < 1:
        parser.error(f"--repeats must be >= 5 and --warmup >= 1, got {args.repeats} and {args.warmup}")
    if any(batch < 1 for batch in args.batches):
        parser.error(f"--batches must be ints >= 1, got {args.batches}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera bench paper``."""
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for module in args.imports:
        importlib.import_module(module)
    load_recipes()
    if args.case is not None:
        method, batch = args.case.split(":")
        cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp())
        result = run_case(
            args.workload,
            args.preset,
            method,
            int(batch),
            repeats=args.repeats,
            warmup=args.warmup,
            cache_dir=cache,
        )
        print(json.dumps(result))
        return 0
    try:
        get_recipe(args.workload)
        for method in args.methods:
            get_method(method)
    except ValueError as error:
        print(f"comera bench paper: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("COMERA_CACHE") or out / "cache")
    results = [_fresh(args, method, batch, cache) for batch in args.batches for method in args.methods]
    command = "comera bench paper " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(results, command.strip())
    (out / "paper.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "paper.md").write_text(report + "\n")
    plot_report(results, out)
    print(report)
    if args.write:
        update_section(args.write, "paper-transformer", report)
    return 1 if any("error" in result for result in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
