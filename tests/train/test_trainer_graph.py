"""Trainer with ``config.cuda_graph``: the step runs through :class:`comera.train.cuda_graph.CudaGraphStep`.

On CPU the wiring is tested with a recording stand-in for ``CudaGraphStep`` (device check bypassed) whose
``step`` does the eager step's math and returns the same four numbers: every step must go through it, the
Trainer's records must match an eager run exactly, and ``invalidate`` must come at a prune, at the late-stage
switch, after a resume and after a rollback. One test trains on a real CUDA graph and is skipped without CUDA.
"""

import pytest
import torch
from tiny import implementation, loss_fn, make_data, make_model, parameters_of
from torch import nn

import comera.train.setup as train_setup
import comera.train.trainer as trainer_module
from comera.methods.comera import CoMERAObjective
from comera.train import NonFiniteError, TrainConfig, Trainer, read_metrics
from comera.train.guard import total_grad_norm
from comera.train.setup import default_optimizer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


class RecordingGraphStep:
    """CPU stand-in for ``CudaGraphStep``: an eager step with the graph's semantics and return value.

    Like a replay, a step overwrites the gradients (they are not set to None afterwards) and undoes the loss
    average of a non-finite step. ``invalidate`` records ``(steps so far, stage, ranks of the first layer)``.
    CPU cannot step a capturable AdamW, so for the duration of each step the optimizer takes the
    implementation flags of the eager Trainer's default optimizer: both runs then step with the same kernel
    and their parameters can be compared bit for bit on any CPU.
    """

    def __init__(self, model, loss, optimizer, rank, **options):
        self.model, self.loss, self.optimizer, self.rank, self.options = model, loss, optimizer, rank, options
        self.steps = 0
        self.invalidations = []
        self.eager_implementation = implementation(default_optimizer(rank, TrainConfig()))

    def step(self, batch):
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        saved = self.rank.snapshot()
        task = self.loss(self.model, batch)
        objective = self.rank.loss(task)
        objective.backward()
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        norm = total_grad_norm(params)
        finite = torch.isfinite(objective.detach().float() + norm)
        if finite:
            if self.options["grad_clip"] is not None:
                torch.nn.utils.clip_grads_with_norm_(params, self.options["grad_clip"], norm)
            graph_implementation = implementation(self.optimizer)
            self._set_implementation(self.eager_implementation)
            self.optimizer.step()
            self._set_implementation(graph_implementation)
        else:
            self.rank.restore(saved)
        return torch.stack([task.detach().float(), objective.detach().float(), norm.float(), finite.float()])

    def _set_implementation(self, flags):
        for group, group_flags in zip(self.optimizer.param_groups, flags, strict=True):
            group.update(group_flags)

    def invalidate(self):
        self.invalidations.append((self.steps, self.rank.stage, self.model[0].max_ranks))


@pytest.fixture
def fakes(monkeypatch):
    """Every ``CudaGraphStep`` the Trainer makes, as :class:`RecordingGraphStep`s on CPU."""
    made = []

    def make(*args, **kwargs):
        made.append(RecordingGraphStep(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(train_setup, "CudaGraphStep", make)
    monkeypatch.setattr(train_setup, "_graph_device", lambda device: True)
    return made


def config(run_dir, cuda_graph, **overrides):
    values = {
        "early": 3,
        "late": 3,
        "unit": "step",
        "batch_size": 16,
        "grad_clip": 1.0,
        "log_every": 1,
        "run_dir": str(run_dir),
        "plot": False,
        "cuda_graph": cuda_graph,
        **overrides,
    }
    return TrainConfig(**values)


def make_trainer(model, loss, data, config, **options):
    """A Trainer with CoMERA's objective pruning at the end of the early stage only, with one trim (the
    recaptures counted here are those of the stage switch and that trim)."""
    objective = CoMERAObjective(model, prune_at=("early_end",), trims=1)
    return Trainer(model, loss, data, config=config, objective=objective, **options)


def train_records(run_dir):
    keys = ("step", "stage", "loss", "objective", "size", "ranks", "nonfinite")
    return [{key: r[key] for key in keys} for r in read_metrics(run_dir) if r["kind"] == "train"]


def assert_same_parameters(got_model, want_model):
    got, want = parameters_of(got_model), parameters_of(want_model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_every_step_runs_through_the_graph_step_and_matches_eager(fakes, tmp_path):
    eager_model, graph_model = make_model(dead_gate=True), make_model(dead_gate=True)
    full_ranks = graph_model[0].max_ranks
    eager = make_trainer(eager_model, loss_fn, make_data(), config=config(tmp_path / "eager", False)).fit()
    trainer = make_trainer(graph_model, loss_fn, make_data(), config=config(tmp_path / "graph", True))
    assert all(group["capturable"] for group in trainer.optimizer.param_groups)
    assert not trainer.compiles()
    result = trainer.fit()

    (fake,) = fakes
    assert (
        fake.model is graph_model and fake.optimizer is trainer.optimizer and fake.rank is trainer.objective
    )
    expected_options = {"buckets": None, "pad": None, "length_dim": 1, "grad_clip": 1.0, "warmup": 3}
    assert {key: fake.options[key] for key in expected_options} == expected_options
    assert fake.options["autocast_dtype"] is None
    assert fake.steps == result.step == 6
    pruned = graph_model[0].max_ranks
    assert pruned != full_ranks
    # the prune and the switch at step 3; the late stage's trim at its deadline (its third step)
    assert fake.invalidations == [(3, "early", pruned), (3, "late", pruned), (6, "late", pruned)]
    assert result == eager
    assert train_records(tmp_path / "graph") == train_records(tmp_path / "eager")
    assert_same_parameters(graph_model, eager_model)


def test_resume_invalidates_and_continues_like_an_uninterrupted_run(fakes, tmp_path):
    def graph_config(run):
        return config(tmp_path / run, True, checkpoint_every=2, keep_checkpoints=10)

    full_model = make_model(dead_gate=True)
    make_trainer(full_model, loss_fn, make_data(), config=graph_config("full")).fit()
    make_trainer(make_model(dead_gate=True), loss_fn, make_data(), config=graph_config("part")).fit()
    resumed = make_model(dead_gate=True)
    trainer = make_trainer(resumed, loss_fn, make_data(), config=graph_config("part"))
    checkpoint = tmp_path / "part" / "checkpoints" / "step-00000004.pt"
    assert trainer.fit(resume=str(checkpoint)).step == 6
    ranks = full_model[0].max_ranks
    assert fakes[-1].invalidations == [(0, "late", ranks), (2, "late", ranks)], "at the resume; at the trim"
    assert fakes[-1].steps == 2
    assert_same_parameters(resumed, full_model)


def nan_data():
    data = make_data()
    data.tensors[0][20, 3] = float("nan")  # second batch of every epoch (no shuffle, 16 per batch)
    return data


def test_nonfinite_steps_are_counted_from_the_graph_values(fakes, tmp_path):
    def run(cuda_graph):
        model = make_model()
        overrides = {"early": 2, "late": 0, "unit": "epoch", "shuffle": False}
        run_config = config(tmp_path / str(cuda_graph), cuda_graph, **overrides)
        return model, make_trainer(model, loss_fn, nan_data(), config=run_config).fit()

    (eager_model, eager), (graph_model, graph) = run(False), run(True)
    assert graph.nonfinite == eager.nonfinite == 2
    assert fakes[0].steps == 6
    assert graph == eager
    assert train_records(tmp_path / "True") == train_records(tmp_path / "False")
    assert_same_parameters(graph_model, eager_model)


def test_rollback_restores_and_invalidates(fakes, tmp_path):
    overrides = {"shuffle": False, "checkpoint_every": 1, "max_nonfinite": 1, "max_rollbacks": 1}
    trainer = make_trainer(make_model(), loss_fn, nan_data(), config=config(tmp_path, True, **overrides))
    with pytest.raises(NonFiniteError, match="after 1 rollbacks"):
        trainer.fit()
    assert fakes[0].steps == 3  # good step, bad step, rollback to step 1, bad step again
    assert fakes[0].invalidations == [(2, "early", make_model()[0].max_ranks)]
    assert trainer.guard.rollbacks == 1 and trainer.guard.total == 2


def test_refusals_name_the_option(fakes, monkeypatch, tmp_path):
    model = make_model()
    plain = torch.optim.AdamW(model.parameters())
    for optimizer in (plain, torch.optim.SGD(model.parameters(), lr=0.1)):
        with pytest.raises(ValueError, match="optimizer must be torch.optim.AdamW or torch.optim.Adam built"):
            make_trainer(model, loss_fn, make_data(), config=config(tmp_path, True), optimizer=optimizer)
    monkeypatch.setattr(trainer_module, "world", lambda: (0, 2))
    with pytest.raises(ValueError, match="cuda_graph=True supports single-process runs only"):
        make_trainer(model, loss_fn, make_data(), config=config(tmp_path, True))
    assert not fakes


def test_uneven_last_batch_is_refused_without_buckets(fakes, tmp_path):
    with pytest.raises(ValueError, match="50 samples leave a last batch of 2 \\(batch_size=16\\)"):
        make_trainer(make_model(), loss_fn, make_data(50), config=config(tmp_path, True))
    trainer = make_trainer(
        make_model(), loss_fn, make_data(50), config=config(tmp_path, True, drop_last=True)
    )
    assert len(trainer.train_data) == 3


def test_cpu_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA model; on CPU use compile"):
        make_trainer(make_model(), loss_fn, make_data(), config=config(tmp_path, True))


def cuda_loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs.cuda()), labels.cuda())


@needs_cuda
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_cuda_graph_trainer_matches_eager_on_cuda(tmp_path, schedule):
    def run(cuda_graph):
        model = make_model(dropout=0.0, dead_gate=True).cuda()
        run_config = config(
            tmp_path / str(cuda_graph),
            cuda_graph,
            compile=False,
            early=4,
            late=4,
            lr_schedule=schedule,
            warmup=0.25,
        )
        return model, make_trainer(model, cuda_loss, make_data(), config=run_config).fit()

    (eager_model, eager), (graph_model, graph) = run(False), run(True)
    assert graph.step == eager.step == 8 and graph.stage == eager.stage == "late"
    assert graph.nonfinite == eager.nonfinite == 0
    assert graph_model[0].max_ranks == eager_model[0].max_ranks != make_model()[0].max_ranks
    got, want = parameters_of(graph_model), parameters_of(eager_model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
