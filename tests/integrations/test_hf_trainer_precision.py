"""``CoMERATrainer`` with ``bf16=True`` (CPU autocast) and with ``torch_compile=True``, against the same run
in fp32 and eager: a tiny tensorized MLP, 16 steps (early 8, late 8; an epoch is 4 steps, so the late stage
trims and prunes at step 12 and trains 4 more steps on the pruned shapes)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
from hf_tiny import Pairs, arguments, tiny_regressor  # noqa: E402

from comera.integrations.hf_trainer import CoMERATrainer  # noqa: E402
from comera.methods.comera import CoMERAObjective, CoMERASettings  # noqa: E402

SETTINGS = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.6)
STEPS, EARLY, PRUNED_AT = 16, 8, 12


def train(output_dir, **overrides) -> CoMERATrainer:
    args = arguments(output_dir, max_steps=STEPS, logging_steps=2, **overrides)
    trainer = CoMERATrainer(tiny_regressor(), args, train_dataset=Pairs(), settings=SETTINGS, early=EARLY)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """The reference: fp32, eager."""
    return train(tmp_path_factory.mktemp("fp32"))


def steps_and_names(trainer):
    return [(event["step"], event["event"]) for event in trainer.comera_callback.events]


def losses(trainer):
    return [record["loss"] for record in trainer.state.log_history if "comera_task_loss" in record]


def test_the_reference_prunes_mid_run(fp32):
    assert (PRUNED_AT, "prune") in steps_and_names(fp32)
    assert fp32.objective.size() < 0.6 * fp32.objective.initial_size


def test_bf16_autocast_trains_close_to_fp32(fp32, tmp_path):
    trainer = train(tmp_path, bf16=True)
    assert steps_and_names(trainer) == steps_and_names(fp32)
    assert trainer.objective.size() == pytest.approx(fp32.objective.size(), rel=0.05)
    ours, theirs = losses(trainer), losses(fp32)
    assert ours == pytest.approx(theirs, rel=2e-2)
    assert ours != pytest.approx(theirs, rel=1e-6, abs=0)  # bf16 did round: autocast was on
    assert all(param.dtype == torch.float32 for param in trainer.model.parameters())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_trains_as_eager_also_after_the_prune(fp32, tmp_path, backend):
    """``aot_eager``: dynamo and AOTAutograd as with inductor, without compiling kernels (seconds);
    ``inductor``: torch's default backend, C++ kernels compiled on the CPU, twice (before and after the prune;
    about 40 s on 2 idle cores of the AMD EPYC, 2.5 minutes loaded)."""
    trainer = train(tmp_path, torch_compile=True, torch_compile_backend=backend)
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert steps_and_names(trainer) == steps_and_names(fp32)
    assert trainer.objective.size() == fp32.objective.size()
    assert losses(trainer) == pytest.approx(losses(fp32), rel=1e-5)
    for ours, theirs in zip(trainer.model.parameters(), fp32.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_rank_term_goes_through_the_loss_scaler_as_the_task_loss_does(tmp_path):
    """fp16's loss scaler (a GPU's, here torch's CPU ``GradScaler`` standing in for it): the task loss's
    backward and :meth:`CoMERATrainer.add_rank_term`'s both scaled by it, so the gradients are the
    objective's times the scale, as a reference copy's unscaled ``objective.loss(task).backward()`` shows."""
    batch = {key: torch.stack([Pairs()[i][key] for i in range(4)]) for key in ("inputs", "labels")}
    settings = CoMERASettings(gamma=0.5)
    reference = tiny_regressor()
    CoMERAObjective(reference, settings).loss(reference(**batch)["loss"]).backward()
    model = tiny_regressor()
    trainer = CoMERATrainer(model, arguments(tmp_path), train_dataset=Pairs(), settings=settings, early=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    trainer.accelerator.scaler = scaler
    task = model(**batch)["loss"]
    scaler.scale(task).backward()
    trainer.add_rank_term(model, task.detach())
    assert all(param.grad is not None for param in model.parameters())
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad / 64.0, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
