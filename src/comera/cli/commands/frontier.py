"""``comera frontier llm``: the memory-perplexity frontier of dense and comera language models (a sweep of
widths, configurations and learning rates, the best points again with more seeds, and iso-parameter and
iso-memory dense controls), written as ``OUT/frontier.md`` and two plots. Details: docs/llm.md, 'The
model's shape, the spectral rule and the frontier'.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from comera.cli.child import INTERRUPTED
from comera.cli.commands.compare import MethodRun, compare
from comera.cli.commands.frontier_report import write_frontier
from comera.cli.commands.paths import run_folder_argument
from comera.cli.commands.train import add_setting_arguments
from comera.cli.startup import interrupts_raise
from comera.recipes.run import SetupError
from comera.recipes.spec import run_spec
from comera.workloads import load_recipe

__all__ = ["FrontierPoint", "dense_width_settings", "non_embedding_parameters", "frontier", "main"]

_EMBEDDING_PREFIXES = ("embed.", "lm_head.")


@dataclass
class FrontierPoint:
    """One configuration of the frontier, pooled over its seeds.

    Attributes:
        name: its label (``dense-w96-lr1``, ``comera-lr0.5``, ``iso-params-w64``).
        method: ``dense`` or ``comera``.
        role: ``sweep``, ``iso-params``, ``iso-memory`` or ``iso-params+iso-memory`` (one model is both:
            point ``iso-both-wW``).
        assignments: its own ``SECTION.KEY=VALUE`` settings (without the seed).
        runs: its runs, one per seed (seed 0 first).
    """

    name: str
    method: str
    role: str
    assignments: list[str]
    runs: list[MethodRun] = field(default_factory=list)

    def values(self, key: str) -> list[float]:
        """``key`` of every finished run's ``results.json`` (finite values only)."""
        found = [run.results.get(key) for run in self.runs if run.results is not None]
        return [float(value) for value in found if isinstance(value, (int, float)) and math.isfinite(value)]

    def mean(self, key: str) -> float:
        """Mean of :meth:`values` (NaN without one)."""
        values = self.values(key)
        return statistics.fmean(values) if values else math.nan


def dense_width_settings(width: int, model: dict[str, Any]) -> list[str]:
    """``model.*`` assignments of a dense model of ``width``: the preset's depth and heads, its MLP width
    scaled by ``width / hidden_size`` (rounded to an even number); ``ValueError`` naming ``--dense-widths``
    when the heads do not split ``width`` into even head sizes."""
    heads = model["n_heads"]
    if isinstance(width, bool) or not isinstance(width, int) or width < 2 * heads or width % (2 * heads):
        raise ValueError(
            f"--dense-widths: {width!r} must be a multiple of 2 x n_heads ({2 * heads}): the heads split the "
            "width into even head sizes"
        )
    inner = 2 * max(1, round(model["intermediate_size"] * width / model["hidden_size"] / 2))
    return [f"model.hidden_size={width}", f"model.intermediate_size={inner}"]


def non_embedding_parameters(run_dir: Path) -> int:
    """Parameters of a finished run's saved model outside the token embedding and the LM head (read from the
    shapes in ``model/model.safetensors``, at the model's end state)."""
    from safetensors import safe_open

    with safe_open(str(run_dir / "model" / "model.safetensors"), "pt") as saved:
        return sum(
            math.prod(saved.get_slice(name).get_shape())
            for name in saved.keys()  # noqa: SIM118 (a safetensors handle is not a dict)
            if not name.startswith(_EMBEDDING_PREFIXES)
        )


def _dense_counts(width: int, model: dict[str, Any], vocab_size: int) -> tuple[int, int]:
    """(non-embedding, whole-model) parameters of the dense LLaMA of ``width`` (built on the meta device)."""
    from comera.workloads.llm.model import LlamaLM

    inner = int(dense_width_settings(width, model)[1].split("=")[1])
    with torch.device("meta"):
        dense = LlamaLM.from_preset(
            model["preset"],
            vocab_size=vocab_size,
            hidden_size=width,
            n_layers=model["n_layers"],
            n_heads=model["n_heads"],
            intermediate_size=inner,
            tie_embeddings=model["tie_embeddings"],
        )
    counted = {id(p): (name, p.numel()) for name, p in dense.named_parameters()}
    whole = sum(numel for _, numel in counted.values())
    inside = sum(numel for name, numel in counted.values() if not name.startswith(_EMBEDDING_PREFIXES))
    return inside, whole


def _matching_width(target: float, model: dict[str, Any], vocab_size: int, index: int) -> int:
    """The width (a multiple of 2 x n_heads) whose dense model's count ``index`` (0 non-embedding, 1 whole)
    is nearest ``target``."""
    step = 2 * model["n_heads"]
    widths = range(step, 64 * step + 1, step)
    return min(widths, key=lambda width: abs(_dense_counts(width, model, vocab_size)[index] - target))


def _factor_label(factor: float) -> str:
    return f"{factor:g}"


def _sweep_points(
    widths: Sequence[int],
    configurations: dict[str, list[str]],
    factors: Sequence[float],
    model: dict[str, Any],
    rates: dict[str, float],
) -> list[FrontierPoint]:
    points = []
    for width in widths:
        sizes = dense_width_settings(width, model)
        for factor in factors:
            rate = f"train.lr_other={rates['dense'] * factor:g}"
            name = f"dense-w{width}-lr{_factor_label(factor)}"
            points.append(FrontierPoint(name, "dense", "sweep", [*sizes, rate]))
    for name, own in configurations.items():
        for factor in factors:
            rate = f"method.lr_cores={rates['comera'] * factor:g}"
            points.append(FrontierPoint(f"{name}-lr{_factor_label(factor)}", "comera", "sweep", [*own, rate]))
    return points


def _train(
    points: Sequence[FrontierPoint],
    seeds: Sequence[int],
    common: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """Train every point at every seed (reusing finished runs) and attach the runs to their points."""
    variants = {
        _run_name(point.name, seed): (point.method, [*point.assignments, f"train.seed={seed}"])
        for point in points
        for seed in seeds
    }
    done = compare(common["workload"], [], variants=variants, log=log, **common["options"])
    by_name = {run.method: run for run in done}
    for run in done:
        if run.results is not None:
            run.results["non_embedding_params"] = non_embedding_parameters(run.run_dir)
    for point in points:
        point.runs = [
            by_name[name] for name in (_run_name(point.name, seed) for seed in seeds) if name in by_name
        ]


def _run_name(point: str, seed: int) -> str:
    return point if seed == 0 else f"{point}-seed{seed}"


def _best(points: Sequence[FrontierPoint], prefix: str) -> FrontierPoint | None:
    """The point named ``prefix-lr...`` with the lowest mean perplexity (None when none finished)."""
    group = [p for p in points if p.name.startswith(f"{prefix}-lr") and p.values("perplexity")]
    return min(group, key=lambda p: p.mean("perplexity")) if group else None


def frontier(
    *,
    preset: str = "small",
    dense_widths: Sequence[int] = (64, 96, 128, 192),
    configurations: dict[str, list[str]] | None = None,
    lr_factors: Sequence[float] = (0.5, 1.0, 2.0),
    seeds: Sequence[int] = (0, 1),
    data: str | Path | None = None,
    config_file: str | Path | None = None,
    assignments: Sequence[str] = (),
    out: str | Path | None = None,
    cache_dir: str | Path | None = None,
    fresh_process: bool = True,
    log: Callable[[str], None] = print,
) -> list[FrontierPoint]:
    """Run the frontier and write ``OUT/frontier.md`` and its two plots.

    Args:
        preset: the llm preset every point trains with.
        dense_widths: the dense models' widths (multiples of 2 x the preset's heads).
        configurations: comera configurations ``{NAME: [SECTION.KEY=VALUE, ...]}`` (default
            ``{"comera": []}``, the preset's).
        lr_factors: peak learning rates as factors of the preset's (each > 0).
        seeds: the seeds of the best points and the controls (the sweep runs the first); starts with 0.
        data, config_file, assignments, cache_dir: as ``comera compare``'s, for every point.
        out: the frontier folder (default ``runs/frontier-llm-PRESET``); every run in ``OUT/NAME``.
        fresh_process: train each run in a fresh process (False: in this one, for tests).
        log: where progress lines go.

    Returns:
        The points, sweep first, then the controls.

    Raises:
        SetupError: a bad width, factor, seed or setting, before anything trains.
    """
    configurations = {"comera": []} if configurations is None else dict(configurations)
    out = Path(out) if out is not None else Path("runs") / f"frontier-llm-{preset}"
    try:
        if not lr_factors or any(isinstance(f, bool) or not f > 0 for f in lr_factors):
            raise ValueError(f"--lr-factors must be numbers > 0, got {list(lr_factors)}")
        if not seeds or seeds[0] != 0 or len(set(seeds)) != len(seeds):
            raise ValueError(f"--seeds must start with 0 and name each seed once, got {list(seeds)}")
        load_recipe("llm")
        base = run_spec("llm", "dense", preset, data=data, config_file=config_file, assignments=assignments)
        model = base.settings["model"]
        own = run_spec("llm", "comera", preset, data=data, config_file=config_file, assignments=assignments)
        rates = {"dense": base.train.lr_other, "comera": own.method_settings.lr_cores}
        points = _sweep_points(dense_widths, configurations, lr_factors, model, rates)
    except ValueError as error:
        raise SetupError(str(error)) from error
    common = {
        "workload": "llm",
        "options": {
            "preset": preset,
            "data": data,
            "config_file": config_file,
            "assignments": list(assignments),
            "out": out,
            "cache_dir": cache_dir,
            "fresh_process": fresh_process,
        },
    }
    _train(points, seeds[:1], common, log)
    headline = [p for p in (_best(points, f"dense-w{w}") for w in dense_widths) if p is not None]
    headline += [p for p in (_best(points, name) for name in configurations) if p is not None]
    if len(seeds) > 1:
        _train(headline, seeds, common, log)
    controls = _controls(points, configurations, dense_widths, model, rates, log)
    if controls:
        _train(controls, seeds, common, log)
    everything = points + controls
    _write_report(out, preset, everything, log)
    return everything


def _controls(
    points: list[FrontierPoint],
    configurations: dict[str, list[str]],
    dense_widths: Sequence[int],
    model: dict[str, Any],
    rates: dict[str, float],
    log: Callable[[str], None],
) -> list[FrontierPoint]:
    """The iso-parameter and iso-memory dense controls of the best comera configuration."""
    best = [p for p in (_best(points, name) for name in configurations) if p is not None]
    if not best:
        log("[frontier] no comera point finished: no control to train")
        return []
    chosen = min(best, key=lambda p: p.mean("perplexity"))
    finished = next(run for run in chosen.runs if run.results is not None)
    vocab = finished.results["data"]["vocab_size"]
    inside, whole = non_embedding_parameters(finished.run_dir), finished.results["params"]
    controls: list[FrontierPoint] = []
    for role, target, index in (("iso-params", inside, 0), ("iso-memory", whole, 1)):
        width = _matching_width(target, model, vocab, index)
        same = next((point for point in controls if point.name.endswith(f"-w{width}")), None)
        if same is not None:  # both controls are one model: train it once
            same.role, same.name = f"{same.role}+{role}", f"iso-both-w{width}"
            continue
        nearest = min(dense_widths, key=lambda w: abs(w - width))
        dense = _best(points, f"dense-w{nearest}")
        factor = 1.0 if dense is None else float(dense.name.rsplit("-lr", 1)[1])
        rate = f"train.lr_other={rates['dense'] * factor:g}"
        counted = "non-embedding" if index == 0 else "whole-model"
        log(f"[frontier] {role}: width {width} for {chosen.name}'s {target:,} {counted} parameters")
        sizes = dense_width_settings(width, model)
        controls.append(FrontierPoint(f"{role}-w{width}", "dense", role, [*sizes, rate]))
    return controls


def _write_report(
    out: Path, preset: str, points: Sequence[FrontierPoint], log: Callable[[str], None]
) -> None:
    from comera.measure import machine_description

    header = "\n".join(
        [
            f"# comera frontier llm, preset {preset}",
            "",
            f"Machine: {machine_description()}. Every run in a fresh process on the same tokens; perplexity "
            "on the validation split; seeds pooled as mean ± sample std (n runs).",
        ]
    )
    write_frontier(out, header, points, log)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comera frontier",
        description="The memory-perplexity frontier of dense and comera language models: a learning-rate "
        "sweep of dense widths and comera configurations, seeds at the best points, the iso-parameter and "
        "iso-memory dense controls, one table and two plots.",
    )
    parser.add_argument("workload", choices=["llm"], help="the workload (the language model)")
    add_setting_arguments(parser, ", for every point")
    parser.add_argument(
        "--dense-widths",
        nargs="+",
        type=int,
        default=[64, 96, 128, 192],
        metavar="WIDTH",
        help="dense widths",
    )
    parser.add_argument(
        "--comera",
        nargs="+",
        action="append",
        default=[],
        metavar="WORD",
        help="NAME [SECTION.KEY=VALUE ...]: a comera configuration (repeatable; default: the preset's)",
    )
    parser.add_argument(
        "--lr-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0], help="peak rates x the preset's"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds of the headline points")
    parser.add_argument(
        "--out",
        default=None,
        type=run_folder_argument,
        help="frontier folder (default: runs/frontier-llm-PRESET)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera frontier``: 0 when every run finished, 1 when one failed, 2 for a bad
    command."""
    parser = _parser()
    args = parser.parse_args(argv)
    configurations: dict[str, list[str]] = {}
    for name, *assignments in args.comera:
        if name in configurations:
            parser.error(f"--comera {name}: each name at most once")
        configurations[name] = assignments
    interrupts_raise()
    try:
        points = frontier(
            preset=args.preset,
            dense_widths=args.dense_widths,
            configurations=configurations or None,
            lr_factors=args.lr_factors,
            seeds=args.seeds,
            data=args.data,
            config_file=args.config,
            assignments=args.assignments,
            out=args.out,
            cache_dir=args.cache,
        )
    except SetupError as error:
        print(f"comera frontier: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("comera frontier: interrupted; run the same command again to continue", file=sys.stderr)
        return INTERRUPTED
    return 1 if any(run.results is None for point in points for run in point.runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
