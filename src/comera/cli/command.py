"""The ``comera`` command: ``demo``, ``prepare``, ``train``, ``compare``, ``frontier``, ``generate``,
``bench``, ``report``, ``plot``; each hands over to its module in :mod:`comera.cli.commands` (``demo`` and
``bench`` in a fresh Python process)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from comera.bench import BENCHMARKS
from comera.cli.child import INTERRUPTED, interrupt_handled, module_command, run_child
from comera.cli.commands.paths import path_argument, run_folder_argument
from comera.cli.startup import interrupts_raise

__all__ = ["main"]


def _run_module(module: str, rest: list[str]) -> int:
    """Run ``python -m module REST`` and return its status; after a Ctrl-C, which it reports itself,
    :data:`~comera.cli.child.INTERRUPTED`."""
    interrupts_raise()  # from here a Ctrl-C is waited out with the child, which reports it
    try:
        return run_child(module_command(module, rest))
    except KeyboardInterrupt:
        return INTERRUPTED


def _report(directory: str) -> int:
    from comera.report import describe_folder

    try:
        text = describe_folder(directory)
    except (FileNotFoundError, ValueError) as error:
        print(f"comera report: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _plot(run_dir: str, out_dir: str | None, compare: list[str], metric: str | None) -> int:
    from comera.recipes.folders import writable_folder
    from comera.train.plots import plot_comparison, plot_run

    try:
        if out_dir is not None:  # the folder of the plots, or of the one --compare figure
            writable_folder(Path(out_dir).parent if compare else Path(out_dir), "--out")
        if compare:
            if metric is None:
                raise ValueError("--compare needs --metric NAME (an evaluation metric, e.g. accuracy)")
            target = (
                Path(out_dir) if out_dir is not None else Path(run_dir) / "plots" / f"compare-{metric}.png"
            )
            paths = [plot_comparison([run_dir, *compare], metric, target)]
        else:
            paths = plot_run(run_dir, out_dir)
    except (OSError, ValueError) as error:  # a missing run, a damaged log, a plot path that cannot be written
        print(f"comera plot: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``comera`` console script (and of ``python -m comera``); a Ctrl-C is reported in one
    line, and a second one while it is ends the command with :data:`~comera.cli.child.INTERRUPTED`, without
    a traceback.
    """
    try:
        return _command(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        interrupt_handled()
        return INTERRUPTED


def _command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="comera", description="comera: tensor-train training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="train the sentence-pair workload dense and with comera, then time both at the paper's size",
        add_help=False,
    )
    sub.add_parser(
        "prepare",
        help="tokenize a corpus once into memory-mapped token shards: comera prepare llm --help",
        add_help=False,
    )
    sub.add_parser("train", help="train a workload: comera train WORKLOAD --help", add_help=False)
    sub.add_parser(
        "compare",
        help="train a workload with several methods and compare them: comera compare --help",
        add_help=False,
    )
    sub.add_parser(
        "frontier",
        help="the memory-perplexity frontier of dense and comera language models: comera frontier --help",
        add_help=False,
    )
    sub.add_parser(
        "generate",
        help="continue a prompt with the model of a language-model run: comera generate --help",
        add_help=False,
    )
    bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", choices=list(BENCHMARKS))
    report = sub.add_parser(
        "report", help="print the compression report of a saved model folder or a training run folder"
    )
    report.add_argument(
        "directory",
        type=run_folder_argument,
        help="a folder written by comera.save_pretrained, or a run folder of comera train",
    )
    plot = sub.add_parser("plot", help="write the PNG plots of a training run")
    plot.add_argument("run_dir", type=run_folder_argument, help="a run folder holding metrics.jsonl")
    plot.add_argument(
        "--out", default=None, type=run_folder_argument, help="output folder (with --compare: the PNG file)"
    )
    plot.add_argument(
        "--compare",
        nargs="+",
        default=[],
        type=path_argument,
        metavar="RUN_DIR",
        help="other runs in one figure",
    )
    plot.add_argument("--metric", default=None, help="with --compare: the evaluation metric to draw")
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print("usage: comera bench NAME [options]   (comera bench NAME --help for a benchmark's options)")
        print(f"benchmarks: {', '.join(BENCHMARKS)}")
        return 0 if len(argv) > 1 else 2
    args, rest = parser.parse_known_args(argv)
    if args.command in ("report", "plot") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "report":
        return _report(args.directory)
    if args.command == "plot":
        interrupts_raise()
        try:
            return _plot(args.run_dir, args.out, args.compare, args.metric)
        except KeyboardInterrupt:
            print("comera plot: interrupted", file=sys.stderr)
            return INTERRUPTED
    if args.command == "prepare":
        from comera.cli.commands.prepare import main as prepare

        return prepare(rest)
    if args.command == "train":
        from comera.cli.commands.train import main as train

        return train(rest)
    if args.command == "compare":
        from comera.cli.commands.compare import main as compare

        return compare(rest)
    if args.command == "frontier":
        from comera.cli.commands.frontier import main as frontier

        return frontier(rest)
    if args.command == "generate":
        from comera.cli.commands.generate import main as generate

        return generate(rest)
    if args.command == "demo":
        return _run_module("comera.cli.commands.demo", rest)
    return _run_module(BENCHMARKS[args.name], rest)
