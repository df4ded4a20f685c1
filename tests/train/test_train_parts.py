"""The training loop's parts on their own: evaluation means, the non-finite guard's counters, the data order
of an iterable, the objective protocol's defaults, the CUDA-graph step's settings and the backend check."""

from __future__ import annotations

import linecache
import re
import warnings

import pytest
import torch
from torch import nn

from comera.train import setup as train_setup
from comera.train.config import TrainConfig
from comera.train.data import EpochData
from comera.train.distributed import check_backend
from comera.train.evaluation import MeanEvaluator
from comera.train.guard import NonFiniteError, NonFiniteGuard
from comera.train.objective import (
    Objective,
    TaskObjective,
    register_default_objective,
    register_evaluation_hook,
)


def whole(message: str) -> str:
    """A pattern that matches exactly ``message``."""
    return "^" + re.escape(message) + "$"


# --- evaluation -----------------------------------------------------------------------------------------


def test_mean_evaluator_refuses_a_non_callable_naming_its_type():
    """``MeanEvaluator(fn)`` with a non-callable raises the whole TypeError naming ``fn`` and its type."""
    with pytest.raises(TypeError, match=whole("fn must be callable as fn(model, batch), got int")):
        MeanEvaluator(3)


def test_mean_evaluator_refuses_a_result_that_is_not_a_mapping():
    """A per-batch function returning a list raises the whole TypeError showing what it returned."""
    evaluator = MeanEvaluator(lambda model, batch: [1.5])
    with pytest.raises(
        TypeError, match=whole("the evaluation function must return a mapping {name: value}, got [1.5]")
    ):
        evaluator.update(nn.Identity(), None)


def test_mean_evaluator_of_one_batch_is_that_batchs_value():
    """With a single batch the mean is the batch's value itself (divided by 1 batch, not more)."""
    evaluator = MeanEvaluator(lambda model, batch: {"loss": batch})
    evaluator.update(nn.Identity(), 3.0)
    assert evaluator.compute() == {"loss": 3.0}


def test_mean_evaluator_merge_sums_every_ranks_batches_and_values():
    """Merging two ranks' states gives the mean over all their batches: sums and batch counts both add up
    (hand computed: (2 + 4) / (2 + 3) and 1 / 5)."""
    evaluator = MeanEvaluator(lambda model, batch: {})
    evaluator.merge([({"loss": 2.0, "acc": 1.0}, 2), ({"loss": 4.0}, 3)])
    assert evaluator.compute() == {"loss": 6.0 / 5.0, "acc": 1.0 / 5.0}


# --- guard ----------------------------------------------------------------------------------------------


def test_rollback_without_a_checkpoint_names_where_checkpoints_come_from():
    """No checkpoint to roll back to raises the whole NonFiniteError explaining how checkpoints are
    written."""
    guard = NonFiniteGuard(max_consecutive=2, max_rollbacks=3)
    guard.record(False)
    guard.record(False)
    message = (
        "2 non-finite steps in a row up to step 7 and no checkpoint to roll back to (none written yet: a run "
        "with a folder writes one every train.checkpoint_every steps, by default at each epoch end)"
    )
    with pytest.raises(NonFiniteError, match=whole(message)):
        guard.begin_rollback(7, have_checkpoint=False)


def test_rollbacks_are_counted_up_to_max_rollbacks_then_refused():
    """Each rollback adds one to ``rollbacks`` and clears ``consecutive``; the one after ``max_rollbacks``
    raises, naming the counts."""
    guard = NonFiniteGuard(max_consecutive=1, max_rollbacks=2)
    for expected in (1, 2):
        assert guard.record(False) is True
        guard.begin_rollback(expected, have_checkpoint=True)
        assert guard.state_dict() == {"total": expected, "consecutive": 0, "rollbacks": expected}
    assert guard.record(False) is True
    message = (
        "1 non-finite steps in a row up to step 3 after "
        "2 rollbacks (max_rollbacks=2); 3 non-finite steps in all"
    )
    with pytest.raises(NonFiniteError, match=whole(message)):
        guard.begin_rollback(3, have_checkpoint=True)


def test_after_a_rollback_max_consecutive_bad_steps_are_needed_again():
    """A rollback restarts the count of bad steps in a row: with ``max_consecutive=2`` one bad step after it
    does not ask for another rollback, the second does."""
    guard = NonFiniteGuard(max_consecutive=2, max_rollbacks=5)
    assert [guard.record(False), guard.record(False)] == [False, True]
    guard.begin_rollback(2, have_checkpoint=True)
    assert [guard.record(False), guard.record(False)] == [False, True]


def test_guard_counters_load_from_a_state_dict_and_keep_counting():
    """``load_state_dict`` restores the three counters as ints, and counting continues from them."""
    guard = NonFiniteGuard(max_consecutive=3, max_rollbacks=1)
    guard.load_state_dict({"total": torch.tensor(5), "consecutive": 2, "rollbacks": 1})
    assert guard.state_dict() == {"total": 5, "consecutive": 2, "rollbacks": 1}
    assert all(type(value) is int for value in guard.state_dict().values())
    assert guard.record(False) is True
    message = (
        "3 non-finite steps in a row up to step 9 after "
        "1 rollbacks (max_rollbacks=1); 6 non-finite steps in all"
    )
    with pytest.raises(NonFiniteError, match=whole(message)):
        guard.begin_rollback(9, have_checkpoint=True)


# --- data -----------------------------------------------------------------------------------------------


def test_an_iterable_epoch_resumed_at_any_position_yields_the_remaining_batches():
    """For a list of batches, ``epoch(e, start)`` yields exactly ``batches[start:]`` for every start from 0
    to past the end (each start is its own boundary of the skip)."""
    batches = [f"batch{index}" for index in range(5)]
    data = EpochData(batches, batch_size=1, shuffle=False, drop_last=False, seed=0)
    for start in range(7):
        assert list(data.epoch(2, start)) == batches[start:], start


def test_an_iterable_epoch_seeds_the_cpu_generator_only_and_restores_it(monkeypatch):
    """Starting an iterable's epoch seeds the CPU generator with the epoch's seed (a shuffling DataLoader's
    order is that of ``torch.manual_seed(epoch_seed(seed, epoch))``), leaves the global CPU state as it was
    and never reseeds the CUDA generators, which the fork does not restore."""
    cuda_seeds = []
    samples = torch.arange(10)
    loader = torch.utils.data.DataLoader(samples, batch_size=10, shuffle=True)
    data = EpochData(loader, batch_size=1, shuffle=False, drop_last=False, seed=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5 * 1_000_003 + 3)
        expected = next(iter(loader))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    monkeypatch.setattr(torch.cuda, "manual_seed_all", cuda_seeds.append)
    order = next(data.epoch(3))
    assert order.tolist() == expected.tolist()
    assert torch.equal(torch.get_rng_state(), before)
    assert cuda_seeds == []
    assert sorted(order.tolist()) == list(range(10))
    assert order.tolist() != list(range(10))


# --- objective ------------------------------------------------------------------------------------------


class _Counting(Objective):
    """An objective whose loss would update one device tensor in place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.counter = torch.zeros(2)

    def device_state(self) -> list[torch.Tensor]:
        return [self.counter]


def test_restore_puts_back_the_snapshot_and_refuses_one_of_another_length():
    """``restore`` copies the snapshot back in place; a snapshot with fewer tensors than ``device_state``
    raises instead of restoring part of it."""
    objective = _Counting(nn.Linear(2, 1))
    snapshot = objective.snapshot()
    objective.counter += 3.0
    objective.restore(snapshot)
    assert objective.counter.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=whole("zip() argument 2 is shorter than argument 1")):
        objective.restore([])


def test_param_groups_of_a_model_with_nothing_to_train_are_empty():
    """A model whose parameters are all frozen gets no parameter group at all (not an empty one)."""
    model = nn.Linear(2, 1).requires_grad_(False)
    assert TaskObjective(model).param_groups(lr=0.1, weight_decay=0.0) == []


def test_objective_state_restores_initial_size_and_the_ratio_follows():
    """Loading ``initial_size`` replaces it (as an int) and ``ratio`` is size over it: 9 entries over 18."""
    objective = TaskObjective(nn.Linear(2, 3))
    assert objective.size() == 9
    objective.load_state_dict({"name": "task", "initial_size": torch.tensor(18)})
    assert type(objective.initial_size) is int
    assert objective.initial_size == 18
    assert objective.ratio() == 0.5


def test_objective_state_without_name_or_initial_size_keeps_the_current_values():
    """A state without ``name`` is accepted and one without ``initial_size`` keeps the built value."""
    objective = TaskObjective(nn.Linear(2, 3))
    objective.load_state_dict({"initial_size": 4})
    assert objective.initial_size == 4
    objective.load_state_dict({"name": "task"})
    assert objective.initial_size == 4


def test_objective_state_of_another_objective_is_refused_naming_both():
    """A checkpoint written by another objective raises the whole ValueError naming both objectives."""
    objective = TaskObjective(nn.Linear(2, 3))
    message = "the checkpoint was written with the 'comera' objective, this run uses 'task'"
    with pytest.raises(ValueError, match=whole(message)):
        objective.load_state_dict({"name": "comera", "initial_size": 4})
    assert objective.initial_size == 9


def test_registering_non_callables_is_refused_naming_their_type():
    """Registering a non-callable default-objective factory or evaluation hook raises the whole TypeError
    naming the argument and the type it got."""
    with pytest.raises(TypeError, match=whole("factory must be callable as factory(model), got int")):
        register_default_objective(3)
    with pytest.raises(TypeError, match=whole("hook must be callable as hook(), got str")):
        register_evaluation_hook("hook")


# --- setup: the CUDA-graph step -------------------------------------------------------------------------


def test_graph_step_needs_a_cuda_model_then_a_capturable_adam():
    """``graph_step_for`` refuses a CPU model first, and on a CUDA device a non-capturable optimizer, each
    with its whole message (a ``cuda`` device object is built without touching a GPU)."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = TrainConfig(cuda_graph=True)
    objective = TaskObjective(model)
    cpu_message = "cuda_graph needs a CUDA model; on CPU use compile (the model is on cpu)"
    with pytest.raises(ValueError, match=whole(cpu_message)):
        train_setup.graph_step_for(model, None, optimizer, objective, config, torch.device("cpu"))
    adam_message = (
        "optimizer must be torch.optim.AdamW or torch.optim.Adam built with capturable=True in every param "
        "group when cuda_graph=True, got SGD"
    )
    with pytest.raises(ValueError, match=whole(adam_message)):
        train_setup.graph_step_for(model, None, optimizer, objective, config, torch.device("cuda"))


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", None)])
def test_graph_step_gets_the_buckets_pad_and_autocast_of_the_config(monkeypatch, precision, dtype):
    """The CUDA-graph step is built with the config's buckets and pad, and bf16 autocast exactly when
    ``precision="bf16"`` (the step class is replaced by a recorder: building the real one needs a GPU)."""
    built = {}

    def record(*args, **kwargs):
        built.update(kwargs)
        return "step"

    monkeypatch.setattr(train_setup, "CudaGraphStep", record)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), capturable=True)
    config = TrainConfig(cuda_graph=True, graph_buckets=(4, 8), graph_pad={0: -1.0}, precision=precision)
    step = train_setup.graph_step_for(
        model, None, optimizer, TaskObjective(model), config, torch.device("cuda")
    )
    assert step == "step"
    assert built["buckets"] == (4, 8)
    assert built["pad"] == {0: -1.0}
    assert built["autocast_dtype"] is dtype


# --- distributed ----------------------------------------------------------------------------------------


def test_check_backend_reads_the_running_groups_backend_by_default(monkeypatch):
    """Without ``backend`` the running process group's backend is checked: nccl for a CPU model is refused
    with the whole message naming it."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "NCCL")
    message = (
        "the process group uses backend 'nccl', but the model is on cpu, which needs 'gloo': create it with "
        "torch.distributed.init_process_group(backend_for(device))"
    )
    with pytest.raises(ValueError, match=whole(message)):
        check_backend(torch.device("cpu"))


def test_gloo_for_a_cuda_model_warns_at_the_callers_line():
    """gloo with a CUDA model gives a UserWarning with the whole message, attributed to a caller's line
    rather than to the library's own ``warnings.warn`` call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_backend(torch.device("cuda"), "gloo")
    assert len(caught) == 1
    assert caught[0].category is UserWarning
    assert str(caught[0].message) == (
        "the process group uses backend 'gloo', but the model is on cuda, which needs 'nccl': create it with "
        "torch.distributed.init_process_group(backend_for(device)) (gloo works on CUDA tensors, but slowly)"
    )
    assert "warnings.warn" not in linecache.getline(caught[0].filename, caught[0].lineno)


def test_an_evaluation_forks_the_generators_of_the_cuda_devices_its_model_is_on(monkeypatch):
    """The evaluation forks the CPU generator and those of the CUDA devices holding the model (none here), so
    an evaluation that draws random numbers leaves every generator of the run as it was."""
    from comera.train import evaluation

    forked = []
    real = torch.random.fork_rng

    def spy(devices=None, **kwargs):
        forked.append(devices)
        return real(devices=devices, **kwargs)

    monkeypatch.setattr(torch.random, "fork_rng", spy)
    model = torch.nn.Linear(2, 1)
    evaluator = evaluation.MeanEvaluator(lambda module, batch: {"draw": float(torch.rand(()))})
    before = torch.random.get_rng_state()
    evaluation.run_evaluation(model, model, [torch.zeros(1, 2)], evaluator)
    assert forked == [[]]
    assert torch.equal(torch.random.get_rng_state(), before)
    meta = torch.nn.Linear(2, 1, device="meta")
    assert evaluation.cuda_devices_of(meta) == []
