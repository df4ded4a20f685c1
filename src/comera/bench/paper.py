"""``comera bench paper``: the paper's time and memory comparison, on this machine, in one invocation.
Sections ``transformer`` (Fig. 1, every method and batch), ``ladder`` (Fig. 12), ``lookup`` (Fig. 5), ``dlrm``
(Fig. 8) and ``mlm``, every case in a fresh process, medians of at least ``--repeats`` steps after warm-up.
Details: docs/benchmarks.md, "Training methods: time and memory per step" and "How the benchmarks measure"."""

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from comera.bench import embedding
from comera.bench.ladder import (
    compression_fields,
    default_ladder,
    format_ladder,
    plot_ladder,
    preset_rank,
    truncate_ranks_,
)
from comera.cpu import reuse_freed_memory
from comera.measure import (
    add_memory_argument,
    allocation_of,
    grouped_bars,
    machine_description,
    markdown_file_argument,
    peak_rise_mib,
    profile_steps,
    status_mib,
    training_state_mib,
    update_section,
    weights_optimizer_mib,
)
from comera.methods import MethodContext, get_method
from comera.methods.lte import LTESettings
from comera.recipes.settings import add_set_argument
from comera.recipes.spec import run_spec
from comera.report import compression_report
from comera.train.setup import default_optimizer
from comera.workloads import load_recipe
from comera.workloads.dlrm import bench as dlrm
from comera.workloads.mlm import bench as mlm
from comera.workloads.mlm.model import MODEL_PRESETS as MLM_PRESETS

__all__ = [
    "METHODS",
    "BATCHES",
    "LOOKUP_IDS",
    "QUICK",
    "SECTIONS",
    "Section",
    "run_case",
    "run_fresh_case",
    "lte_heads",
    "ladder_ranks",
    "format_report",
    "plot_report",
    "parse_arguments",
    "main",
]

METHODS = ("dense", "comera", "galore", "lte", "apollo", "cola")
"""The methods compared, in table order (the paper's Fig. 1 has dense, CoMERA, GaLore, LTE)."""
BATCHES = (1, 32, 64, 128)
"""The paper's batch sizes."""
LOOKUP_IDS = embedding.SIZES
"""Ids per lookup batch in the ``lookup`` section (Fig. 5)."""
MEMORY_FLOOR_MIB = 1.0
"""Memory rises at or below this are not used as a ratio's denominator (resident-set resolution and noise)."""
QUICK = {
    "preset": "smoke",
    "batches": [1, 8],
    "ladder_batch": 8,
    "lookup_ids": [1000],
    "dlrm_size": "smoke",
    "dlrm_batches": [1000],
    "mlm_preset": "smoke",
    "mlm_batch": 2,
    "repeats": 5,
    "warmup": 1,
    "threads": 1,
}
"""The defaults ``--quick`` sets (flags given explicitly win)."""


def lte_heads(batch: int, default: int) -> int:
    """The largest number of LTE heads <= ``default`` that divides ``batch``."""
    return max(heads for heads in range(1, default + 1) if batch % heads == 0)


def _assignments(method: str, batch: int) -> list[str]:
    assignments = [f"train.batch_size={batch}"]
    if method == "lte":
        default = LTESettings().heads
        if batch % default:
            assignments.append(f"method.heads={lte_heads(batch, default)}")
    return assignments


def run_case(
    workload: str,
    preset: str,
    method_name: str,
    batch: int,
    *,
    repeats: int,
    warmup: int,
    cache_dir: Path,
    rank: int | None = None,
    memory: str = "reuse",
    assignments: Sequence[str] = (),
    profile: int = 0,
) -> dict[str, Any]:
    """Time and memory of training steps of one method at one batch size, in this process (the memory step
    under glibc's setting, then :func:`comera.cpu.reuse_freed_memory` with ``memory="reuse"``); with ``rank``
    the model is first cut to that rank (:func:`comera.bench.ladder.truncate_ranks_`) and the compression is
    reported; ``assignments`` (``SECTION.KEY=VALUE``) change the preset's settings; with ``profile`` > 0 that
    many more steps run under ``torch.profiler`` (:func:`comera.measure.profile_steps`)."""
    recipe, method = load_recipe(workload), get_method(method_name)
    assignments = [*assignments, *_assignments(method_name, batch)]
    spec = run_spec(workload, method_name, preset, assignments=assignments)
    settings = spec.settings
    data = recipe.build_data(settings["data"], None, cache_dir)
    torch.manual_seed(spec.train.seed)
    model = recipe.build_model(settings["model"], data)
    dense_params = compression_report(model).model_dense_params
    train = spec.train
    context = MethodContext(tensorize=spec.tensorize, settings=spec.method_settings, train=train)
    model = method.prepare(model, context)
    ladder = {}
    if rank is not None:
        pruned = truncate_ranks_(model, rank)
        ladder = {"rank": rank, "pruned_layers": len(pruned.layers), **compression_fields(model)}
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
    torch_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    state = training_state_mib(model, torch_optimizer)
    weights_optimizer = weights_optimizer_mib(model, torch_optimizer)
    built = status_mib("VmRSS", missing=float("nan"))
    rise = peak_rise_mib(step)
    if memory == "reuse":
        reuse_freed_memory()
        step()
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
        "state_mib": state,
        "training_mib": state + max(rise, 0.0),
        "weights_optimizer_mib": weights_optimizer,
        "model_mib": built,
        "peak_mib": status_mib("VmHWM", missing=float("nan")),
        "params": sum(param.numel() for param in model.parameters() if param.requires_grad),
        "stored_params": sum(param.numel() for param in model.parameters()),
        "dense_params": dense_params,
        "threads": torch.get_num_threads(),
        "memory": memory,
        **ladder,
        **({"profile": profile_steps(step, profile)} if profile else {}),
    }


def run_fresh_case(
    workload: str,
    preset: str,
    method: str,
    batch: int,
    *,
    repeats: int,
    warmup: int,
    cache_dir: Path,
    threads: int | None = None,
    memory: str = "reuse",
    imports: Sequence[str] = (),
    rank: int | None = None,
    assignments: Sequence[str] = (),
    profile: int = 0,
) -> dict[str, Any]:
    """:func:`run_case` in a new interpreter (so its peak memory is its own), with a progress line on stdout;
    the arguments are :func:`run_case`'s, plus ``threads`` (torch threads in the case; None: torch's default)
    and ``imports`` (modules imported first, e.g. one registering its own recipe). Returns the case's result,
    or, for a failed case, an entry with ``error`` (the last line of its stderr)."""
    case = f"{method}:{batch}" + ("" if rank is None else f":{rank}")
    command = [sys.executable, "-m", "comera.bench.paper", "--case", case]
    command += ["--workload", workload, "--preset", preset, "--cache", str(cache_dir)]
    command += ["--repeats", str(repeats), "--warmup", str(warmup), "--memory", memory]
    for assignment in assignments:
        command += ["--set", assignment]
    for module in imports:
        command += ["--import", module]
    if threads is not None:
        command += ["--threads", str(threads)]
    if profile:
        command += ["--profile", str(profile)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{case:14s} {result['ms']:10.1f} ms {result['train_mib']:9.1f} MiB", flush=True)
        return result
    error = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}, nothing on stderr"]
    print(f"{case:14s} failed: {' '.join(error)}", flush=True)
    result = {"workload": workload, "preset": preset, "method": method, "batch": batch}
    return {**result, "error": error, **({} if rank is None else {"rank": rank})}


def _fresh(
    args: argparse.Namespace, method: str, batch: int, cache_dir: Path, rank: int | None = None
) -> dict[str, Any]:
    """:func:`run_fresh_case` with the command's flags."""
    return run_fresh_case(
        args.workload,
        args.preset,
        method,
        batch,
        repeats=args.repeats,
        warmup=args.warmup,
        cache_dir=cache_dir,
        threads=args.threads,
        memory=args.memory,
        imports=args.imports,
        rank=rank,
    )


def _ratio(value: float, reference: float | None, floor: float = 0.0) -> str:
    """``value / reference``, or "-" without a reference or when the reference is at most ``floor``."""
    return "-" if reference is None or reference <= floor else f"{value / reference:.2f}x"


def format_report(results: list[dict[str, Any]], command: str) -> str:
    """Markdown: per batch size, each method's median step time, its training memory (state kept between
    steps, counted exactly, plus the measured rise during a step), their ratios to comera's (``method /
    comera``: above 1 means comera is faster or leaner), and its whole-model compression (dense parameters
    over the parameters it stores, frozen ones included)."""
    lines = [
        "## Training methods: time and memory per step",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. Each case in a fresh process; median step "
        f"time after warm-up (timed steps' allocation: {allocation_of(results)}). `state MiB` = what "
        "training keeps between steps, counted tensor by tensor (parameters, buffers, gradients, optimizer "
        "state); `step MiB` = peak resident rise during one step over the trained model (activations and "
        "temporaries; glibc's allocation setting); `training MiB` = their sum; ratios are method / comera.",
        "",
        "| batch | method | ms | time / comera | state MiB | step MiB | training MiB | memory / comera "
        "| trained params | compression | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_case = {(r["method"], r["batch"]): r for r in results}
    for batch in sorted({r["batch"] for r in results}):
        reference = by_case.get(("comera", batch))
        for method in [m for m in METHODS if (m, batch) in by_case] + sorted(
            {m for m, b in by_case if b == batch} - set(METHODS)
        ):
            row = by_case[(method, batch)]
            if "error" in row:
                dashes = " | ".join(["-"] * 8)
                lines.append(f"| {batch} | {method} | {dashes} | failed: {' '.join(row['error'])} |")
                continue
            ok = reference is not None and "error" not in reference
            time_ratio = _ratio(row["ms"], reference["ms"] if ok else None)
            memory_ratio = _ratio(
                row["training_mib"], reference["training_mib"] if ok else None, MEMORY_FLOOR_MIB
            )
            lines.append(
                f"| {batch} | {method} | {row['ms']:.1f} | {time_ratio} | {row['state_mib']:.1f} "
                f"| {row['train_mib']:.1f} | {row['training_mib']:.1f} | {memory_ratio} | {row['params']:,} "
                f"| {row['dense_params'] / row['stored_params']:.2f}x | {' '.join(row['settings'])} |"
            )
    return "\n".join(lines)


def _plot_bars(
    results: list[dict[str, Any]],
    out: Path,
    *,
    name: str,
    group: str,
    memory: str,
    xlabel: str,
    order: Sequence[str],
) -> list[Path]:
    """``NAME_time.png`` (field ``ms``) and ``NAME_memory.png`` (field ``memory``): grouped bars, a group
    per value of ``group``, a bar per method, log scale; returns the files written."""
    written = [
        grouped_bars(
            results,
            out / f"{name}_{kind}.png",
            group=group,
            series="method",
            value=value,
            xlabel=xlabel,
            ylabel=label,
            order=order,
        )
        for kind, value, label in (("time", "ms", "ms per step"), ("memory", memory, "MiB"))
    ]
    return [path for path in written if path is not None]


def plot_report(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """``transformer_time.png`` and ``transformer_memory.png``: grouped bars, batch sizes on x, one bar per
    method, log scale; returns the files written (none without matplotlib)."""
    return _plot_bars(
        results,
        out,
        name="transformer",
        group="batch",
        memory="training_mib",
        xlabel="batch size",
        order=METHODS,
    )


def ladder_ranks(workload: str, preset: str) -> list[int]:
    """The default ladder of ``preset`` of ``workload``: :func:`comera.bench.ladder.default_ladder` of the
    rank of its comera tensorization."""
    load_recipe(workload)
    return default_ladder(preset_rank(run_spec(workload, "comera", preset).tensorize))


def _run_transformer(args: argparse.Namespace, cache: Path) -> list[dict[str, Any]]:
    return [_fresh(args, method, batch, cache) for batch in args.batches for method in args.methods]


def _run_ladder(args: argparse.Namespace, cache: Path) -> list[dict[str, Any]]:
    ranks = args.ladder or ladder_ranks(args.workload, args.preset)
    results = [_fresh(args, "dense", args.ladder_batch, cache)]
    return results + [_fresh(args, "comera", args.ladder_batch, cache, rank) for rank in ranks]


def _run_lookup(args: argparse.Namespace, cache: Path) -> list[dict[str, Any]]:
    return embedding.run_cases(
        ("paper",),
        ("uniform",),
        args.lookup_ids,
        embedding.METHODS,
        repeats=args.repeats,
        threads=args.threads,
    )


def _run_dlrm(args: argparse.Namespace, cache: Path) -> list[dict[str, Any]]:
    return dlrm.run_cases(
        args.dlrm_size, args.dlrm_batches, dlrm.METHODS, repeats=args.repeats, threads=args.threads
    )


def _run_mlm(args: argparse.Namespace, cache: Path) -> list[dict[str, Any]]:
    return mlm.run_cases(
        args.mlm_preset,
        mlm.METHODS,
        batch=args.mlm_batch,
        seq_len=MLM_PRESETS[args.mlm_preset]["max_length"],
        vocab_size=mlm.VOCAB,
        repeats=args.repeats,
        threads=args.threads,
        memory=args.memory,
    )


@dataclass(frozen=True)
class Section:
    """One section of the comparison: ``run(args, cache_dir)`` measures its cases (each in a fresh process),
    ``report(results, command)`` gives its markdown, ``plot(results, out)`` writes its PNGs."""

    run: Callable[[argparse.Namespace, Path], list[dict[str, Any]]]
    report: Callable[[list[dict[str, Any]], str], str]
    plot: Callable[[list[dict[str, Any]], Path], list[Path]]


SECTIONS = {
    "transformer": Section(_run_transformer, format_report, plot_report),
    "ladder": Section(_run_ladder, format_ladder, plot_ladder),
    "lookup": Section(
        _run_lookup,
        embedding.format_report,
        partial(
            _plot_bars,
            name="lookup",
            group="count",
            memory="peak_mb",
            xlabel="ids per batch",
            order=embedding.METHODS,
        ),
    ),
    "dlrm": Section(
        _run_dlrm,
        dlrm.format_report,
        partial(_plot_bars, name="dlrm", group="batch", memory="peak_mb", xlabel="batch", order=dlrm.METHODS),
    ),
    "mlm": Section(
        _run_mlm,
        mlm.format_report,
        partial(
            _plot_bars, name="mlm", group="batch", memory="step_peak_mb", xlabel="batch", order=mlm.METHODS
        ),
    ),
}
"""The sections, in the order they run; ``--write`` updates section ``paper-NAME``."""


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``comera bench paper`` in ``argv`` (None: the command line) as a namespace:
    ``--quick`` fills the defaults that explicit flags leave open, ``sections`` come in the fixed order of
    :data:`SECTIONS`, ``ladder`` is deduplicated and sorted largest first; bad counts exit through
    ``argparse`` naming the flag."""
    parser = argparse.ArgumentParser(prog="comera bench paper", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="sections to run"
    )
    parser.add_argument("--workload", default="nli", help="transformer/ladder: the workload recipe (nli)")
    parser.add_argument("--preset", default="paper", help="transformer/ladder: preset (paper, small, smoke)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="transformer: methods compared")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="transformer: batches")
    parser.add_argument(
        "--ladder", type=int, nargs="+", default=None, help="ladder: ranks (default: derived)"
    )
    parser.add_argument("--ladder-batch", type=int, default=32, help="ladder: batch size (default 32)")
    parser.add_argument("--lookup-ids", type=int, nargs="+", default=list(LOOKUP_IDS), help="lookup: ids")
    parser.add_argument("--dlrm-size", choices=dlrm.SIZES, default="paper", help="dlrm: model preset")
    parser.add_argument(
        "--dlrm-batches", type=int, nargs="+", default=list(dlrm.BATCHES), help="dlrm: batches"
    )
    parser.add_argument(
        "--mlm-preset", choices=sorted(MLM_PRESETS), default="paper", help="mlm: model preset"
    )
    parser.add_argument("--mlm-batch", type=int, default=4, help="mlm: blocks per step (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case (>= 5)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="transformer/ladder: untimed steps first (>= 1)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each case")
    add_memory_argument(parser)
    parser.add_argument("--out", default="bench-paper", help="folder for each section's JSON, markdown, PNGs")
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="update the 'paper-SECTION' sections of this file",
    )
    parser.add_argument("--quick", action="store_true", help="smoke sizes for every section (QUICK)")
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], help="import a module first (own recipes)"
    )
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", type=int, default=0, help=argparse.SUPPRESS)
    add_set_argument(parser, argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    _check_numbers(parser, args)
    args.sections = [name for name in SECTIONS if name in args.sections]
    if args.ladder is not None:
        args.ladder = sorted(set(args.ladder), reverse=True)
    return args


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` naming the first numeric flag out of its range."""
    if args.repeats < 5 or args.warmup < 1:
        parser.error(f"--repeats must be >= 5 and --warmup >= 1, got {args.repeats} and {args.warmup}")
    least = {"batches": 1, "ladder": 1, "ladder_batch": 1, "lookup_ids": 1, "mlm_batch": 1}
    least["dlrm_batches"] = dlrm.WARMUP_ROWS
    for name, bound in least.items():
        value = getattr(args, name)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(number < bound for number in values):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be >= {bound} (every value), got {value}")


def _check_names(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--workload``, ``--preset`` or ``--methods`` (naming the flag), or None."""
    try:
        recipe = load_recipe(args.workload)
    except ValueError as error:
        return f"--workload: {error}"
    if args.preset not in recipe.presets:
        return f"--preset: unknown preset {args.preset!r}; choose one of {sorted(recipe.presets)}"
    for method in args.methods:
        try:
            get_method(method)
        except ValueError as error:
            return f"--methods: {error}"
    return None


def _run_one_case(args: argparse.Namespace) -> int:
    method, batch, *rank = args.case.split(":")
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp())
    result = run_case(
        args.workload,
        args.preset,
        method,
        int(batch),
        repeats=args.repeats,
        warmup=args.warmup,
        cache_dir=cache,
        rank=int(rank[0]) if rank else None,
        memory=args.memory,
        assignments=args.assignments,
        profile=args.profile,
    )
    print(json.dumps(result))
    return 0


def _write_json(out: Path, name: str, command: str, payload: dict[str, Any]) -> None:
    record = {"section": name, "command": command, "machine": machine_description(), **payload}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")


def _run_section(name: str, args: argparse.Namespace, out: Path, cache: Path, command: str) -> bool:
    """Run section ``name`` and write its outputs; whether every case of it succeeded."""
    section = SECTIONS[name]
    print(f"== {name}", flush=True)
    try:
        results = section.run(args, cache)
    except RuntimeError as error:
        print(f"comera bench paper: section {name} failed: {error}", file=sys.stderr)
        _write_json(out, name, command, {"error": str(error)})
        return False
    report = section.report(results, command)
    _write_json(out, name, command, {"results": results})
    (out / f"{name}.md").write_text(report + "\n")
    section.plot(results, out)
    print(report, flush=True)
    if args.write:
        update_section(args.write, f"paper-{name}", report)
    return not any("error" in result for result in results)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera bench paper``."""
    args = parse_arguments(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for module in args.imports:
        importlib.import_module(module)
    if args.case is not None:
        return _run_one_case(args)
    problem = _check_names(args)
    if problem is not None:
        print(f"comera bench paper: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("COMERA_CACHE") or out / "cache")
    command = ("comera bench paper " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    succeeded = [_run_section(name, args, out, cache, command) for name in args.sections]
    return 0 if all(succeeded) else 1


if __name__ == "__main__":
    raise SystemExit(main())
