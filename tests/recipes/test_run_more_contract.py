"""More of ``comera.recipes.run``'s contract: which batches every evaluation split is evaluated on, the
method's optimizer, callbacks and context reaching the Trainer, the recipe's hooks, results.json's numbers,
the device check before the data is read, and the progress bar."""

import contextlib
import io
import itertools
import json
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import toy
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import comera
from comera.methods import Method, get_method
from comera.methods.base import register_method
from comera.recipes import run as run_module
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.recipes.run import SetupError, run
from comera.train.evaluation import Evaluator
from comera.train.metrics import read_metrics
from comera.train.objective import TaskObjective

# --- evaluate_splits: the batches each split is evaluated on -------------------------------------------


class Numbers(Dataset):
    """Map-style: sample ``i`` is ``i``."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return index


class StreamedNumbers(IterableDataset):
    """Not map-style: yields ``0 .. count - 1``."""

    def __init__(self, count):
        self.count = count

    def __iter__(self):
        return iter(range(self.count))


def _collate(samples):
    return ("batch", *samples)


class BatchEvaluator(Evaluator):
    """Its metrics are the batches it saw."""

    def reset(self):
        self.batches = []

    def update(self, model, batch):
        self.batches.append(batch)

    def state(self):
        return self.batches

    def merge(self, states):
        self.batches = [batch for state in states for batch in state]

    def compute(self):
        return {"batches": self.batches}


SETTINGS = {"model": {"hidden": 4}}


class BatchRecipe(Recipe):
    name = ""

    def evaluator(self, settings):
        assert settings is SETTINGS
        return BatchEvaluator()


def _evaluate(evals, last_eval, *, batch_size=2):
    trainer = SimpleNamespace(
        module=nn.Identity(), last_eval=last_eval, config=SimpleNamespace(batch_size=batch_size)
    )
    data = RecipeData(train=Numbers(4), evals=evals, collate_fn=_collate, info={})
    return run_module.evaluate_splits(trainer, BatchRecipe(), data, SETTINGS)


def test_the_first_split_takes_the_trainers_last_evaluation_the_others_are_batched_in_order(monkeypatch):
    """One process: the first split's metrics are ``trainer.last_eval``; others are evaluated in order in
    batches of ``batch_size`` made by the recipe's ``collate_fn``."""
    monkeypatch.setattr(run_module, "world", lambda: (0, 1))
    results = _evaluate({"validation": Numbers(3), "test": Numbers(5)}, {"accuracy": 0.25})
    assert results == {
        "validation": {"accuracy": 0.25},
        "test": {"batches": [("batch", 0, 1), ("batch", 2, 3), ("batch", 4)]},
    }


def test_without_a_last_evaluation_the_first_split_is_evaluated_too(monkeypatch):
    """An empty ``last_eval`` (the model was pruned after it) means the first split is evaluated again."""
    monkeypatch.setattr(run_module, "world", lambda: (0, 1))
    results = _evaluate({"validation": Numbers(3)}, {})
    assert results == {"validation": {"batches": [("batch", 0, 1), ("batch", 2)]}}


def test_no_evaluation_split_gives_no_results(monkeypatch):
    """A recipe without evaluation splits reports none, whatever the Trainer's last evaluation."""
    monkeypatch.setattr(run_module, "world", lambda: (0, 1))
    assert _evaluate({}, {"accuracy": 0.5}) == {}


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_split_that_is_not_map_style_is_read_as_batches_as_the_trainer_reads_the_first(
    monkeypatch, world_size
):
    """An iterable that is not map-style is an iterable of batches (``EpochData``'s contract, by which the
    Trainer evaluates the first split), whatever the number of processes: the same reading for every split."""
    monkeypatch.setattr(run_module, "world", lambda: (0, world_size))
    results = _evaluate({"validation": Numbers(1), "test": StreamedNumbers(3)}, {"loss": 1.0})
    assert results["test"] == {"batches": [0, 1, 2]}


@pytest.mark.parametrize(
    ("rank", "expected"),
    [(0, [("batch", 0, 2), ("batch", 4, 6)]), (1, [("batch", 1, 3), ("batch", 5)])],
)
def test_each_rank_evaluates_every_world_size_th_sample_in_order_keeping_all(monkeypatch, rank, expected):
    """Two processes: rank r takes samples r, r+2, ... of the split, unshuffled, none dropped (7 samples:
    4 on rank 0, 3 on rank 1), the last batch partial, batched by the recipe's ``collate_fn``."""
    monkeypatch.setattr(run_module, "world", lambda: (rank, 2))
    results = _evaluate({"validation": Numbers(3), "test": Numbers(7)}, {"accuracy": 1.0})
    assert results == {"validation": {"accuracy": 1.0}, "test": {"batches": expected}}


# --- whole runs: the method's and the recipe's hooks, results.json --------------------------------------

LOG = []
"""What the recipe and the method were handed, in order."""


class SerialEvaluator(toy.AccuracyEvaluator):
    """The toy's accuracy, plus the number of this ``compute`` among all the evaluators' computes."""

    serials = itertools.count(1)

    def compute(self):
        return {**super().compute(), "serial": next(self.serials)}


@register_recipe
class MoreRecipe(toy.ToyRecipe):
    """The toy, logging its hooks' arguments, writing a model file and adding results."""

    name = "toy_more_contract"
    presets = {
        "smoke": {
            "model": {"hidden": 8},
            "data": {"train_samples": 32, "eval_samples": 8},
            "train": {"early": 1, "late": 0, "log_every": 1, "plot": False, "batch_size": 16},
            "tensorize": {"preset": "toy-mlp"},
        }
    }

    def build_data(self, settings, data_path, cache_dir):
        LOG.append(("build_data",))
        return super().build_data(settings, data_path, cache_dir)

    def evaluator(self, settings):
        LOG.append(("evaluator", settings["model"]["hidden"]))
        return SerialEvaluator()

    def save_model_files(self, folder, data):
        (folder / "splits.json").write_text(json.dumps(data.info["splits"]))

    def extra_results(self, results, data, trainer):
        return {
            "extra": {
                "steps": results["steps"],
                "train_read": data.info["splits"]["train"]["read"],
                "processes": trainer.world_size,
                "batch_size": trainer.config.batch_size,
            }
        }


class CountingSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.01)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


@dataclass(frozen=True)
class RecordingSettings:
    """The recording method has no settings of its own."""


@register_method(RecordingSettings)
class RecordingMethod(Method):
    """Trains with its own optimizer and callback, recording the model and context each hook gets."""

    name = "recording_contract"

    def prepare(self, model, context):
        self.seen = {"prepared": model}
        return model

    def objective(self, model, context):
        objective = TaskObjective(model)
        objective.adaptation = SimpleNamespace(stage="none")  # no ``target_reached``
        return objective

    def optimizer(self, model, context):
        self.seen["optimizer"] = (model, context.train)
        self.made = CountingSGD(model.parameters())
        return self.made

    def callbacks(self, model, context):
        self.seen["callbacks"] = (model, context.train)
        return [lambda trainer: LOG.append(("callback", trainer.step, trainer.optimizer is self.made))]


METHOD = get_method("recording_contract")


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """One run of the logging recipe with the recording method, a config file, and the progress bar on."""
    tmp_path = tmp_path_factory.mktemp("more")
    config = tmp_path / "run.toml"
    config.write_text("[model]\nhidden = 6\n")
    LOG.clear()
    stderr = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(stderr):
        results = run(
            "toy_more_contract",
            method="recording_contract",
            preset="smoke",
            config_file=config,
            out=tmp_path / "run",
            cache_dir=tmp_path / "cache",
            progress=True,
        )
    measured = time.perf_counter() - started
    return tmp_path / "run", results, measured, list(LOG), stderr.getvalue()


def test_the_config_file_is_applied_and_recorded(recorded_run):
    """``config_file``'s values are the run's settings (config.json) and what the recipe's hooks get."""
    out, _, _, log, _ = recorded_run
    assert json.loads((out / "config.json").read_text())["settings"]["model"]["hidden"] == 6
    assert [entry for entry in log if entry[0] == "evaluator"] == [("evaluator", 6)] * 2


def test_the_methods_optimizer_and_callbacks_get_the_prepared_model_and_the_runs_train_config(recorded_run):
    """``Method.optimizer`` and ``Method.callbacks`` get the prepared model and a context whose ``train`` is
    the run's TrainConfig (its run folder and batch size)."""
    out, _, _, _, _ = recorded_run
    for hook in ("optimizer", "callbacks"):
        model, train = METHOD.seen[hook]
        assert model is METHOD.seen["prepared"], hook
        assert (train.run_dir, train.batch_size, train.early, train.late) == (str(out), 16, 1, 0), hook


def test_the_trainer_steps_with_the_methods_optimizer_and_calls_its_callbacks(recorded_run):
    """The method's optimizer takes every step (2: 32 samples in batches of 16) and its callback runs after
    each, seeing that optimizer on the Trainer."""
    _, results, _, log, _ = recorded_run
    assert results["steps"] == 2 and METHOD.made.steps == 2
    assert [entry for entry in log if entry[0] == "callback"] == [
        ("callback", 1, True),
        ("callback", 2, True),
    ]


def test_the_device_is_not_checked_without_one(recorded_run):
    """No ``train.device``: the data is built once; the evaluator for the Trainer and for the test split."""
    _, _, _, log, _ = recorded_run
    assert [entry[0] for entry in log if entry[0] != "callback"] == ["build_data", "evaluator", "evaluator"]


def test_the_first_splits_result_is_the_last_evaluation_record(recorded_run):
    """Nothing pruned: the validation result is the Trainer's evaluation at the last step (metrics.jsonl's
    last eval record), not a second evaluation; the test split is evaluated once more after it."""
    out, results, _, _, _ = recorded_run
    last_eval = [record for record in read_metrics(out) if record["kind"] == "eval"][-1]
    assert last_eval["step"] == 2
    assert results["evaluation"]["validation"] == last_eval["metrics"]
    assert results["evaluation"]["test"]["serial"] == last_eval["metrics"]["serial"] + 1


def test_the_recipe_writes_its_model_files_into_model(recorded_run):
    """``save_model_files`` gets the run's ``model/`` folder and the run's data."""
    out, _, _, _, _ = recorded_run
    assert json.loads((out / "model" / "splits.json").read_text()) == {
        "train": {"read": 32, "skipped": 0},
        "validation": {"read": 8, "skipped": 0},
        "test": {"read": 8, "skipped": 0},
    }


def test_results_hold_the_recipes_extra_results_the_version_and_the_wall_time(recorded_run):
    """``extra_results`` gets the results so far, the data and the Trainer; ``library_version`` is comera's;
    the wall time is within this process's time; no ``target_reached`` for an adaptation without one."""
    out, results, measured, _, _ = recorded_run
    assert json.loads((out / "results.json").read_text()) == results
    assert results["extra"] == {"steps": 2, "train_read": 32, "processes": 1, "batch_size": 16}
    assert results["library_version"] == comera.__version__
    assert 0 < results["wall_time_s"] <= measured
    assert "target_reached" not in results


def test_progress_true_shows_the_bar(recorded_run):
    """``progress=True`` shows the progress bar on stderr even when it is not a terminal."""
    *_, stderr = recorded_run
    assert re.search(r"2/2 ", stderr), stderr


@register_recipe
class OneWeightRecipe(Recipe):
    """y = 2x with a single weight; no evaluation split, so no ``evaluator`` (the base one raises)."""

    name = "one_weight_contract"
    presets = {
        "smoke": {
            "model": {},
            "data": {},
            "train": {"early": 1, "late": 0, "batch_size": 4, "plot": False},
            "tensorize": {"preset": "toy-mlp"},
        }
    }

    def build_data(self, settings, data_path, cache_dir):
        inputs = torch.arange(4.0).unsqueeze(1)
        return RecipeData(
            train=TensorDataset(inputs, 2 * inputs), evals={}, info={"splits": {"train": {"read": 4}}}
        )

    def build_model(self, settings, data):
        return nn.Linear(1, 1, bias=False)

    def loss_fn(self, model, batch):
        inputs, targets = batch
        return nn.functional.mse_loss(model(inputs), targets)


def test_the_whole_model_ratio_of_a_one_parameter_model_is_one(tmp_path):
    """``compression.whole`` is dense / trained parameters, 1 / 1 for a one-weight model; a recipe without
    evaluation splits is never asked for an evaluator."""
    results = run(
        "one_weight_contract", method="dense", preset="smoke", out=tmp_path / "run", cache_dir=tmp_path
    )
    assert (results["params"], results["dense_params"]) == (1, 1)
    assert results["compression"] == {"tensorized": None, "whole": 1.0}
    assert results["evaluation"] == {} and results["steps"] == 1


def test_a_missing_gpu_is_refused_before_the_data_is_read(tmp_path):
    """``train.device`` naming a GPU this machine lacks is a SetupError naming the setting, raised before
    the recipe builds its data."""
    LOG.clear()
    with pytest.raises(SetupError, match=r"^train\.device='cuda:99': "):
        run(
            "toy_more_contract",
            method="dense",
            preset="smoke",
            assignments=['train.device="cuda:99"'],
            out=tmp_path / "run",
            cache_dir=tmp_path / "cache",
        )
    assert LOG == []
