"""``TrainingArguments`` that ``CoMERATrainer`` leaves to Hugging Face, each checked against a reference:
evaluation during training (across a prune), activation checkpointing, label smoothing, NEFTune's embedding
noise and ``bf16_full_eval``."""

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
from hf_tiny import VOCAB, RepeatingTokens, arguments, tiny_llama  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from comera.integrations.hf_trainer import CoMERATrainer  # noqa: E402
from comera.methods.comera import CoMERASettings  # noqa: E402

SETTINGS = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.5)
STEPS, EARLY = 12, 4  # the late stage from step 4, its trim, the prune at the epoch end at step 8
EVAL = RepeatingTokens(size=8, seed=3)


def stacked(dataset, indices) -> dict[str, torch.Tensor]:
    return {key: torch.stack([dataset[i][key] for i in indices]) for key in dataset[0]}


def mean_task_loss(model, dataset, batch: int) -> float:
    """The reference evaluation loss: the model's mean token loss per batch, averaged over the batches (all
    of the same size and length)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = [model(**stacked(dataset, range(i, i + batch))).loss for i in range(0, len(dataset), batch)]
    model.train(was_training)
    return float(torch.stack(losses).mean())


def train(tmp_path, callbacks=(), **overrides) -> CoMERATrainer:
    args = arguments(tmp_path, max_steps=STEPS, **overrides)
    trainer = CoMERATrainer(
        tiny_llama(),
        args,
        train_dataset=RepeatingTokens(),
        eval_dataset=EVAL,
        settings=SETTINGS,
        early=EARLY,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


class ReferenceEvaluation(TrainerCallback):
    """At every evaluation, the reference loss of the model as it is then, with its parameter count."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, int]] = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        count = sum(param.numel() for param in model.parameters())
        self.seen.append(
            (state.global_step, mean_task_loss(model, EVAL, args.per_device_eval_batch_size), count)
        )


def test_evaluation_during_training_gives_the_task_loss_of_the_model_then_across_a_prune(tmp_path):
    reference = ReferenceEvaluation()
    trainer = train(tmp_path, [reference], eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=4)
    evaluations = [record for record in trainer.state.log_history if "eval_loss" in record]
    assert [record["step"] for record in evaluations] == [4, 8, 12]
    assert [step for step, _, _ in reference.seen] == [4, 8, 12]
    assert reference.seen[0][2] > reference.seen[1][2]  # step 8's prune came before step 8's evaluation
    for record, (_, loss, _) in zip(evaluations, reference.seen):
        assert record["eval_loss"] == pytest.approx(loss, rel=1e-5)
        assert "comera_size" in record


def test_activation_checkpointing_trains_as_without_it(tmp_path):
    plain = train(tmp_path / "plain")
    checkpointed = train(tmp_path / "checkpointed", gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    assert checkpointed.comera_callback.events == plain.comera_callback.events
    for (name, ours), theirs in zip(checkpointed.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=name)


class SmoothedReference(TrainerCallback):
    """Before every step, ``cross_entropy(..., label_smoothing=0.1)`` and the plain loss of the model's
    next-token logits on the step's batch (sequential sampling: step ``k`` reads items ``4k .. 4k + 3`` of
    its epoch of 8 steps)."""

    def __init__(self) -> None:
        self.losses: list[tuple[float, float]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        start = 4 * (state.global_step % 8)
        batch = stacked(RepeatingTokens(), range(start, start + 4))
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1].reshape(-1, VOCAB)
        targets = batch["input_ids"][:, 1:].reshape(-1)
        smoothed = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)
        self.losses.append((float(smoothed), float(torch.nn.functional.cross_entropy(logits, targets))))


def test_label_smoothing_smooths_the_task_loss(tmp_path):
    """Every step's logged task loss against the reference of the model and batch of that step."""
    reference = SmoothedReference()
    trainer = train(
        tmp_path,
        [reference],
        label_smoothing_factor=0.1,
        logging_steps=1,
        train_sampling_strategy="sequential",
    )
    logged = [
        record["comera_task_loss"] for record in trainer.state.log_history if "comera_task_loss" in record
    ]
    assert logged == pytest.approx([smoothed for smoothed, _ in reference.losses], rel=1e-5)
    smoothed, plain = reference.losses[-1]
    assert smoothed > plain + 0.01  # the predictions are peaked by then: smoothing shows


class EmbeddingNoise(TrainerCallback):
    """At every step's start, the largest difference between the input embedding's output in training mode
    (NEFTune's hook active) and in eval mode (no noise)."""

    def __init__(self) -> None:
        self.largest: list[float] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        embedding = model.get_input_embeddings()
        ids = EVAL.ids[:2]
        with torch.no_grad():
            noisy = embedding(ids)
            embedding.eval()
            clean = embedding(ids)
            embedding.train()
        self.largest.append(float((noisy - clean).abs().max()))


def test_neftune_adds_its_uniform_noise_to_the_tensorized_embedding_while_training(tmp_path):
    """NEFTune's bound: ``alpha / sqrt(length * width)`` (uniform noise); nothing once training ends."""
    noise = EmbeddingNoise()
    trainer = train(tmp_path, [noise], neftune_noise_alpha=5.0)
    embedding = trainer.model.get_input_embeddings()
    assert type(embedding).__name__ == "TTMEmbedding"
    bound = 5.0 / math.sqrt(EVAL.ids.shape[1] * embedding.embedding_dim)
    assert len(noise.largest) == STEPS
    assert all(0.5 * bound < largest <= bound * (1 + 1e-6) for largest in noise.largest)
    with torch.no_grad():
        assert torch.equal(embedding.train()(EVAL.ids[:2]), embedding.eval()(EVAL.ids[:2]))


def test_bf16_full_eval_evaluates_in_bf16_close_to_fp32(tmp_path):
    trainer = train(tmp_path, bf16_full_eval=True, per_device_eval_batch_size=4)
    fp32 = mean_task_loss(trainer.model, EVAL, 4)
    loss = trainer.evaluate()["eval_loss"]
    assert {param.dtype for param in trainer.model.parameters()} == {torch.bfloat16}
    assert loss == pytest.approx(fp32, rel=0.02) and loss != fp32
