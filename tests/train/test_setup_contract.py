"""Contracts of the Trainer's setup helpers and the small pieces they build on: argument checks, batching,
model placement, the fused-kernel test, epoch data, the metrics log, the objective and the step window."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from comera.train import setup as train_setup
from comera.train.config import TrainConfig
from comera.train.data import EpochData
from comera.train.distributed import is_distributed, world
from comera.train.evaluation import MeanEvaluator
from comera.train.metrics import MetricsLog, read_metrics
from comera.train.objective import Objective
from comera.train.records import StepWindow

DDP_MESSAGE = (
    "model must not be wrapped in DistributedDataParallel: pass the plain model; the Trainer "
    "wraps it itself because it must rebuild the wrapper after pruning"
)


def _loss(model, batch):
    return model(batch).sum()


def _check(**overrides):
    """``check_arguments`` with valid arguments but for ``overrides``."""
    arguments = {
        "model": nn.Linear(2, 1),
        "loss_fn": _loss,
        "config": None,
        "optimizer": None,
        "objective": None,
        "eval_fn": None,
        "evaluator": None,
    }
    arguments.update(overrides)
    return train_setup.check_arguments(**arguments)


def _numbers(count: int) -> TensorDataset:
    """A dataset whose sample ``i`` is the number ``i``."""
    return TensorDataset(torch.arange(count))


def _samples(data: EpochData) -> list[int]:
    """Every sample of epoch 0 of ``data``, in order."""
    return [int(value) for (batch,) in data.epoch(0) for value in batch]


class _Unsized:
    """A re-iterable of batches without ``len()``."""

    def __iter__(self):
        return iter([torch.zeros(1), torch.zeros(1)])


@pytest.fixture
def one_process_group():
    """A gloo process group of one rank, destroyed afterwards."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("model", "model must be an nn.Module, got int"),
        ("loss_fn", "loss_fn must be callable as loss_fn(model, batch), got int"),
        ("eval_fn", "eval_fn must be callable or None, got int"),
        ("evaluator", "evaluator must be a comera.train.evaluation.Evaluator or None, got int"),
        ("config", "config must be a TrainConfig, got int"),
        ("optimizer", "optimizer must be a torch.optim.Optimizer or None, got int"),
        ("objective", "objective must be a comera.train.objective.Objective or None, got int"),
    ],
)
def test_check_arguments_names_the_argument_and_the_type_it_got(name, message):
    """A wrong-typed argument raises TypeError naming the argument, what it must be and the type given."""
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        _check(**{name: 3})


def test_check_arguments_refuses_eval_fn_and_evaluator_together():
    """Both eval_fn and an evaluator raise ValueError naming both."""
    evaluator = MeanEvaluator(lambda model, batch: {"loss": 0.0})
    with pytest.raises(ValueError, match="^give eval_fn or evaluator, not both$"):
        _check(eval_fn=lambda model, batch: {}, evaluator=evaluator)


def test_check_arguments_returns_the_default_config_for_none():
    """With valid arguments and config None the result is a default TrainConfig."""
    assert _check() == TrainConfig()


def test_check_arguments_refuses_a_ddp_wrapped_model(one_process_group):
    """A model already wrapped in DistributedDataParallel raises TypeError saying to pass the plain model."""
    wrapped = DistributedDataParallel(nn.Linear(2, 1))
    with pytest.raises(TypeError, match=f"^{re.escape(DDP_MESSAGE)}$"):
        _check(model=wrapped)


def test_is_distributed_is_false_for_a_group_of_one_rank(one_process_group):
    """A running process group of one rank is not distributed; world() is (0, 1)."""
    assert dist.is_initialized()
    assert is_distributed() is False
    assert world() == (0, 1)


def test_is_distributed_is_true_for_a_group_of_two_ranks(monkeypatch):
    """A running process group of two ranks is distributed; world() reports its rank and size."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 1)
    assert is_distributed() is True
    assert world() == (1, 2)


def test_fusable_takes_floating_point_cpu_and_cuda_parameters_only():
    """fusable is True for floating point parameters on CPU or CUDA, False for other devices or dtypes."""
    cuda_param = SimpleNamespace(is_floating_point=lambda: True, device=torch.device("cuda", 0))
    assert train_setup.fusable([cuda_param, torch.zeros(2)]) is True
    assert train_setup.fusable([torch.zeros(2, device="meta")]) is False
    assert train_setup.fusable([torch.zeros(2, dtype=torch.int64)]) is False


def test_place_model_moves_buffers_when_the_parameters_are_already_there():
    """A module whose parameters are on the target device but a buffer is not gets the buffer moved."""
    module = nn.Linear(2, 1, device="meta")
    module.register_buffer("scale", torch.ones(1))
    train_setup.place_model(module, "meta", None)
    assert module.scale.device == torch.device("meta")
    assert module.weight.device == torch.device("meta")


def test_place_model_refuses_an_optimizer_with_state_naming_the_setting_and_the_fix():
    """An optimizer holding state raises ValueError naming train.device and how to build it instead."""
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    message = (
        "train.device='meta': the optimizer passed in already holds state on the model's current device; "
        "build it after moving the model (model.to('meta')), or leave train.device unset"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        train_setup.place_model(module, "meta", optimizer)
    assert module.weight.device == torch.device("cpu")


def test_batches_for_refuses_data_without_len_when_counting_epochs():
    """Data without len() and unit='epoch' raises ValueError naming train_data and unit='step'."""
    message = (
        "train_data must have a len() (batches per epoch) to count stages in epochs; "
        "use unit='step' for data without one"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        train_setup.batches_for(_Unsized(), None, TrainConfig(unit="epoch"), None, 0, 1)


def test_batches_for_refuses_data_that_yields_no_batches():
    """Fewer samples than batch_size with drop_last raises ValueError naming train_data and the causes."""
    message = "train_data yields no batches (empty, or fewer samples than batch_size with drop_last)"
    config = TrainConfig(batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        train_setup.batches_for(_numbers(3), None, config, None, 0, 1)


def test_batches_for_evaluates_every_sample_of_an_uneven_shard():
    """Under two ranks training cuts 5 samples to 4, but evaluation keeps all 5, in order, across ranks."""
    config = TrainConfig(batch_size=2, shuffle=False)
    shards = [train_setup.batches_for(_numbers(5), _numbers(5), config, None, rank, 2) for rank in (0, 1)]
    assert [_samples(train) for train, _ in shards] == [[0, 2], [1, 3]]
    assert [_samples(evaluation) for _, evaluation in shards] == [[0, 2, 4], [1, 3]]
    assert [len(evaluation) for _, evaluation in shards] == [2, 1]


def test_epoch_data_defaults_to_the_whole_dataset_in_one_shard():
    """Without rank, world_size or equal_shards every sample is yielded, from the first."""
    data = EpochData(_numbers(5), batch_size=2, shuffle=False, drop_last=False, seed=0)
    assert _samples(data) == [0, 1, 2, 3, 4]
    assert (data.shard_size(), len(data)) == (5, 3)


def test_epoch_data_cuts_training_shards_to_equal_sizes_by_default():
    """With world_size=2 and no equal_shards, rank 0 of 5 samples gets 2 (the order cut to 4)."""
    data = EpochData(_numbers(5), batch_size=2, shuffle=False, drop_last=False, seed=0, world_size=2)
    assert _samples(data) == [0, 2]
    assert data.shard_size() == 2


def test_epoch_data_refuses_data_that_is_neither_dataset_nor_iterable():
    """A non-iterable raises TypeError naming data, the accepted kinds and the type given."""
    message = "data must be a map-style dataset or an iterable of batches, got int"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        EpochData(5, batch_size=1, shuffle=False, drop_last=False, seed=0)


def test_metrics_log_without_a_directory_has_cut_nothing():
    """MetricsLog(None) keeps no file and reports 0 torn bytes."""
    log = MetricsLog(None)
    assert log.path is None
    assert log.torn_bytes == 0


def test_metrics_log_creates_missing_parent_folders(tmp_path):
    """A log in a folder two levels below an existing one creates both and appends records there."""
    log = MetricsLog(tmp_path / "a" / "b")
    assert log.torn_bytes == 0
    log.write({"kind": "event", "step": 1, "event": "start"})
    assert read_metrics(tmp_path / "a" / "b") == [{"kind": "event", "step": 1, "event": "start"}]
    assert json.loads((tmp_path / "a" / "b" / "metrics.jsonl").read_text()) == {
        "kind": "event",
        "step": 1,
        "event": "start",
    }


def test_objective_refuses_a_model_that_is_not_a_module():
    """Objective(3) raises TypeError naming model and the type given."""
    with pytest.raises(TypeError, match="^model must be an nn.Module, got int$"):
        Objective(3)


def test_objective_initial_size_of_a_one_entry_model_is_one():
    """A model with one trainable entry starts at initial_size 1 and ratio 1."""
    objective = Objective(nn.Linear(1, 1, bias=False))
    assert objective.initial_size == 1
    assert objective.ratio() == 1.0


def test_step_window_starts_empty_and_clear_empties_it():
    """A new or cleared window has zero sums, counts, seconds and step time; one step then sums exactly."""
    window = StepWindow()
    for _ in range(2):
        state = (window.loss, window.objective, window.applied, window.steps, window.seconds)
        assert state == (0.0, 0.0, 0, 0, 0.0)
        assert window.step_time == 0.0
        started = time.perf_counter()
        window.add(2.0, 3.0, True, started)
        assert (window.loss, window.objective, window.applied, window.steps) == (2.0, 3.0, 1, 1)
        assert 0.0 <= window.seconds <= time.perf_counter() - started
        window.clear()
