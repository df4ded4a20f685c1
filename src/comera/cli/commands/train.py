"""``comera train WORKLOAD``: run a recipe from the command line and print where its results are; errors in
the command are one line with exit status 2 before anything trains, a diverged run one line with exit
status 1. Details: docs/recipes.md, 'Errors'.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from comera.cli.child import interrupt_handled
from comera.cli.commands.config_file import config_argument
from comera.cli.commands.numbers import milliseconds, number, times
from comera.cli.commands.paths import path_argument, run_folder_argument
from comera.cli.launch import (
    INTERRUPTED,
    launch,
    launch_interrupted,
    register_worker,
    split_nproc,
    without_option,
    worker_finished,
    worker_status,
)
from comera.cli.startup import interrupts_ignored, interrupts_raise
from comera.methods import method_names
from comera.recipes.run import SetupError, run_spec_folder
from comera.recipes.settings import add_set_argument
from comera.recipes.spec import RunSpec, default_run_dir, run_spec
from comera.train.distributed import world
from comera.train.guard import NonFiniteError
from comera.train.parallel import RankLostError, init_from_environment, shutdown, training_device
from comera.workloads import load_recipe, workload_names

__all__ = ["main", "build_parser", "add_setting_arguments", "summary"]


def summary(results: dict) -> str:
    """A few lines of a ``results.json``: evaluation metrics, compression, step time, memory."""
    lines = [f"{results['recipe']} / {results['method']} / preset {results['preset']}"]
    for split, metrics in results["evaluation"].items():
        shown = ", ".join(f"{name} {number(value)}" for name, value in metrics.items())
        lines.append(f"  {split}: {shown}")
    compression = results["compression"]
    lines.append(
        f"  params {results['params']:,} (dense {results['dense_params']:,}); compression: tensorized layers "
        f"{times(compression['tensorized'])}, whole model {times(compression['whole'])}"
    )
    lines.append(
        f"  step {milliseconds(results['step_time_s'])} ms (median), peak memory "
        f"{number(results['peak_memory_mib'])} MiB, {results['steps']} steps in "
        f"{number(results['wall_time_s'])} s"
    )
    skipped = _skipped_data(results.get("data", {}))
    if skipped:
        lines.append(f"  data skipped: {'; '.join(skipped)} (counts under data in results.json)")
    if "earlier_run" in results:
        lines.append(f"  the files of the run it replaced: {results['earlier_run']}")
    return "\n".join(lines)


def _skipped_data(data: object, where: str = "") -> list[str]:
    """``"<where>: <n> <reason>, ..."`` for every block of ``data`` (a ``results.json`` data section, nested
    dicts) that counts skipped inputs: ``skipped`` with its ``skipped_<reason>`` counts, or
    ``lines_skipped``; empty when nothing was skipped."""
    if not isinstance(data, dict):
        return []
    found = []
    label = where or "data"
    if isinstance(data.get("skipped"), int) and data["skipped"] > 0:
        reasons = [
            f"{count} {key.removeprefix('skipped_').replace('_', ' ')}"
            for key, count in data.items()
            if key.startswith("skipped_") and isinstance(count, int) and count > 0
        ]
        found.append(f"{label}: {', '.join(reasons) or data['skipped']}")
    if isinstance(data.get("lines_skipped"), int) and data["lines_skipped"] > 0:
        found.append(f"{label}: {data['lines_skipped']} malformed lines")
    for key, value in data.items():
        if isinstance(value, dict):
            found += _skipped_data(value, key)
    return found


def add_setting_arguments(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--preset``, ``--data``, ``--config``, ``--set`` and ``--cache``, as ``comera train`` and
    ``comera compare`` take them (``scope`` ends their help, e.g. ``", for every method"``)."""
    parser.add_argument("--preset", default="small", help="model/data size preset: paper, small, smoke")
    parser.add_argument(
        "--data", default=None, type=path_argument, help="data file or folder (default: the embedded data)"
    )
    parser.add_argument(
        "--config",
        default=None,
        type=config_argument,
        help=f"TOML file of settings ([model], [train], ...){scope}",
    )
    add_set_argument(parser, f"override one setting{scope}, e.g. train.batch_size=16 (repeatable)")
    parser.add_argument(
        "--device",
        action=_DeviceSetting,
        metavar="DEVICE",
        help=f"train on cpu, cuda (under torchrun: GPU LOCAL_RANK) or cuda:N{scope}; the same as --set "
        "train.device=DEVICE (default: cpu)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        type=path_argument,
        help="cache folder (default: $COMERA_CACHE or ~/.cache/comera)",
    )


class _DeviceSetting(argparse.Action):
    """``--device D``: the assignment ``train.device=D`` added to ``--set``'s list."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.assignments = [*(namespace.assignments or []), f"train.device={values}"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``comera train`` (its flags and their defaults); :func:`main` parses the
    command line with it and checks what no parser can (the run folder, the settings)."""
    parser = argparse.ArgumentParser(
        prog="comera train",
        description="Train a workload (dense or compressed) and write a run folder with results.json.",
    )
    parser.add_argument("workload", choices=workload_names(), help="the workload recipe")
    parser.add_argument("--method", default="comera", choices=method_names(), help="training method")
    add_setting_arguments(parser)
    parser.add_argument(
        "--out",
        default=None,
        type=run_folder_argument,
        help="run folder (default: runs/WORKLOAD-PRESET-METHOD)",
    )
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest readable checkpoint (step 0 without one)",
    )
    again.add_argument(
        "--restart",
        action="store_true",
        help="move the files of the run in --out to OUT.old-N and train it again from step 0",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="train in N processes on this machine (runs: torchrun --standalone --nproc-per-node N "
        "-m comera train ...); train.batch_size is the global batch (read before the other options)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera train``."""
    try:
        nproc, argv = split_nproc(list(sys.argv[1:] if argv is None else argv))
    except ValueError as error:
        print(f"comera train: {error}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    presets = load_recipe(args.workload).presets
    if args.preset not in presets:
        presets = sorted(presets)
        print(f"comera train: unknown --preset {args.preset!r}; choose one of {presets}", file=sys.stderr)
        return 2
    if nproc is not None:  # the processes read --config from its copy (a stream can be read only once)
        config = [] if args.config is None else ["--config", args.config]
        interrupts_raise()  # the launcher passes a Ctrl-C on to the processes and waits for them
        return launch(nproc, ["train", *without_option(argv, "--config"), *config])
    out = args.out or default_run_dir(args.workload, args.preset, args.method)
    interrupts_raise()  # from here a Ctrl-C stops the run in its own way (below), also as a --nproc worker
    register_worker()
    logging.getLogger(_DYNAMO_PROFILER_LOGGER).addFilter(_drop_profiler_notes)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        warnings.filterwarnings("ignore", message=_DDP_STRIDE_WARNING)
        try:
            return worker_status(_train(args, out))
        except KeyboardInterrupt:
            with interrupts_ignored():
                interrupt_handled()
                if os.environ.get("RANK", "0") == "0":  # the process group may be gone by now
                    started = (Path(out) / "config.json").is_file()
                    print(
                        f"comera train: interrupted; continue the run with --resume (run folder: {out})"
                        if started
                        else "comera train: interrupted before the run started, so there is nothing to "
                        "resume; run the same command again",
                        file=sys.stderr,
                    )
                return worker_status(INTERRUPTED)


_DDP_STRIDE_WARNING = "Grad strides do not match bucket view strides"
"""DDP's warning for a gradient laid out unlike its bucket: a tensor-train core with a boundary rank of 1
gets a gradient whose stride differs only along that size-1 dimension (the same memory order), which
DDP copies as fast; the warning, printed by every process at each start, says nothing to act on."""


_DYNAMO_PROFILER_LOGGER = "torch._dynamo.variables.ctx_manager"


def _drop_profiler_notes(record: logging.LogRecord) -> bool:
    """Drop torch.compile's note that a profiler annotation is ignored inside the compiled step: DDP's
    forward carries one, so every process of a ``--nproc`` run with a compiled step printed it, and it says
    nothing to act on (the run is not being profiled)."""
    return not record.getMessage().startswith("Profiler record function")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """One line per warning, on rank 0 alone under ``torchrun`` (every process meets the same ones)."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"comera train: warning: {message}", file=sys.stderr if file is None else file)


def _spec(args: argparse.Namespace, out: str | Path) -> RunSpec | SetupError:
    """The run the command line names, resolved once (:func:`comera.recipes.spec.run_spec`), or the
    :class:`SetupError` saying why it cannot start."""
    try:
        return run_spec(
            args.workload,
            args.method,
            args.preset,
            data=args.data,
            config_file=args.config,
            assignments=args.assignments,
            out=out,
            resume=args.resume,
            restart=args.restart,
            cache_dir=args.cache,
            progress=args.progress,
        )
    except (ValueError, FileNotFoundError, TypeError) as error:
        return SetupError(str(error))


def _run_device(spec: RunSpec | SetupError) -> torch.device:
    """The device the run's settings name (``train.device``), for the process group's backend; the CPU when
    they name none, or when they cannot be read or name a device this machine lacks (the run then reports
    what is wrong)."""
    if isinstance(spec, SetupError) or spec.train.device is None:
        return torch.device("cpu")
    try:
        return training_device(spec.train.device)
    except ValueError:
        return torch.device("cpu")


def _train(args: argparse.Namespace, out) -> int:
    """Train in this process, or as one rank of a ``torchrun`` job (only rank 0 prints). The process group's
    backend is the one for the run's device (``train.device``): nccl for a GPU, gloo for the CPU."""
    spec = _spec(args, out)
    init_from_environment(_run_device(spec))
    every_rank_answers = False
    try:
        code = _train_here(spec, out, world()[0] == 0)
        every_rank_answers = True
        worker_finished()
        return code
    except RankLostError as error:
        if launch_interrupted():  # another process got the Ctrl-C first and stopped
            raise KeyboardInterrupt from None
        print(f"comera train: {error}", file=sys.stderr)
        return 1
    finally:
        shutdown(wait=every_rank_answers)


def _train_here(spec: RunSpec | SetupError, out, speaks: bool) -> int:
    try:
        if isinstance(spec, SetupError):
            raise spec
        results = run_spec_folder(spec)
    except SetupError as error:
        if speaks:
            print(f"comera train: {error}", file=sys.stderr)
        return 2
    except NonFiniteError as error:
        if speaks:
            print(f"comera train: training diverged: {error}; run folder: {out}", file=sys.stderr)
        return 1
    if not speaks:
        return 0
    print(summary(results))
    print(f"run folder: {out} ({', '.join(_written(out))})")
    return 0


def _written(out: str | Path) -> list[str]:
    """The outputs of a finished run that exist in its folder (``plots/`` is absent with plotting off)."""
    names = ("results.json", "metrics.jsonl", "plots/", "model/")
    return [name for name in names if (Path(out) / name.rstrip("/")).exists()]


if __name__ == "__main__":
    raise SystemExit(main())
