"""``comera compare WORKLOAD``: several training methods (and ``--variant`` runs) on one workload, each a
``comera train`` run in its own folder ``OUT/NAME`` and fresh process, finished runs reused and unfinished
ones resumed, then one table and one plot per comparison axis. Details: docs/recipes.md, 'Comparing
methods: comera compare'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comera.atomic import atomic_write_bytes
from comera.cli.child import INTERRUPTED, module_command, run_child
from comera.cli.commands.numbers import number, times
from comera.cli.commands.paths import run_folder_argument
from comera.cli.commands.train import add_setting_arguments
from comera.cli.startup import interrupts_raise
from comera.methods import get_method, method_names, settings_type
from comera.recipes.folders import missing_folders, remove_empty_folders, writable_folder
from comera.recipes.run import SetupError, read_run_config, run_spec_folder
from comera.recipes.run_folder import header_difference
from comera.recipes.run_records import strict_json
from comera.recipes.settings import check_recorded_settings, parse_assignment, with_run_data_keys
from comera.recipes.spec import RunSpec, resumed, run_spec
from comera.train.metrics import read_metrics
from comera.train.plateau import last_fifth_change, plateau_note
from comera.workloads import load_recipe, workload_names

__all__ = [
    "DEFAULT_METHODS",
    "MethodRun",
    "compare",
    "method_assignments",
    "format_markdown",
    "build_parser",
    "main",
]

DEFAULT_METHODS: tuple[str, ...] = ("dense", "comera", "galore", "apollo", "lte", "cola")
"""The methods ``comera compare`` runs when ``--methods`` is not given: the paper's and the newer peers."""

_RESULTS = "results.json"
_VARIANT_NAME = re.compile(r"[A-Za-z0-9._-]+")
_OPTIONAL_COLUMNS = (("tokens_per_s", "tokens/s"), ("weights_optimizer_mib", "weights+optimizer MiB"))
_AXIS_WORDS = {"step": "step", "tokens": "tokens trained on", "time": "training time"}
_CONFIG = "config.json"


@dataclass
class MethodRun:
    """One method of a comparison.

    Attributes:
        method: the method's name.
        run_dir: its run folder.
        status: ``"trained"`` (this call trained or resumed it), ``"reused"`` (a finished run with the same
            settings was already there) or ``"failed"``.
        results: the run's ``results.json`` (None when it failed).
        error: why it failed (None otherwise).
    """

    method: str
    run_dir: Path
    status: str
    results: dict[str, Any] | None = None
    error: str | None = None


def _normalised(header: dict[str, Any]) -> dict[str, Any]:
    """The header as ``config.json`` stores it (tuples become lists)."""
    return json.loads(json.dumps(header))


def _state(run_dir: Path, header: dict[str, Any]) -> str:
    """``"empty"``, ``"finished"`` or ``"unfinished"`` for a folder holding this run; ``ValueError`` when it
    holds a run with other settings."""
    config = run_dir / _CONFIG
    if not config.exists():
        if (run_dir / "checkpoints").exists() or (run_dir / _RESULTS).exists():
            raise ValueError(
                f"{run_dir} holds files of a run but no {_CONFIG}; move it away or use another --out"
            )
        return "empty"
    wanted = _normalised(header)
    recorded = read_run_config(config)
    check_recorded_settings(recorded, config, "use another --out, or --rerun to replace it")
    difference = header_difference(recorded, with_run_data_keys(wanted, recorded))
    if difference is not None:
        raise ValueError(
            f"{run_dir} holds a run with other settings or data: {difference}; "
            "use another --out, or --rerun to replace it"
        )
    return "finished" if _finished_results(run_dir) is not None else "unfinished"


def _finished_results(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``results.json`` when it is one a finished run writes (a JSON object with an
    ``"evaluation"`` object); None when it is absent or damaged, so the run is resumed and writes it again."""
    try:
        results = json.loads((run_dir / _RESULTS).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict) or not isinstance(results.get("evaluation"), dict):
        return None
    return results


def _check_packages(method: str) -> None:
    """Import a baseline's optional package now, so that a missing one is reported before any training."""
    package = getattr(get_method(method), "package", None)
    if callable(package):
        package()


def _subprocess_runner(spec: RunSpec, arguments: dict[str, Any]) -> None:
    """Train the run by ``comera train`` in a new Python process, which resolves ``arguments`` itself."""
    bar = "--progress" if arguments.get("progress") else "--no-progress"
    command = module_command("comera.cli.commands.train", [*_command_arguments(arguments), bar])
    code = run_child(command)
    if code == INTERRUPTED:  # stopped by a Ctrl-C that reached the run alone: the comparison stops too
        raise KeyboardInterrupt
    if code != 0:
        raise RuntimeError(f"the run exited with status {code} (its messages are above)")


def _in_process_runner(spec: RunSpec, arguments: dict[str, Any]) -> None:
    """Train the run ``spec`` (resolved when the comparison was planned) in this process."""
    run_spec_folder(resumed(spec) if arguments["resume"] else spec)


def _command_arguments(arguments: dict[str, Any]) -> list[str]:
    """``comera train`` arguments of one run (without the program name)."""
    words = [arguments["workload"], "--method", arguments["method"], "--preset", arguments["preset"]]
    for flag in ("data", "config", "cache"):
        if arguments[flag] is not None:
            words += [f"--{flag}", str(arguments[flag])]
    for assignment in arguments["assignments"]:
        words += ["--set", assignment]
    words += ["--out", str(arguments["out"])]
    if arguments["resume"]:
        words.append("--resume")
    return words


def _has_setting(method: str, key: str) -> bool:
    return key in {item.name for item in dataclasses.fields(settings_type(method))}


def method_assignments(methods: Sequence[str], assignments: Sequence[str]) -> dict[str, list[str]]:
    """The ``--set`` assignments each method's run gets: every one outside the ``method`` section, and
    ``method.KEY=...`` only for the methods whose settings have ``KEY``.

    Raises:
        ValueError: a ``method.KEY`` that none of ``methods`` has, naming the methods that have it.
    """
    routed: dict[str, list[str]] = {method: [] for method in methods}
    for assignment in assignments:
        section, key, _ = parse_assignment(assignment)
        if section != "method":
            takers = list(methods)
        else:
            takers = [method for method in methods if _has_setting(method, key)]
            if not takers:
                owners = [name for name in method_names() if _has_setting(name, key)]
                raise ValueError(
                    f"--set method.{key}: none of the compared methods {list(methods)} has this setting"
                    + (f"; it belongs to {owners}" if owners else "")
                )
        for method in takers:
            routed[method].append(assignment)
    return routed


def compare(
    workload: str,
    methods: Sequence[str] = DEFAULT_METHODS,
    *,
    preset: str = "small",
    data: str | Path | None = None,
    config_file: str | Path | None = None,
    assignments: Iterable[str] = (),
    out: str | Path | None = None,
    cache_dir: str | Path | None = None,
    rerun: bool = False,
    fresh_process: bool = True,
    metric: str | None = None,
    log: Callable[[str], None] = print,
    variants: Mapping[str, tuple[str, Sequence[str]]] | None = None,
    progress: bool = False,
) -> list[MethodRun]:
    """Train ``workload`` with each of ``methods`` (and ``variants``) and write the comparison folder.

    Args:
        workload: a registered recipe (``"nli"``, ``"dlrm"``, ``"mlm"``, ``"llm"``).
        methods: registered methods, each at most once, in table order (the dense row, when present, is
            the reference of the ratios).
        preset, data, config_file, assignments, cache_dir: as for :func:`comera.recipes.run.run`, the same
            for every method.
        out: the comparison folder (default ``runs/compare-WORKLOAD-PRESET``).
        rerun: train every method again, replacing finished runs in ``out``.
        fresh_process: run each method in a new Python process (False: in this one).
        metric: the evaluation metric to plot (default: the recipe's primary metric).
        log: where progress lines go.
        variants: more rows, ``{NAME: (METHOD, assignments)}`` (e.g.
            ``{"comera-r32": ("comera", ["tensorize.rank=32"])}``), trained in ``out/NAME``; a name is
            letters, digits, ``.``, ``_`` and ``-``, not a method's name, each once.
        progress: show each run's progress bar (off by default).

    Returns:
        One :class:`MethodRun` per method and variant, in order (``method`` holds the variant's name).

    Raises:
        SetupError: before anything trains, for an unknown workload, method or preset, a bad setting, a
            missing data file, a missing optional package, or a folder holding a run with other settings.
    """
    methods = list(methods)
    out = Path(out) if out is not None else Path("runs") / f"compare-{workload}-{preset}"
    assignments = list(assignments)
    made = missing_folders(out)  # removed again if the comparison stops before anything was written in them
    try:
        recipe = load_recipe(workload)
        if not methods and not variants:
            raise ValueError(f"methods: give at least one of {list(method_names())}")
        repeated = sorted({name for name in methods if methods.count(name) > 1})
        if repeated:
            raise ValueError(f"methods: each method at most once; repeated: {repeated}")
        rows = [(name, name, []) for name in methods] + _checked_variants(variants or {})
        bases = list(dict.fromkeys(base for _, base, _ in rows))
        routed = method_assignments(bases, assignments)
        plans = []
        for name, method, extra in rows:
            own = [*routed[method], *extra]
            run_dir = out / name
            spec = run_spec(
                workload,
                method,
                preset,
                data=data,
                config_file=config_file,
                assignments=own,
                out=run_dir,
                cache_dir=cache_dir,
                progress=progress,
            )
            _check_packages(method)
            replace = rerun and (run_dir / _CONFIG).exists()
            plans.append((name, spec, own, "replace" if replace else _state(run_dir, spec.header())))
        writable_folder(out, "--out")
        if cache_dir is not None:
            writable_folder(Path(cache_dir), "--cache")
    except (ValueError, FileNotFoundError, ImportError) as error:
        remove_empty_folders(made)
        raise SetupError(str(error)) from error
    runner = _subprocess_runner if fresh_process else _in_process_runner
    done: list[MethodRun] = []
    try:
        for name, spec, own, state in plans:
            run_dir = spec.out
            if state == "finished":
                log(f"[compare] {name}: reusing the finished run in {run_dir}")
                done.append(MethodRun(name, run_dir, "reused", _finished_results(run_dir)))
                continue
            if state == "replace":
                shutil.rmtree(run_dir)
            arguments = {
                "workload": workload,
                "method": spec.method,
                "preset": preset,
                "data": data,
                "config": config_file,
                "cache": cache_dir,
                "assignments": own,
                "out": run_dir,
                "resume": state == "unfinished",
                "progress": progress,
            }
            log(f"[compare] {name}: comera train {' '.join(_command_arguments(arguments))}")
            try:
                runner(spec, arguments)
                done.append(MethodRun(name, run_dir, "trained", json.loads((run_dir / _RESULTS).read_text())))
            except (RuntimeError, SetupError, OSError) as error:
                log(f"[compare] {name} failed: {error}")
                done.append(MethodRun(name, run_dir, "failed", error=str(error)))
    except BaseException:  # a Ctrl-C: the folders this call made go again while nothing was written in them
        remove_empty_folders(made)
        raise
    _write_outputs(
        out,
        workload,
        preset,
        recipe.primary_metric,
        recipe.comparison_axes,
        metric,
        done,
        data,
        assignments,
        log,
    )
    return done


def _checked_variants(variants: Mapping[str, tuple[str, Sequence[str]]]) -> list[tuple[str, str, list[str]]]:
    """``(name, method, assignments)`` per variant; ``ValueError`` naming a bad name, method or setting."""
    rows = []
    for name, (method, extra) in variants.items():
        if not _VARIANT_NAME.fullmatch(name) or name in method_names():
            raise ValueError(
                f"variant name {name!r} must be letters, digits, '.', '_' or '-' and not a method's name "
                f"({list(method_names())})"
            )
        get_method(method)
        for assignment in extra:
            parse_assignment(assignment)
        rows.append((name, method, list(extra)))
    return rows


def _first_split(results: dict[str, Any]) -> str | None:
    return next(iter(results["evaluation"]), None)


def _metric_names(runs: list[MethodRun]) -> list[str]:
    names: list[str] = []
    for item in runs:
        if item.results is None:
            continue
        split = _first_split(item.results)
        for name in item.results["evaluation"].get(split, {}) if split else ():
            if name not in names:
                names.append(name)
    return names


def _leading_metric(runs: list[MethodRun], primary: str) -> str:
    """The recipe's primary metric when the runs report it, else their first metric."""
    names = _metric_names(runs)
    return primary if primary in names or not names else names[0]


def format_markdown(runs: Sequence[MethodRun], primary: str) -> str:
    """The comparison table in markdown: one row per method (the columns of docs/recipes.md, 'Comparing
    methods'); ratios against the ``dense`` row if present.
    """
    runs = list(runs)
    names = _metric_names(runs)
    dense = next((item.results for item in runs if item.method == "dense" and item.results), None)
    optional = {key for item in runs for key, _ in _OPTIONAL_COLUMNS if key in (item.results or {})}
    header = ["method", *names]
    if dense is not None and primary in names:
        header.append(f"{primary} vs dense")
    header += [
        "tensorized",
        "whole model",
        "params",
        "step ms",
        "speed vs dense",
        "last fifth",
        *(label for key, label in _OPTIONAL_COLUMNS if key in optional),
        "peak MiB",
        "wall s",
        "note",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for item in runs:
        results = item.results
        if results is None:
            cells = [item.method, *(["-"] * (len(header) - 2)), f"failed: {item.error}"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        evaluation = results["evaluation"].get(_first_split(results) or "", {})
        cells = [item.method, *(number(evaluation.get(name)) for name in names)]
        if dense is not None and primary in names:
            reference = dense["evaluation"].get(_first_split(dense) or "", {}).get(primary)
            value = evaluation.get(primary)
            usable = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (value, reference))
            change = (
                f"{100 * (value - reference) / abs(reference):+.2f}%"
                if item.method != "dense" and usable and reference != 0
                else "-"
            )
            cells.append(change)
        records, metric = _evaluations(item, primary)
        change_at_end = last_fifth_change(records, metric)
        step = results["step_time_s"]
        speed = None if dense is None or not step else dense["step_time_s"] / step
        cells += [
            times(results["compression"]["tensorized"], 1),
            times(results["compression"]["whole"], 2),
            f"{results['params']:,}",
            number(1e3 * step),
            times(speed, 2),
            "-" if change_at_end is None else f"{100 * change_at_end:+.2f}%",
            *(number(results.get(key)) for key, _ in _OPTIONAL_COLUMNS if key in optional),
            number(results["peak_memory_mib"]),
            f"{results['wall_time_s']:.0f}",
            _note(item, plateau_note(records, metric)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _evaluations(item: MethodRun, primary: str) -> tuple[list[dict[str, Any]], str]:
    """The run's metric records (none when unreadable) and the metric its plateau is judged on: the
    validation loss, else the primary metric."""
    try:
        records = read_metrics(item.run_dir)
    except (FileNotFoundError, ValueError):
        return [], primary
    names = {name for record in records if record.get("kind") == "eval" for name in record.get("metrics", {})}
    return records, "loss" if "loss" in names else primary


def _note(item: MethodRun, plateau: str | None) -> str:
    notes = ["reused"] if item.status == "reused" else []
    if plateau is not None:
        notes.append(plateau)
    results = item.results or {}
    if "target_reached" in results:
        notes.append("size target reached" if results["target_reached"] else "size target not reached")
    if results.get("nonfinite_steps"):
        notes.append(f"{results['nonfinite_steps']} non-finite steps skipped")
    return "; ".join(notes)


def _write_outputs(
    out: Path,
    workload: str,
    preset: str,
    primary: str,
    axes: Sequence[str],
    metric: str | None,
    runs: list[MethodRun],
    data: str | Path | None,
    assignments: list[str],
    log: Callable[[str], None],
) -> None:
    from comera.measure import machine_description
    from comera.train.plots import plot_comparison

    out.mkdir(parents=True, exist_ok=True)
    primary = _leading_metric(runs, primary)
    table = format_markdown(runs, primary)
    plotted = metric or primary
    finished = [item for item in runs if item.results is not None]
    tokens_per_step = {
        item.run_dir.name: item.results["tokens_seen"] / item.results["steps"]
        for item in finished
        if item.results.get("tokens_seen") and item.results.get("steps")
    }
    plot_paths: list[tuple[str, Path]] = []
    for axis in axes if finished else ():
        name = f"compare-{plotted}.png" if axis == "step" else f"compare-{plotted}-by-{axis}.png"
        try:
            plot_paths.append(
                (
                    axis,
                    plot_comparison(
                        [item.run_dir for item in finished],
                        plotted,
                        out / name,
                        x=axis,
                        tokens_per_step=tokens_per_step,
                    ),
                )
            )
        except ValueError as error:
            log(f"[compare] no plot against {axis}: {error}")
    machine = machine_description()
    settings = " ".join(f"--set {assignment}" for assignment in assignments)
    data_words = f" --data {data}" if data is not None else ""
    text = [
        f"# comera compare {workload}, preset {preset}",
        "",
        f"Machine: {machine}.",
        "",
        "Each method: `comera train "
        f"{workload} --method METHOD --preset {preset}{data_words}{(' ' + settings) if settings else ''} "
        f"--out {out}/METHOD`, in a fresh process.",
        "",
        table,
        "",
    ]
    for axis, plot_path in plot_paths:
        text += [f"![{plotted} against the {_AXIS_WORDS[axis]}]({plot_path.name})", ""]
    atomic_write_bytes(out / "comparison.md", "\n".join(text).encode())
    record = {
        "workload": workload,
        "preset": preset,
        "data": None if data is None else str(data),
        "assignments": assignments,
        "machine": machine,
        "primary_metric": primary,
        "runs": [
            {
                "method": item.method,
                "run_dir": str(item.run_dir),
                "status": item.status,
                "error": item.error,
                "results": item.results,
            }
            for item in runs
        ],
    }
    atomic_write_bytes(out / "comparison.json", strict_json(record).encode())
    written = ", ".join(str(plot_path) for _, plot_path in plot_paths)
    log(f"[compare] wrote {out / 'comparison.md'}" + (f" and {written}" if written else ""))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``comera compare`` (its flags and their defaults); :func:`main` parses the
    command line with it and checks the workload, methods and settings it names."""
    parser = argparse.ArgumentParser(
        prog="comera compare",
        description="Train one workload with several methods (each in a fresh process) and compare them.",
    )
    parser.add_argument("workload", choices=workload_names(), help="the workload recipe")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        choices=method_names(),
        metavar="METHOD",
        help=f"methods in table order (default: {' '.join(DEFAULT_METHODS)}; choices: "
        f"{', '.join(method_names())})",
    )
    add_setting_arguments(parser, ", for every method")
    parser.add_argument(
        "--out",
        default=None,
        type=run_folder_argument,
        help="comparison folder (default: runs/compare-WORKLOAD-PRESET)",
    )
    parser.add_argument("--rerun", action="store_true", help="train again the methods that already finished")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="show each run's progress bar (default: off)",
    )
    parser.add_argument("--metric", default=None, help="evaluation metric to plot (default: the workload's)")
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar="WORD",
        help="NAME METHOD [SECTION.KEY=VALUE ...]: one more row, METHOD with settings of its own, in "
        "OUT/NAME (repeatable; e.g. --variant comera-r32 comera tensorize.rank=32)",
    )
    return parser


def _variants(parser: argparse.ArgumentParser, words: list[list[str]]) -> dict[str, tuple[str, list[str]]]:
    """``--variant`` words as :func:`compare`'s ``variants``; ``parser.error`` for a short or repeated one."""
    variants: dict[str, tuple[str, list[str]]] = {}
    for name, *rest in words:
        if not rest:
            parser.error(f"--variant {name}: give NAME METHOD [SECTION.KEY=VALUE ...]")
        if name in variants:
            parser.error(f"--variant {name}: each name at most once")
        variants[name] = (rest[0], rest[1:])
    return variants


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera compare``: 0 when every method ran, 1 when one failed, 2 for a bad command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = _variants(parser, args.variant)
    interrupts_raise()  # from here a Ctrl-C is waited out with the running method, then reported below
    try:
        runs = compare(
            args.workload,
            args.methods,
            preset=args.preset,
            data=args.data,
            config_file=args.config,
            assignments=args.assignments,
            out=args.out,
            cache_dir=args.cache,
            rerun=args.rerun,
            progress=args.progress,
            metric=args.metric,
            variants=variants,
        )
    except SetupError as error:
        print(f"comera compare: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "comera compare: interrupted; run the same command again to continue (finished runs are reused, "
            "the interrupted one resumes from its checkpoint)",
            file=sys.stderr,
        )
        return INTERRUPTED
    print()
    print(format_markdown(runs, _leading_metric(runs, load_recipe(args.workload).primary_metric)))
    return 1 if any(item.status == "failed" for item in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
