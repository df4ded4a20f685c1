"""Training through ``transformers.Trainer`` with the chunked loss (``ChunkedLossTrainer``, and
``CoMERATrainer(loss_chunk_size=...)``) against the same run on the model's own loss: the same logged losses
and the same weights to float rounding, with and without gradient accumulation (``num_items_in_batch``);
the head never sees more rows than a chunk; models without a base model and a head are refused."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
from hf_tiny import RepeatingTokens, arguments, llama_config, tiny_llama, tiny_regressor  # noqa: E402
from transformers import LlamaForCausalLM, Trainer  # noqa: E402

from comera.integrations.hf_loss import ChunkedLossTrainer  # noqa: E402
from comera.integrations.hf_trainer import CoMERATrainer  # noqa: E402
from comera.methods.comera import CoMERASettings  # noqa: E402

CHUNK = 7  # 4 sequences of 16 tokens: 64 tokens, 10 chunks, the last of 1
STEPS = 4


class PaddedTokens(RepeatingTokens):
    """:class:`RepeatingTokens` whose sequence ``i`` has its last ``i % 5`` labels ignored (-100), so that
    micro-batches count different numbers of targets."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        labels = item["labels"].clone()
        if index % 5:
            labels[-(index % 5) :] = -100
        return {**item, "labels": labels}


def dense_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def losses(trainer):
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]


def same_run(ours, theirs):
    assert trainer_losses_match(ours, theirs)
    for (name, mine), (other, value) in zip(
        ours.model.named_parameters(), theirs.model.named_parameters(), strict=True
    ):
        assert name == other
        torch.testing.assert_close(mine, value, rtol=1e-4, atol=1e-5, msg=name)


def trainer_losses_match(ours, theirs):
    mine, reference = losses(ours), losses(theirs)
    return len(mine) == STEPS and mine == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_plain_trainer_trains_as_with_the_models_own_loss(tmp_path, accumulation):
    settings = dict(max_steps=STEPS, logging_steps=1, gradient_accumulation_steps=accumulation)
    data = PaddedTokens()
    theirs = Trainer(dense_llama(), arguments(tmp_path / "own", **settings), train_dataset=data)
    theirs.train()
    ours = ChunkedLossTrainer(
        dense_llama(), arguments(tmp_path / "chunked", **settings), train_dataset=data, loss_chunk_size=CHUNK
    )
    assert ours.model_accepts_loss_kwargs  # so num_items_in_batch reaches the loss under accumulation
    rows = []
    ours.model.lm_head.register_forward_hook(lambda module, args, output: rows.append(output.shape[:-1]))
    ours.train()
    same_run(ours, theirs)
    assert rows and max(shape.numel() for shape in rows) == CHUNK


@pytest.mark.parametrize("accumulation", [1, 2])
def test_comera_trainer_trains_as_with_the_models_own_loss(tmp_path, accumulation):
    """The tensorized head (a ``TTLinear``) under the chunked loss, CoMERA's objective on top."""
    settings = dict(max_steps=STEPS, logging_steps=1, gradient_accumulation_steps=accumulation)
    comera = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, prune_at=())
    runs = []
    for name, chunk in (("own", None), ("chunked", CHUNK)):
        trainer = CoMERATrainer(
            tiny_llama(),
            arguments(tmp_path / name, **settings),
            train_dataset=PaddedTokens(),
            settings=comera,
            early=2,
            loss_chunk_size=chunk,
        )
        trainer.train()
        runs.append(trainer)
    assert type(runs[1].model.lm_head).__name__ == "TTLinear"
    same_run(runs[1], runs[0])


def test_evaluation_keeps_the_whole_logits(tmp_path):
    data = RepeatingTokens(size=8)
    args = arguments(tmp_path, max_steps=1)
    ours = ChunkedLossTrainer(
        dense_llama(), args, train_dataset=data, eval_dataset=data, loss_chunk_size=CHUNK
    )
    theirs = Trainer(dense_llama(), args, train_dataset=data, eval_dataset=data)
    assert ours.evaluate()["eval_loss"] == pytest.approx(theirs.evaluate()["eval_loss"], rel=1e-6)
    assert "forward" not in vars(ours.model)  # the model's own forward is back


def test_a_model_without_a_base_model_and_head_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"loss_chunk_size needs a transformers causal LM with a base model"):
        ChunkedLossTrainer(tiny_regressor(), arguments(tmp_path), loss_chunk_size=CHUNK)


def test_a_model_that_changes_its_logits_after_the_head_is_refused(tmp_path):
    model = dense_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"config.final_logit_softcapping=30.0 changes the logits"):
        ChunkedLossTrainer(model, arguments(tmp_path), loss_chunk_size=CHUNK)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64"])
def test_a_bad_chunk_size_is_refused_naming_the_keyword(tmp_path, bad):
    with pytest.raises(ValueError, match=r"loss_chunk_size must be None or an integer >= 1"):
        ChunkedLossTrainer(dense_llama(), arguments(tmp_path), loss_chunk_size=bad)
    with pytest.raises(ValueError, match=r"loss_chunk_size must be None or an integer >= 1"):
        CoMERATrainer(tiny_llama(), arguments(tmp_path), loss_chunk_size=bad)
