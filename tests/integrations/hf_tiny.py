"""For the ``transformers.Trainer`` tests (nothing downloaded): a tiny tensorized ``LlamaForCausalLM`` and a
repeating-token dataset; a tiny tensorized MLP and a regression dataset."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import comera
from comera.tensorize_config import tensorize_preset
from comera.workloads.llm import presets  # noqa: F401  (registers llm-hf-llama)

VOCAB = 96
LENGTH = 16
BATCH = 4


def llama_config() -> LlamaConfig:
    """2 layers, hidden 32, vocabulary 96."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """The tiny LLaMA tensorized with ``llm-hf-llama`` at rank 4."""
    torch.manual_seed(seed)
    return comera.tensorize_(LlamaForCausalLM(llama_config()), tensorize_preset("llm-hf-llama", rank=4))


class RepeatingTokens(torch.utils.data.Dataset):
    """``size`` sequences of ``LENGTH`` tokens, each one of ``periods`` random 4-token patterns repeated
    (learnable in a few dozen steps); items are ``{"input_ids", "attention_mask", "labels"}``."""

    def __init__(self, size: int = 32, periods: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        patterns = torch.randint(3, VOCAB, (periods, 4), generator=generator)
        self.ids = patterns[torch.arange(size) % periods].repeat(1, LENGTH // 4)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def arguments(output_dir, **overrides) -> TrainingArguments:
    """CPU, no reporting, constant learning rate 1e-2, batch ``BATCH``, no checkpoints unless overridden."""
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=4,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**{**values, **overrides})


def lm_loss(model, batch) -> torch.Tensor:
    """The task loss for :class:`comera.train.Trainer`: the model's own next-token loss."""
    return model(**batch).loss


class TinyRegressor(nn.Module):
    """``16 -> 32 -> 16`` tanh MLP; ``forward(inputs, labels)`` returns ``{"loss"}``, the mean squared error
    (``inputs``, ``labels``: ``(batch, 16)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(inputs), labels)}


def tiny_regressor(seed: int = 0) -> TinyRegressor:
    """The tiny MLP with both linears tensorized (TT, rank 4)."""
    torch.manual_seed(seed)
    return comera.tensorize_(TinyRegressor(), rank=4)


class Pairs(torch.utils.data.Dataset):
    """``size`` random inputs of 16 features and their targets ``sin`` of the features rotated by one; items
    are ``{"inputs", "labels"}``."""

    def __init__(self, size: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, 16, generator=generator)
        self.labels = torch.sin(self.inputs.roll(1, dims=1))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


def tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over the tiny LLaMA's vocabulary: ``<pad>``, ``<s>``,
    ``</s>`` (ids 0 to 2) and the words ``w3`` ... ``w95`` (id = the number), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
