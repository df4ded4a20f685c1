"""``comera bench llm``: the language-model workload's training step for every method, and comera's ladder.
Sections ``steps`` (every method: time, tokens/s, memory, targets) and ``ladder`` (comera cut to each rank),
each case in a fresh process as :mod:`comera.bench.paper` runs it. Details: docs/benchmarks.md, "Language
model (LLaMA-style)" and "How the benchmarks measure".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comera.bench.paper import ladder_ranks, run_fresh_case
from comera.measure import (
    add_memory_argument,
    machine_description,
    markdown_file_argument,
    pyplot,
    update_section,
)
from comera.methods import get_method
from comera.recipes.settings import add_set_argument
from comera.recipes.spec import run_spec
from comera.workloads import load_recipe

__all__ = [
    "METHODS",
    "SECTIONS",
    "QUICK",
    "TARGET_SPEEDUP",
    "TARGET_STATE_RATIO",
    "tokens_per_step",
    "step_targets",
    "format_steps",
    "format_ladder",
    "main",
]

METHODS = ("dense", "comera", "galore", "apollo", "lte", "cola")
"""The methods of the ``steps`` section, in table order."""
SECTIONS = ("steps", "ladder")
QUICK = {"preset": "smoke", "batch": 2, "repeats": 5, "warmup": 1, "threads": 1}
"""The defaults ``--quick`` sets (flags given explicitly win)."""
TARGET_SPEEDUP = 2.0
"""comera's tokens/s over dense's that the workload asks for at the ``paper`` preset."""
TARGET_STATE_RATIO = 5.0
"""How many times smaller than dense's comera's weights plus optimizer state should be."""

_WORKLOAD = "llm"


def tokens_per_step(preset: str, batch: int, assignments: Sequence[str] = ()) -> int:
    """Tokens one training step of ``batch`` blocks of ``preset`` (with ``assignments``) trains on
    (``batch x seq_len``)."""
    load_recipe(_WORKLOAD)
    settings = run_spec(_WORKLOAD, "dense", preset, assignments=assignments).settings
    return batch * int(settings["data"]["seq_len"])


def _with_tokens(result: dict[str, Any], tokens: int) -> dict[str, Any]:
    if "error" in result:
        return result
    return {**result, "tokens": tokens, "tokens_per_s": tokens / (result["ms"] / 1e3)}


def _ok(results: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    row = next((r for r in results if r["method"] == method and "rank" not in r), None)
    return row if row is not None and "error" not in row else None


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def step_targets(results: list[dict[str, Any]]) -> list[str]:
    """One line per target of the ``steps`` section, saying met or missed with the measured numbers."""
    dense, comera = _ok(results, "dense"), _ok(results, "comera")
    if dense is None or comera is None:
        return ["Targets: not measured (the dense or the comera case failed)."]
    speedup = comera["tokens_per_s"] / dense["tokens_per_s"]
    state = dense["weights_optimizer_mib"] / comera["weights_optimizer_mib"]
    lines = [
        f"- tokens/s >= {TARGET_SPEEDUP:g}x dense: {speedup:.2f}x, "
        + ("met" if speedup >= TARGET_SPEEDUP else "missed"),
        f"- weights + optimizer state >= {TARGET_STATE_RATIO:g}x smaller than dense: {state:.2f}x, "
        + ("met" if state >= TARGET_STATE_RATIO else "missed"),
    ]
    for peer in ("galore", "apollo"):
        row = _ok(results, peer)
        if row is not None:
            below = comera["weights_optimizer_mib"] < row["weights_optimizer_mib"]
            lines.append(
                f"- weights + optimizer state below {peer}'s: {comera['weights_optimizer_mib']:.1f} vs "
                f"{row['weights_optimizer_mib']:.1f} MiB, " + ("met" if below else "missed")
            )
    baselines = [r for r in results if r["method"] != "comera" and "error" not in r and "rank" not in r]
    if baselines:
        lowest = min(baselines, key=lambda r: r["training_mib"])
        below = comera["training_mib"] < lowest["training_mib"]
        lines.append(
            f"- training memory below every baseline's: {comera['training_mib']:.1f} MiB vs the lowest "
            f"baseline's {lowest['training_mib']:.1f} ({lowest['method']}), " + ("met" if below else "missed")
        )
    return lines


def _table_head(
    results: list[dict[str, Any]],
    command: str,
    title: str,
    what: str,
    columns: str,
    assignments: Sequence[str] = (),
) -> list[str]:
    """The section's title (with the ``--set`` ``assignments`` that changed the preset, so that sections of
    other settings have other titles), the paragraph saying how it was measured, and the table's header rows
    (``columns``: comma-separated names)."""
    first = next((r for r in results if "error" not in r), {})
    names = [name.strip() for name in columns.split(",")]
    changed = f" ({', '.join(f'`{each}`' for each in assignments)})" if assignments else ""
    return [
        f"## Language model (LLaMA-style): {title}{changed}",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. {what} Each case in a fresh process; "
        f"median of the timed steps after warm-up; {first.get('tokens', '?')} tokens a step; "
        f"{first.get('threads', '?')} torch threads. `weights+opt MiB` = parameters plus optimizer state "
        "(the peers' tables' memory); `training MiB` = what training keeps between steps (parameters, "
        "gradients, optimizer state, buffers) plus the resident rise during one step; ratios are dense / "
        "method (above 1: the method is faster or smaller).",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---|" * len(names),
    ]


def format_steps(results: list[dict[str, Any]], command: str, assignments: Sequence[str] = ()) -> str:
    """Markdown of the ``steps`` section: a row per method (failed ones included) and the targets; the title
    names the ``--set`` ``assignments``."""
    dense = _ok(results, "dense")
    columns = "method, ms, tokens/s, speed vs dense, weights+opt MiB, vs dense, training MiB, vs dense, "
    columns += "peak MiB, trained params, compression"
    lines = _table_head(
        results,
        command,
        "one training step per method",
        "The `llm` workload's model and data, one fixed batch.",
        columns,
        assignments,
    )
    for row in results:
        if "error" in row:
            lines.append(f"| {row['method']} |" + " - |" * 9 + f" failed: {' '.join(row['error'])} |")
            continue
        ratios = (
            [None] * 3
            if dense is None
            else [
                row["tokens_per_s"] / dense["tokens_per_s"],
                dense["weights_optimizer_mib"] / row["weights_optimizer_mib"],
                dense["training_mib"] / row["training_mib"],
            ]
        )
        lines.append(
            f"| {row['method']} | {row['ms']:.1f} | {row['tokens_per_s']:.0f} | {_times(ratios[0])} "
            f"| {row['weights_optimizer_mib']:.1f} | {_times(ratios[1])} | {row['training_mib']:.1f} "
            f"| {_times(ratios[2])} | {row['peak_mib']:.0f} | {row['params']:,} "
            f"| {row['dense_params'] / row['stored_params']:.2f}x |"
        )
    return "\n".join([*lines, "", "Targets (measured, not asserted):", "", *step_targets(results)])


def format_ladder(results: list[dict[str, Any]], command: str, assignments: Sequence[str] = ()) -> str:
    """Markdown of the ``ladder`` section: dense, then a row per rank with its compression and speed; the
    title names the ``--set`` ``assignments``."""
    dense = _ok(results, "dense")
    lines = _table_head(
        results,
        command,
        "comera's rank ladder",
        "comera's model cut to each rank and pruned, against dense.",
        "rank, tensorized compression, model compression, ms, tokens/s, speed vs dense, training MiB, "
        "vs dense",
        assignments,
    )
    for row in results:
        name = "dense" if "rank" not in row else str(row["rank"])
        if "error" in row:
            lines.append(f"| {name} |" + " - |" * 6 + f" failed: {' '.join(row['error'])} |")
            continue
        compression = (
            ["-", "-"]
            if "rank" not in row
            else [f"{row['tensorized_ratio']:.1f}x", f"{row['model_ratio']:.2f}x"]
        )
        speed = None if dense is None else row["tokens_per_s"] / dense["tokens_per_s"]
        memory = None if dense is None else dense["training_mib"] / row["training_mib"]
        lines.append(
            f"| {name} | {compression[0]} | {compression[1]} | {row['ms']:.1f} | {row['tokens_per_s']:.0f} "
            f"| {_times(speed)} | {row['training_mib']:.1f} | {_times(memory)} |"
        )
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path, *, ladder: bool) -> Path | None:
    """Tokens/s (left) and training memory (right) per method, or against compression for the ladder."""
    plt = pyplot()
    rows = [r for r in results if "error" not in r]
    if plt is None or not rows:
        return None
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    if ladder:
        rungs = [r for r in rows if "rank" in r]
        dense = _ok(results, "dense")
        for axis, field, label in ((speed, "tokens_per_s", "tokens/s"), (memory, "training_mib", "MiB")):
            axis.plot(
                [r["tensorized_ratio"] for r in rungs], [r[field] for r in rungs], marker="o", label="comera"
            )
            if dense is not None:
                axis.axhline(dense[field], linestyle="--", color="gray", label="dense")
            axis.set(xscale="log", xlabel="compression of the tensorized layers", ylabel=label)
            axis.legend(fontsize="small")
    else:
        names = [r["method"] for r in rows]
        speed.bar(names, [r["tokens_per_s"] for r in rows])
        speed.set(ylabel="tokens/s", title="training throughput")
        memory.bar(names, [r["training_mib"] for r in rows], label="training")
        memory.bar(names, [r["weights_optimizer_mib"] for r in rows], label="weights + optimizer", alpha=0.7)
        memory.set(ylabel="MiB", title="memory", yscale="log")
        memory.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench llm", description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections")
    parser.add_argument("--preset", default="paper", help="the llm preset (paper, small, smoke)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="steps: the methods compared")
    parser.add_argument("--batch", type=int, default=4, help="blocks per step (default 4)")
    parser.add_argument(
        "--ladder", type=int, nargs="+", default=None, help="ladder: ranks (default: derived)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case (>= 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each case")
    add_memory_argument(parser)
    parser.add_argument("--out", default="bench-llm", help="folder for each section's JSON, markdown, PNG")
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="update the 'llm-SECTION' sections of this file",
    )
    parser.add_argument("--quick", action="store_true", help="smoke sizes (QUICK)")
    add_set_argument(
        parser,
        "change one setting of the preset in every case, as comera train --set does (repeatable), "
        "e.g. tensorize.format=ttm",
    )
    parser.add_argument(
        "--label",
        default=None,
        help="with --write: write the sections as llm-NAME-LABEL, beside the preset's own (for --set runs)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.repeats < 5 or args.warmup < 1:
        parser.error(f"--repeats must be >= 5 and --warmup >= 1, got {args.repeats} and {args.warmup}")
    if args.batch < 1 or (args.ladder is not None and min(args.ladder) < 1):
        parser.error(f"--batch and every --ladder rank must be >= 1, got {args.batch} and {args.ladder}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    presets = load_recipe(_WORKLOAD).presets
    if args.preset not in presets:
        parser.error(f"--preset: unknown preset {args.preset!r}; choose one of {sorted(presets)}")
    for method in args.methods:
        try:
            get_method(method)
        except ValueError as error:
            parser.error(f"--methods: {error}")
    problem = _settings_problem(args.preset, [*args.methods, "comera"], args.assignments)
    if problem is not None:
        parser.error(problem if problem.startswith("--set") else f"--set: {problem}")
    if args.label is not None and not args.label.replace("-", "").replace("_", "").isalnum():
        parser.error(f"--label must be letters, digits, '-' or '_', got {args.label!r}")
    args.sections = [name for name in SECTIONS if name in args.sections]
    return args


def _settings_problem(preset: str, methods: Sequence[str], assignments: Sequence[str]) -> str | None:
    """What is wrong with ``assignments`` for any of ``methods`` at ``preset`` (the settings and the
    tensorization they name), or None: found before any case runs, not once per case."""
    load_recipe(_WORKLOAD)
    for method in dict.fromkeys(methods):
        try:
            run_spec(_WORKLOAD, method, preset, assignments=assignments)
        except (ValueError, TypeError, KeyError) as error:
            return str(error)
    return None


def _case(args: argparse.Namespace, method: str, cache: Path, rank: int | None = None) -> dict[str, Any]:
    result = run_fresh_case(
        _WORKLOAD,
        args.preset,
        method,
        args.batch,
        repeats=args.repeats,
        warmup=args.warmup,
        cache_dir=cache,
        threads=args.threads,
        memory=args.memory,
        rank=rank,
        assignments=args.assignments,
    )
    return _with_tokens(result, tokens_per_step(args.preset, args.batch, args.assignments))


def _run(name: str, args: argparse.Namespace, cache: Path) -> list[dict[str, Any]]:
    if name == "steps":
        return [_case(args, method, cache) for method in args.methods]
    ranks = sorted(set(args.ladder or ladder_ranks(_WORKLOAD, args.preset)), reverse=True)
    return [_case(args, "dense", cache)] + [_case(args, "comera", cache, rank) for rank in ranks]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera bench llm``: 0 when every case ran, 1 when one failed, 2 for bad flags."""
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("COMERA_CACHE") or out / "cache")
    command = ("comera bench llm " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    failed = False
    for name in args.sections:
        print(f"== {name}", flush=True)
        results = _run(name, args, cache)
        report = (format_steps if name == "steps" else format_ladder)(results, command, args.assignments)
        record = {"section": name, "command": command, "machine": machine_description(), "results": results}
        (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / f"{name}.md").write_text(report + "\n")
        _plot(results, out / f"llm_{name}.png", ladder=name == "ladder")
        print(report, flush=True)
        if args.write:
            update_section(args.write, f"llm-{name}" + (f"-{args.label}" if args.label else ""), report)
        failed |= any("error" in result for result in results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
