"""Run a recipe with a method and write the run folder (``config.json``, ``metrics.jsonl``, ``plots/``,
``checkpoints/``, ``model/``, ``report.txt``, ``results.json``); ``comera train WORKLOAD`` calls
:func:`run`, every process of a ``torchrun`` job too. Details: docs/recipes.md, 'The run folder' and
'Resuming and restarting a run'.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.atomic import atomic_write_bytes
from comera.io import save_pretrained
from comera.methods import Method, MethodContext, get_method
from comera.methods.comera.structure import apply_structure
from comera.recipes.base import Recipe, RecipeData, get_recipe
from comera.recipes.folders import (
    drop_if_only_locked,
    lock_run_folder,
    missing_folders,
    release_run_folder,
    remove_empty_folders,
    writable_folder,
)
from comera.recipes.run_folder import (
    aside_name,
    check_data_identity,
    check_run_folder,
    check_splits,
    move_run_aside,
)
from comera.recipes.run_records import (
    finite_or_none,
    median_step_time,
    peak_memory,
    per_rank_summary,
    strict_json,
)
from comera.recipes.settings import section_error
from comera.recipes.spec import RunSpec, default_cache_dir, default_run_dir, read_run_config, run_spec
from comera.report import compression_report
from comera.tensorize import TensorizeError
from comera.train.checkpoint import NoReadableCheckpointError
from comera.train.config import TrainConfig
from comera.train.data import EpochData
from comera.train.distributed import gather_objects, world
from comera.train.evaluation import run_evaluation
from comera.train.fsdp import is_sharded, whole_copy
from comera.train.metrics import read_metrics
from comera.train.parallel import (
    RankError,
    on_rank_zero,
    per_process_batch,
    rank_zero_first,
    training_device,
)
from comera.train.setup import place_model
from comera.train.trainer import Trainer
from comera.version import __version__

__all__ = [
    "run",
    "run_spec_folder",
    "evaluate_splits",
    "read_run_config",
    "SetupError",
    "default_cache_dir",
    "default_run_dir",
]


class SetupError(ValueError):
    """A run could not start: bad settings, a missing or malformed data file, a run folder in the way.
    Raised before any training step; the message names the setting, file or folder."""


_REFUSALS = (ValueError, FileNotFoundError, FileExistsError, TypeError, ImportError, RankError)
"""What a refused start raises before :class:`SetupError` says it in one line."""


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def evaluate_splits(trainer: Trainer, recipe: Recipe, data: RecipeData, settings) -> dict[str, dict]:
    """Every evaluation split's metrics on the final model, ``{split: {metric: value}}`` in the order of
    ``data.evals``; the first split's come from ``trainer.last_eval`` (the Trainer's evaluation at the last
    step, after its last prune, which saw the same model) when it is not empty; every other split is read in
    batches of ``trainer.config.batch_size`` made by ``data.collate_fn`` and scored by the recipe's evaluator
    built from ``settings`` (each process its shard, merged, under several processes)."""
    model = trainer.module
    first = next(iter(data.evals), None)
    results = {first: dict(trainer.last_eval)} if first is not None and trainer.last_eval else {}
    batch_size = trainer.config.batch_size
    rank, world_size = world()
    for split, dataset in data.evals.items():
        if split in results:
            continue
        # batched as the Trainer batches the first split; under several processes each rank evaluates its
        # shard and run_evaluation merges them
        batches = EpochData(
            dataset,
            batch_size=batch_size,
            shuffle=False,
            drop_last=False,
            seed=0,
            collate_fn=data.collate_fn,
            rank=rank,
            world_size=world_size,
            equal_shards=False,
        ).epoch(0)
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
    restart: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train ``recipe_name`` with ``method`` at ``preset`` and write the run folder; returns ``results.json``.
    The arguments are resolved by :func:`comera.recipes.spec.run_spec`, then :func:`run_spec_folder`
    trains.

    Args:
        recipe_name: a registered recipe (``"nli"``, ``"dlrm"``, ``"mlm"``, ``"llm"``).
        method: a registered method (``"comera"``, ``"dense"``, baselines).
        preset: the recipe's preset (``"paper"``, ``"small"``, ``"smoke"``).
        data: the recipe's data file or folder; None for its embedded default data.
        config_file: a TOML file of settings; ``assignments``: ``"section.key=value"`` strings.
        out: the run folder; default :func:`default_run_dir`.
        resume: continue the run in ``out`` from its newest readable checkpoint, or from step 0 if there is
            none (the settings and the data's content must be the same).
        restart: move the files in ``out`` aside (to ``OUT.old-N``) and train from step 0.
        cache_dir: default :func:`default_cache_dir`.
        progress: show a progress bar (None: when stderr is a terminal).

    Raises:
        SetupError: before training, for bad settings, data or run folder, or a resume without a readable
            checkpoint (the message names which).
    """
    started = time.perf_counter()
    try:
        spec = run_spec(
            recipe_name,
            method,
            preset,
            data=data,
            config_file=config_file,
            assignments=assignments,
            out=out,
            resume=resume,
            restart=restart,
            cache_dir=cache_dir,
            progress=progress,
        )
    except _REFUSALS as error:
        raise SetupError(str(error)) from error
    return run_spec_folder(spec, started)


def run_spec_folder(spec: RunSpec, started: float | None = None) -> dict[str, Any]:
    """Train the run ``spec`` resolves and write its folder (``spec.out``); returns ``results.json``.
    ``started``: the ``time.perf_counter()`` the run's wall time counts from (default: now). ``SetupError``
    as :func:`run` raises it."""
    started = time.perf_counter() if started is None else started
    try:
        made = missing_folders(spec.out)  # removed again, with the lock file, if the start is refused
        try:
            setup = _set_up(spec)
        except BaseException:
            release_run_folder()
            if made:
                drop_if_only_locked(spec.out)
                remove_empty_folders(made[1:])
            raise
    except _REFUSALS as error:
        raise SetupError(str(error)) from error
    try:
        return _train(setup, spec.resume, started)
    finally:
        release_run_folder()


@dataclass
class _Setup:
    recipe: Recipe
    method: Method
    spec: RunSpec
    context: MethodContext
    data: RecipeData
    header: dict[str, Any]
    dense_params: int
    trainer: Trainer
    earlier_run: Path | None


def _check_parallel(method: Method, name: str, train: TrainConfig) -> None:
    """A method that brings its own optimizer cannot run sharded (FSDP builds the optimizer after sharding
    the model): ``ValueError`` naming the setting, before any folder or data is touched."""
    sharded = train.parallel == "fsdp" and world()[1] > 1
    if sharded and type(method).optimizer is not Method.optimizer:
        raise ValueError(
            f"--method {name} brings its own optimizer, which train.parallel=fsdp cannot shard (it builds "
            "the optimizer after sharding the model): use --set train.parallel=ddp"
        )


def _set_up(spec: RunSpec) -> _Setup:
    recipe = get_recipe(spec.recipe)
    chosen = get_method(spec.method)
    header = spec.header()
    settings = spec.settings
    _check_parallel(chosen, spec.method, spec.train)
    if spec.train.device is not None:
        training_device(spec.train.device)  # a GPU this machine lacks, before the data is read
    out, cache = spec.out, spec.cache_dir

    def check_folders() -> None:
        if out.is_dir():
            lock_run_folder(out)
        if not spec.restart:  # a restart moves the old run aside only once nothing can refuse the start
            check_run_folder(out, header, spec.resume)
        writable_folder(out, "--out")
        lock_run_folder(out)
        writable_folder(cache, "--cache")

    on_rank_zero(check_folders)  # the run folder is rank 0's under torchrun
    try:
        recipe_data = rank_zero_first(lambda: recipe.build_data(settings["data"], spec.data, cache))
    except (ValueError, FileNotFoundError) as error:  # the builders' argument checks name the key alone
        raise section_error("data", error, settings["data"]) from None
    check_splits(recipe_data, spec.data)
    header["data_identity"] = recipe_data.info.get("identity")
    if spec.resume:
        on_rank_zero(lambda: check_data_identity(out, header["data_identity"], cache))
    torch.manual_seed(spec.train.seed)
    try:
        model = recipe.build_model(settings["model"], recipe_data)
    except ValueError as error:  # the models' argument checks name the key alone
        raise section_error("model", error, settings["model"]) from None
    dense_params = compression_report(model).model_dense_params
    train = replace(spec.train, batch_size=per_process_batch(spec.train.batch_size, world()[1]))
    context = MethodContext(tensorize=spec.tensorize, settings=spec.method_settings, train=train)
    try:
        model = chosen.prepare(model, context)
    except TensorizeError as error:  # the converter names the module or field, not the section
        raise ValueError(f"the [tensorize] settings do not fit the model: {error}") from None
    place_model(model, train.device, None)  # before the objective and optimizer take its parameters
    first_eval = next(iter(recipe_data.evals.values()), None)
    earlier_run = on_rank_zero(lambda: move_run_aside(out)) if spec.restart else None
    trainer = Trainer(
        model,
        recipe.loss_fn,
        recipe_data.train,
        config=train,
        objective=chosen.objective(model, context),
        optimizer=chosen.optimizer(model, context),
        eval_data=first_eval,
        evaluator=None if first_eval is None else recipe.evaluator(settings),
        collate_fn=recipe_data.collate_fn,
        callbacks=chosen.callbacks(model, context),
    )
    return _Setup(recipe, chosen, spec, context, recipe_data, header, dense_params, trainer, earlier_run)


def _train(setup: _Setup, resume: bool, started: float) -> dict[str, Any]:
    recipe, settings, out, data, trainer = (
        setup.recipe,
        setup.spec.settings,
        setup.spec.out,
        setup.data,
        setup.trainer,
    )
    if world()[0] == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_text(out / "config.json", json.dumps(setup.header, indent=2) + "\n")
    fit_started = time.perf_counter()
    try:
        fit = trainer.fit(resume=resume)
    except NoReadableCheckpointError as error:
        raise SetupError(
            f"--resume: no readable checkpoint in {error.directory}: all {error.count} are truncated or "
            f"corrupt; start the run again with --restart (the files in {out} are moved to "
            f"{aside_name(out)})"
        ) from error
    earlier_time = max(fit.train_time_s - (time.perf_counter() - fit_started), 0.0)
    pruned = trainer.prune(point="save") is not None
    if pruned:  # the saved model holds what is reported: its active ranks (the function is unchanged)
        trainer.last_eval = {}
    evaluation = evaluate_splits(trainer, recipe, data, settings)
    model = trainer.module  # a sharded run with sharded cores rebuilds it at each prune
    saved = _whole_model(setup) if is_sharded(model) else model
    results = on_rank_zero(lambda: _write_outputs(setup, saved, fit, evaluation, started - earlier_time))
    return gather_objects(results)[0]


def _whole_model(setup: _Setup) -> nn.Module | None:
    """The trained model of a sharded (FSDP) run, whole, on rank 0 (None elsewhere): built again from the
    recipe and method (:func:`comera.train.fsdp.whole_copy`)."""
    settings, context = setup.spec.settings, replace(setup.context, train=setup.trainer.config)
    structure = setup.trainer.objective.structure()

    def build() -> nn.Module:
        whole = setup.method.prepare(setup.recipe.build_model(settings["model"], setup.data), context)
        apply_structure(whole, structure)
        return whole

    return whole_copy(setup.trainer.module, build)


def _write_outputs(
    setup: _Setup, model: nn.Module, fit, evaluation: dict[str, dict], started: float
) -> dict[str, Any]:
    """Write ``model/`` (``model``: the trained model, whole), ``report.txt`` and ``results.json`` (rank 0's
    job) and return the results; ``started`` is the ``time.perf_counter()`` the run's wall time counts
    from.
    """
    method, out, data, trainer = setup.method, setup.spec.out, setup.data, setup.trainer
    save_pretrained(model, out / "model")
    setup.recipe.save_model_files(out / "model", data)
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
            "tensorized": finite_or_none(report.tensorized_ratio),
            "whole": setup.dense_params / max(report.model_params, 1),
        },
        "step_time_s": median_step_time(records),
        "peak_memory_mib": peak_memory(records),
        "wall_time_s": time.perf_counter() - started,
        "steps": fit.step,
        "stage": fit.stage,
        "size_ratio": fit.ratio,
        "nonfinite_steps": fit.nonfinite,
        "processes": trainer.world_size,
        **per_rank_summary(records, trainer.world_size),
    }
    results.update(setup.recipe.extra_results(results, data, trainer))
    adaptation = getattr(trainer.objective, "adaptation", None)
    if adaptation is not None and hasattr(adaptation, "target_reached"):
        results["target_reached"] = bool(adaptation.target_reached)
    if setup.earlier_run is not None:
        results["earlier_run"] = str(setup.earlier_run)
    text = strict_json(results)
    _write_text(out / "results.json", text)
    return json.loads(text)
