"""Run a recipe with a method and write the run folder; ``comera train WORKLOAD`` calls :func:`run`.

The run folder::

    config.json        recipe, method, preset, data path and the resolved settings
    metrics.jsonl      train / eval / event records (comera.train.metrics)
    plots/*.png        loss and evaluation, size ratio, ranks (rank-adaptive runs)
    checkpoints/       the Trainer's checkpoints (resume with resume=True / --resume)
    model/             the trained model (comera.save_pretrained)
    report.txt         comera.compression_report of the trained model
    results.json       the run's results (keys below)

``results.json``: ``recipe``, ``method``, ``preset``; ``evaluation`` (split -> the recipe's metrics);
``data`` (split -> examples ``read`` and ``skipped``, plus the recipe's facts); ``params`` (trained
entries), ``dense_params`` (the untensorized model's), ``compression`` (``tensorized``: dense / compressed
entries of the tensorized layers, ``whole``: of the whole model); ``step_time_s`` (median seconds per
training step after the first logged window), ``peak_memory_mib`` (peak resident memory of the process, or
CUDA allocator peak), ``wall_time_s``, ``steps``, ``stage``, ``size_ratio`` and, for CoMERA,
``target_reached``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from comera.atomic import atomic_write_bytes
from comera.io import save_pretrained
from comera.methods import Method, MethodContext, get_method
from comera.recipes.base import Recipe, RecipeData, get_recipe
from comera.recipes.folders import writable_folder
from comera.recipes.settings import resolve_settings, tensorize_config
from comera.report import compression_report
from comera.train.config import TrainConfig
from comera.train.evaluation import run_evaluation
from comera.train.metrics import read_metrics
from comera.train.trainer import Trainer
from comera.version import __version__

__all__ = ["run", "run_header", "read_run_config", "SetupError", "default_cache_dir", "default_run_dir"]


class SetupError(ValueError):
    """A run could not start: bad settings, a missing or malformed data file, a run folder in the way.
    Raised before any training step; the message names the setting, file or folder."""


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def default_cache_dir() -> Path:
    """``$COMERA_CACHE``, else ``~/.cache/comera``: vocabularies and binary data caches kept between runs."""
    return Path(os.environ.get("COMERA_CACHE") or Path.home() / ".cache" / "comera")


def default_run_dir(recipe: str, preset: str, method: str) -> Path:
    """``runs/RECIPE-PRESET-METHOD`` under the current folder."""
    return Path("runs") / f"{recipe}-{preset}-{method}"


def read_run_config(config_path: Path) -> Any:
    """A run folder's ``config.json``; ``ValueError`` naming the file when it is not valid JSON."""
    try:
        return json.loads(config_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{config_path} is not valid JSON ({error}), so the run in its folder cannot be checked against "
            "this command; repair the file, or use another --out"
        ) from None


def _check_folder(out: Path, header: dict[str, Any], resume: bool) -> None:
    config_path = out / "config.json"
    if resume:
        if not config_path.exists():
            raise FileNotFoundError(f"--resume: {config_path} not found; there is no run to resume in {out}")
        recorded = read_run_config(config_path)
        if recorded != header:
            changed = sorted(key for key in header if recorded.get(key) != header[key])
            raise ValueError(
                f"--resume: the run in {out} was started with other settings (differences in {changed}); "
                "resume with the same command, or start a new run with another --out"
            )
        return
    if (out / "checkpoints").exists() or (out / "results.json").exists():
        raise FileExistsError(
            f"{out} already holds a run; continue it with --resume, or choose another --out"
        )


def _finite_or_none(value: float) -> float | None:
    """JSON has no infinity: a ratio without tensorized layers is reported as null."""
    return value if math.isfinite(value) else None


def _step_time(records: list[dict[str, Any]]) -> float:
    times = [r["step_time"] for r in records if r.get("kind") == "train" and r.get("step_time", 0) > 0]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times) if times else float("nan")


def _peak_memory(records: list[dict[str, Any]]) -> float:
    peaks = [r["peak_memory_mib"] for r in records if r.get("kind") == "train" and "peak_memory_mib" in r]
    return max(peaks) if peaks else float("nan")


def _evaluate_splits(trainer: Trainer, recipe: Recipe, data: RecipeData, settings) -> dict[str, dict]:
    """Every evaluation split's metrics on the final model; the first split's come from the Trainer's
    evaluation at the last step (after its last prune), which saw the same model."""
    model = trainer.module
    first = next(iter(data.evals), None)
    results = {first: dict(trainer.last_eval)} if first is not None and trainer.last_eval else {}
    batch_size = trainer.config.batch_size
    for split, dataset in data.evals.items():
        if split in results:
            continue
        batches = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=data.collate_fn)
        results[split] = run_evaluation(model, model, batches, recipe.evaluator(settings))
    return results


def run(
    recipe_name: str,
    *,
    method: str = "comera",
    preset: str = "small",
    data: str | Path | None = None,
    config_file: str | Path | None = None,
    assignments: Iterable[str] = (),
    out: str | Path | None = None,
    resume: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train ``recipe_name`` with ``method`` at ``preset`` and write the run folder; returns ``results.json``.

    Args:
        recipe_name: a registered recipe (``"nli"``, ``"dlrm"``, ``"mlm"``).
        method: a registered method (``"comera"``, ``"dense"``, baselines).
        preset: the recipe's preset (``"paper"``, ``"small"``, ``"smoke"``).
        data: the recipe's data file or folder; None for its embedded default data.
        config_file: a TOML file of settings; ``assignments``: ``"section.key=value"`` strings.
        out: the run folder; default :func:`default_run_dir`.
        resume: continue the run in ``out`` from its newest checkpoint (the settings must be the same).
        cache_dir: default :func:`default_cache_dir`.
        progress: show a progress bar (None: when stderr is a terminal).

    Raises:
        SetupError: before training, for bad settings, data or run folder (the message names which).
    """
    started = time.perf_counter()
    try:
        setup = _set_up(
            recipe_name,
            method,
            preset,
            data,
            config_file,
            list(assignments),
            out,
            resume,
            cache_dir,
            progress,
        )
    except (ValueError, FileNotFoundError, FileExistsError, TypeError, ImportError) as error:
        raise SetupError(str(error)) from error
    return _train(setup, resume, started)


def run_header(
    recipe_name: str,
    method: str,
    preset: str,
    data: str | Path | None = None,
    *,
    config_file: str | Path | None = None,
    assignments: Iterable[str] = (),
) -> dict[str, Any]:
    """The ``config.json`` a run with these arguments writes: recipe, method, preset, data path and the
    resolved settings. Checks them without building anything: ``ValueError`` for an unknown recipe,
    method, preset or setting, ``FileNotFoundError`` for a missing data path or TOML file."""
    recipe = get_recipe(recipe_name)
    settings = resolve_settings(
        recipe.presets, preset, get_method(method), config_file=config_file, assignments=assignments
    )
    data_path = None if data is None else Path(data)
    if data_path is not None and not data_path.exists():
        raise FileNotFoundError(f"--data {data_path}: no such file or folder")
    return {
        "recipe": recipe_name,
        "method": method,
        "preset": preset,
        "data": None if data_path is None else str(data_path.resolve()),
        "settings": settings,
    }


@dataclass
class _Setup:
    recipe: Recipe
    method: Method
    settings: dict[str, Any]
    out: Path
    data: RecipeData
    model: nn.Module
    header: dict[str, Any]
    dense_params: int
    trainer: Trainer


def _set_up(
    recipe_name, method, preset, data, config_file, assignments, out, resume, cache_dir, progress
) -> _Setup:
    recipe = get_recipe(recipe_name)
    chosen = get_method(method)
    header = run_header(recipe_name, method, preset, data, config_file=config_file, assignments=assignments)
    settings = header["settings"]
    out = Path(out) if out is not None else default_run_dir(recipe_name, preset, method)
    data_path = None if data is None else Path(data)
    _check_folder(out, header, resume)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    writable_folder(out, "--out")
    writable_folder(cache, "--cache")
    recipe_data = recipe.build_data(settings["data"], data_path, cache)
    torch.manual_seed(settings["train"].get("seed", 0))
    model = recipe.build_model(settings["model"], recipe_data)
    dense_params = compression_report(model).model_dense_params
    train_config = TrainConfig.from_dict({**settings["train"], "run_dir": str(out), "progress": progress})
    context = MethodContext(
        tensorize=tensorize_config(settings), settings=settings["method"], train=train_config
    )
    model = chosen.prepare(model, context)
    first_eval = next(iter(recipe_data.evals.values()), None)
    trainer = Trainer(
        model,
        recipe.loss_fn,
        recipe_data.train,
        config=train_config,
        objective=chosen.objective(model, context),
        optimizer=chosen.optimizer(model, context),
        eval_data=first_eval,
        evaluator=None if first_eval is None else recipe.evaluator(settings),
        collate_fn=recipe_data.collate_fn,
        callbacks=chosen.callbacks(model, context),
    )
    return _Setup(recipe, chosen, settings, out, recipe_data, model, header, dense_params, trainer)


def _train(setup: _Setup, resume: bool, started: float) -> dict[str, Any]:
    recipe, method, settings, out, data, model, trainer = (
        setup.recipe,
        setup.method,
        setup.settings,
        setup.out,
        setup.data,
        setup.model,
        setup.trainer,
    )
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / "config.json", json.dumps(setup.header, indent=2) + "\n")
    fit = trainer.fit(resume=resume)
    evaluation = _evaluate_splits(trainer, recipe, data, settings)
    save_pretrained(model, out / "model")
    report = compression_report(model)
    _write_text(out / "report.txt", f"{report}\n")
    records = read_metrics(out)
    results = {
        "recipe": setup.header["recipe"],
        "method": method.name,
        "preset": setup.header["preset"],
        "library_version": __version__,
        "evaluation": evaluation,
        "data": data.info,
        "params": report.model_params,
        "dense_params": setup.dense_params,
        "compression": {
            "tensorized": _finite_or_none(report.tensorized_ratio),
            "whole": setup.dense_params / max(report.model_params, 1),
        },
        "step_time_s": _step_time(records),
        "peak_memory_mib": _peak_memory(records),
        "wall_time_s": time.perf_counter() - started,
        "steps": fit.step,
        "stage": fit.stage,
        "size_ratio": fit.ratio,
        "nonfinite_steps": fit.nonfinite,
    }
    adaptation = getattr(trainer.objective, "adaptation", None)
    if adaptation is not None and hasattr(adaptation, "target_reached"):
        results["target_reached"] = bool(adaptation.target_reached)
    _write_text(out / "results.json", json.dumps(results, indent=2) + "\n")
    return results
