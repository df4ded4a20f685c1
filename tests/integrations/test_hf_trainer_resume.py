"""``CoMERATrainer.train(resume_from_checkpoint=...)``: a fresh, unpruned model resumed from a checkpoint of
the 40-step run (early 16, late 24) ends as the uninterrupted run does: the same weights, events, size and
logged losses. Checkpoint 12 is before the late-stage switch (step 16) and the prunes (steps 24 and 32);
checkpoint 24 holds a pruned model in the late stage's descend phase, taken at an epoch end right after its
prune."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
from hf_tiny import RepeatingTokens, arguments, llama_config, tiny_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import comera  # noqa: E402
from comera.integrations.hf_trainer import STATE_NAME, CoMERATrainer  # noqa: E402
from comera.methods.comera import CoMERASettings  # noqa: E402
from comera.tensorize_config import tensorize_preset  # noqa: E402

SETTINGS = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.6)
EARLY, STEPS, EVERY = 16, 40, 12  # an epoch is 8 steps; checkpoints at steps 12, 24 and 36


def trainer_for(output_dir, seed: int = 0, early: int = EARLY, **overrides) -> CoMERATrainer:
    """The run's trainer on a fresh tiny LLaMA (``seed``: its initial weights)."""
    args = arguments(output_dir, max_steps=STEPS, save_steps=EVERY, **overrides)
    return CoMERATrainer(
        tiny_llama(seed), args, train_dataset=RepeatingTokens(), settings=SETTINGS, early=early
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The whole run, checkpointing every ``EVERY`` steps."""
    trainer = trainer_for(tmp_path_factory.mktemp("hf-resume"), save_strategy="steps")
    trainer.train()
    return trainer


def checkpoint(trainer, step: int) -> str:
    return f"{trainer.args.output_dir}/checkpoint-{step}"


def steps_and_names(trainer):
    return [(event["step"], event["event"]) for event in trainer.comera_callback.events]


def train_losses(trainer):
    return [(r["step"], r["loss"], r["comera_task_loss"]) for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("step", [12, 24])
def test_a_resumed_run_ends_with_the_weights_of_the_uninterrupted_run(uninterrupted, tmp_path, step):
    saved = json.loads((Path(checkpoint(uninterrupted, step)) / STATE_NAME).read_text())
    pruned = any(event["event"] == "prune" for event in saved["schedule"]["events"])
    assert pruned == (step == 24) and saved["objective"]["rank_adaptation"]["stage"] == (
        "late" if step > EARLY else "early"
    )
    resumed = trainer_for(
        tmp_path, seed=1
    )  # other initial weights: all of them must come from the checkpoint
    resumed.train(resume_from_checkpoint=checkpoint(uninterrupted, step))
    assert resumed.state.global_step == STEPS
    assert steps_and_names(resumed) == steps_and_names(uninterrupted)
    assert {name for _, name in steps_and_names(resumed)} == {"late_stage", "objective", "prune"}
    assert resumed.objective.size() == uninterrupted.objective.size() < resumed.objective.initial_size
    assert resumed.objective.stage == "late" and resumed.objective.adaptation.phase == "recover"
    ours = dict(resumed.model.named_parameters())
    theirs = dict(uninterrupted.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in theirs.items():
        torch.testing.assert_close(ours[name], param, rtol=0, atol=1e-6, msg=name)
    logged = train_losses(resumed)  # the checkpoint's log history, then the resumed steps'
    assert [record[0] for record in logged] == [record[0] for record in train_losses(uninterrupted)]
    for ours_record, theirs_record in zip(logged, train_losses(uninterrupted)):
        assert ours_record[1:] == pytest.approx(theirs_record[1:], rel=1e-6)


def test_resume_true_takes_the_latest_checkpoint_of_the_output_folder(uninterrupted, tmp_path):
    resumed = trainer_for(uninterrupted.args.output_dir, seed=1)
    resumed.train(resume_from_checkpoint=True)  # checkpoint-36, after the last prune
    assert steps_and_names(resumed) == steps_and_names(uninterrupted)
    for ours, theirs in zip(resumed.model.parameters(), uninterrupted.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_a_resume_in_micro_batches_continues_the_run_of_whole_batches(uninterrupted, tmp_path):
    """Checkpoint 24 of the run of batches of 4, resumed in 2 micro-batches of 2 per step: the same events and
    weights to float rounding."""
    resumed = trainer_for(tmp_path, seed=1, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    resumed.train(resume_from_checkpoint=checkpoint(uninterrupted, 24))
    assert steps_and_names(resumed) == steps_and_names(uninterrupted)
    for ours, theirs in zip(resumed.model.parameters(), uninterrupted.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_without_comera_state_is_refused_naming_the_file(uninterrupted, tmp_path):
    folder = tmp_path / "checkpoint-12"
    folder.mkdir()
    for path in Path(checkpoint(uninterrupted, 12)).iterdir():
        if path.name != STATE_NAME:
            (folder / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=STATE_NAME):
        trainer_for(tmp_path / "out").train(resume_from_checkpoint=str(folder))


def test_a_checkpoint_of_a_model_with_more_rank_is_refused_naming_the_state_file(uninterrupted, tmp_path):
    model = comera.tensorize_(LlamaForCausalLM(llama_config()), tensorize_preset("llm-hf-llama", rank=2))
    trainer = CoMERATrainer(
        model, arguments(tmp_path, max_steps=STEPS), train_dataset=RepeatingTokens(), settings=SETTINGS
    )
    with pytest.raises(ValueError, match=f"checkpoint-12/{STATE_NAME}: .*records ranks"):
        trainer.train(resume_from_checkpoint=checkpoint(uninterrupted, 12))


def test_a_resume_with_another_early_stage_is_refused(uninterrupted, tmp_path):
    with pytest.raises(ValueError, match="early stage of 16 steps, this one of 8"):
        trainer_for(tmp_path, early=8).train(resume_from_checkpoint=checkpoint(uninterrupted, 12))
