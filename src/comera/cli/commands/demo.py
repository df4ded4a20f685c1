"""``comera demo``: the sentence-pair workload trained dense and with CoMERA, side by side, at two sizes.
Accuracy comes from ``comera compare nli`` at ``--preset small``, step time and training memory from the
paper's model, in one table. Details: docs/guide.md, 'What make demo does'.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from comera.bench.paper import run_fresh_case
from comera.cli.child import INTERRUPTED
from comera.cli.commands.compare import compare
from comera.cli.commands.paths import run_folder_argument
from comera.cli.startup import interrupts_raise
from comera.recipes.run import SetupError, default_cache_dir
from comera.recipes.settings import add_set_argument
from comera.workloads import load_recipe

__all__ = ["main", "parse_arguments", "format_table", "SpeedSettings", "run_speed"]

METHODS = ("dense", "comera")
WORKLOAD = "nli"
LEAST = {"speed_batch": 1, "speed_steps": 5, "speed_warmup": 1}
"""The smallest value of each speed flag (the step timer of ``comera bench paper`` needs >= 5 timed steps
and >= 1 warm-up step)."""


@dataclass(frozen=True)
class SpeedSettings:
    """How the speed comparison runs: the ``preset`` of the workload, the ``batch`` size, the timed
    ``steps`` and the untimed ``warmup`` steps before them."""

    preset: str
    batch: int
    steps: int
    warmup: int

    def describe(self) -> str:
        """One line: model size, batch, steps."""
        return (
            f"preset {self.preset} ({_model_size(_preset_model(self.preset))}), batch {self.batch}, "
            f"median of {self.steps} timed steps after {self.warmup + 2} untimed"
        )


def _preset_model(preset: str) -> dict[str, Any]:
    return dict(load_recipe(WORKLOAD).presets[preset]["model"])


def _model_size(model: Mapping[str, Any]) -> str:
    return f"width {model['d_model']}, {model['n_layers']} blocks"


def run_speed(settings: SpeedSettings, cache_dir: Path) -> dict[str, dict[str, Any]]:
    """Step time and training memory of the dense and the comera model (method -> the case's result, with
    ``error`` when it failed), each in a fresh process (:func:`comera.bench.paper.run_fresh_case`)."""
    return {
        method: run_fresh_case(
            WORKLOAD,
            settings.preset,
            method,
            settings.batch,
            repeats=settings.steps,
            warmup=settings.warmup,
            cache_dir=cache_dir,
        )
        for method in METHODS
    }


def _times(dense: float, comera: float, more: str, less: str) -> str:
    """How many times ``comera`` is ``less`` than ``dense`` (``more`` when it is larger)."""
    if dense <= 0 or comera <= 0:
        return "-"
    return f"{dense / comera:.1f}x {less}" if dense >= comera else f"{comera / dense:.1f}x {more}"


def _compression(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def _accuracy_rows(results: Mapping[str, dict]) -> list[tuple[str, ...]]:
    dense, comera = results["dense"], results["comera"]
    split = next(iter(dense["evaluation"]))
    accuracy = [r["evaluation"][split]["accuracy"] for r in (dense, comera)]
    return [
        (f"  accuracy ({split})", *(f"{value:.3f}" for value in accuracy), _points(*accuracy)),
        (
            "  parameters",
            f"{dense['params']:,}",
            f"{comera['params']:,}",
            _times(dense["params"], comera["params"], "more", "fewer"),
        ),
        (
            "  compression, tensorized layers",
            _compression(dense["compression"]["tensorized"]),
            _compression(comera["compression"]["tensorized"]),
            "",
        ),
    ]


def _points(dense: float, comera: float) -> str:
    return f"{100 * (comera - dense):+.1f} points"


def _speed_rows(speed: Mapping[str, dict]) -> list[tuple[str, ...]]:
    dense, comera = speed["dense"], speed["comera"]
    failed = [f"{method} failed: {' '.join(r['error'])}" for method, r in speed.items() if "error" in r]
    if failed:
        return [("  not measured", "-", "-", "; ".join(failed))]
    return [
        (
            "  parameters",
            f"{dense['params']:,}",
            f"{comera['params']:,}",
            _times(dense["params"], comera["params"], "more", "fewer"),
        ),
        (
            "  step time (ms, median)",
            f"{dense['ms']:.0f}",
            f"{comera['ms']:.0f}",
            _times(dense["ms"], comera["ms"], "slower", "faster"),
        ),
        (
            "  training memory (MiB)",
            f"{dense['training_mib']:.0f}",
            f"{comera['training_mib']:.0f}",
            _times(dense["training_mib"], comera["training_mib"], "more", "less"),
        ),
        ("    kept between steps", f"{dense['state_mib']:.0f}", f"{comera['state_mib']:.0f}", ""),
        ("    rise during a step", f"{dense['train_mib']:.0f}", f"{comera['train_mib']:.0f}", ""),
    ]


def format_table(
    results: Mapping[str, dict],
    accuracy_size: str,
    speed: Mapping[str, dict] | None = None,
    speed_size: str = "",
) -> str:
    """The demo's table: columns dense, comera and comera against dense.

    Args:
        results: method -> ``results.json`` of its accuracy run (``"dense"`` and ``"comera"``).
        accuracy_size: the title of the accuracy rows (preset and model size).
        speed: method -> its case of :func:`run_speed`, or None to leave the speed rows out.
        speed_size: the title of the speed rows.
    """
    rows: list[tuple[str, ...]] = [("", "dense", "comera", "comera vs dense")]
    rows += [(f"{accuracy_size}, trained:",), *_accuracy_rows(results)]
    if speed is not None:
        rows += [(f"{speed_size}:",), *_speed_rows(speed)]
    cells = [row for row in rows if len(row) == 4]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = []
    for row in rows:
        if len(row) == 1:
            lines.append(row[0])
            continue
        label, dense, comera, versus = row
        lines.append(
            "  ".join(
                [label.ljust(widths[0]), dense.rjust(widths[1]), comera.rjust(widths[2]), versus]
            ).rstrip()
        )
        if row is rows[0]:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _data_line(results: dict) -> str:
    info = results["data"]
    splits = info.get("splits", {})
    counts = ", ".join(f"{name} {values.get('read', '?')}" for name, values in splits.items())
    majority = info.get("majority_accuracy")
    text = f"data: {info.get('source', 'embedded task')} ({counts})"
    if majority is not None:
        text += f"; majority-class accuracy {majority:.3f}"
    return text


def _note(accuracy_preset: str, speed_preset: str) -> str:
    """The lines under the table: which size each part is measured at, and what training memory is."""
    return (
        f"Accuracy and compression are measured at preset {accuracy_preset}, step time and memory at preset "
        f"{speed_preset}\n(the step of `comera bench paper`'s transformer section: one fixed batch, each "
        "method in a fresh process).\nTraining memory = what training keeps between steps (parameters, "
        "gradients, optimizer state)\n+ the resident set's rise during one step (activations, temporaries).\n"
    )


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The flags of ``comera demo`` in ``argv`` (None: the command line) as a namespace, every default
    filled in: ``speed_preset`` follows ``preset`` (smoke for smoke, else paper) unless given; a count
    below its least value (``LEAST``) exits through ``argparse`` naming the flag."""
    parser = argparse.ArgumentParser(prog="comera demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default="runs/demo", type=run_folder_argument, help="folder of the runs (default: runs/demo)"
    )
    parser.add_argument("--preset", default="small", help="preset of the accuracy runs (default: small)")
    add_set_argument(parser, "override one setting of the accuracy runs (repeatable)")
    parser.add_argument("--no-speed", action="store_true", help="leave out the speed and memory comparison")
    parser.add_argument(
        "--speed-preset",
        default=None,
        help="preset of the speed comparison (default: paper; smoke with --preset smoke)",
    )
    parser.add_argument("--speed-batch", type=int, default=32, help="batch of the speed comparison (32)")
    parser.add_argument("--speed-steps", type=int, default=7, help="timed steps per method (>= 5; 7)")
    parser.add_argument("--speed-warmup", type=int, default=1, help="untimed steps first (>= 1; 1)")
    args = parser.parse_args(argv)
    for name, least in LEAST.items():
        if getattr(args, name) < least:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be >= {least}, got {getattr(args, name)}")
    if args.speed_preset is None:
        args.speed_preset = "smoke" if args.preset == "smoke" else "paper"
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera demo``."""
    args = parse_arguments(argv)
    out = Path(args.out)
    presets = load_recipe(WORKLOAD).presets
    if not args.no_speed and args.speed_preset not in presets:
        choices = sorted(presets)
        print(
            f"comera demo: --speed-preset: unknown preset {args.speed_preset!r}; choose one of {choices}",
            file=sys.stderr,
        )
        return 2
    interrupts_raise()  # from here a Ctrl-C is waited out with the running child, then reported below
    try:
        return _demo(args, out)
    except SetupError as error:
        print(f"comera demo: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"comera demo: interrupted; run it again to start over (its folder: {out})", file=sys.stderr)
        return INTERRUPTED


def _demo(args: argparse.Namespace, out: Path) -> int:
    """The accuracy runs, the speed comparison and the table; the exit status."""
    runs = compare(WORKLOAD, METHODS, preset=args.preset, assignments=args.assignments, out=out, rerun=True)
    failed = [item for item in runs if item.results is None]
    if failed:
        raise SystemExit(f"comera demo: the {failed[0].method} run failed: {failed[0].error}")
    results = {item.method: item.results for item in runs}
    model = json.loads((runs[0].run_dir / "config.json").read_text())["settings"]["model"]
    accuracy_size = f"preset {args.preset} ({_model_size(model)})"
    speed, settings = None, None
    if not args.no_speed:
        settings = SpeedSettings(args.speed_preset, args.speed_batch, args.speed_steps, args.speed_warmup)
        print(f"\n[speed] dense and comera, {settings.describe()}, each in a fresh process", flush=True)
        speed = run_speed(settings, default_cache_dir())
        record = {"settings": asdict(settings), "cases": speed}
        (out / "speed.json").write_text(json.dumps(record, indent=2) + "\n")
    print()
    print(f"comera demo: sentence pairs; {_data_line(results['dense'])}")
    print(format_table(results, accuracy_size, speed, settings.describe() if settings else ""))
    print()
    if settings is not None:
        print(_note(args.preset, settings.preset))
    for method in METHODS:
        plots = out / method / "plots"
        print(f"{method}: {out / method}/results.json" + (f", plots in {plots}/" if plots.is_dir() else ""))
    print(f"both: {out}/comparison.md, {out}/compare-accuracy.png")
    if settings is not None:
        print(f"speed and memory: {out}/speed.json")
    return 1 if speed is not None and any("error" in case for case in speed.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
