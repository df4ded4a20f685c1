"""Pre-train a Hugging Face ``LlamaForCausalLM`` in tensor-train form with ``CoMERATrainer``, then load it
back with ``comera.from_pretrained`` and generate.

1. data: ``--data`` is a corpus prepared by ``comera prepare llm`` (a folder holding ``index.json``: its
   tokenizer and memory-mapped token shards) or a folder of ``.txt`` files (a byte-level BPE of
   ``--vocab-size`` is trained on its training split, cached under ``--out``); either way the text is cut
   into blocks of ``--seq-len`` tokens, which become a ``datasets.Dataset`` (``input_ids``) for training and
   one for evaluation;
2. model: ``LlamaForCausalLM`` built from a ``LlamaConfig`` of the given sizes (the defaults are the 60M shape
   of GaLore's LLaMA: width 512, SwiGLU 1376, 8 layers, 8 heads, 256-token blocks), nothing downloaded, and
   tensorized with comera's ``llm-hf-llama`` preset at ``--rank`` (the projections, the head and the
   embedding in TT / TTM form);
3. training: ``CoMERATrainer`` (``transformers.Trainer`` with CoMERA's rank objective, its early and late
   stages and the prunes), evaluated every ``--eval-steps`` steps; the model is saved to ``OUT/model``
   (comera's files, ``config.json``, ``generation_config.json``, the tokenizer);
4. loading: ``comera.from_pretrained(OUT/model)`` and ``AutoTokenizer.from_pretrained(OUT/model)``; the
   loaded model is evaluated again (the same perplexity) and a ``text-generation`` pipeline continues the
   first evaluation block's opening tokens.

The last line printed is a JSON summary: perplexities (trained and loaded), the parameters and compression at
the end, the events of the run and the generated text.

Usage (``pip install 'comera[hf,examples]'``):
``python examples/hf_llama_pretrain.py --data FOLDER --out runs/hf-llama [--steps 1000] [--batch-size 8]``;
``--help`` lists the sizes and rates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    pipeline,
)

import comera
from comera.data.token_shards import is_prepared
from comera.integrations.hf_trainer import CoMERATrainer
from comera.methods.comera import CoMERASettings
from comera.tensorize_config import tensorize_preset
from comera.workloads.llm import presets  # noqa: F401  (registers the llm-hf-llama preset)
from comera.workloads.llm.data import LMData, build_lm_data
from comera.workloads.llm.prepared import build_prepared_lm_data


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", type=Path, required=True, help="a prepared corpus or a folder of .txt files"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/hf-llama"), help="output folder")
    parser.add_argument(
        "--validation-fraction", type=float, default=0.05, help="share of a .txt folder's files held out"
    )
    sizes = parser.add_argument_group("model (defaults: GaLore's 60M LLaMA)")
    sizes.add_argument("--hidden-size", type=int, default=512)
    sizes.add_argument("--intermediate-size", type=int, default=1376)
    sizes.add_argument("--layers", type=int, default=8)
    sizes.add_argument("--heads", type=int, default=8)
    sizes.add_argument("--seq-len", type=int, default=256, help="tokens per block")
    sizes.add_argument("--vocab-size", type=int, default=32000, help="BPE size for a .txt folder")
    sizes.add_argument("--rank", type=int, default=16, help="initial TT rank of every tensorized layer")
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    run.add_argument("--batch-size", type=int, default=8)
    run.add_argument("--lr", type=float, default=1e-3, help="rate of the dense parameters (norms)")
    run.add_argument("--lr-cores", type=float, default=1e-3, help="rate of the TT cores")
    run.add_argument("--lr-gates", type=float, default=1e-2, help="rate of the rank gates")
    run.add_argument("--early", type=float, default=0.5, help="share of the steps in the early stage")
    run.add_argument("--target-ratio", type=float, default=0.5, help="late-stage size target")
    run.add_argument("--eval-steps", type=int, default=200, help="evaluate every this many steps")
    run.add_argument("--eval-blocks", type=int, default=64, help="evaluation blocks (spread over the split)")
    run.add_argument("--new-tokens", type=int, default=24, help="tokens generated at the end")
    run.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    run.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.data.exists():
        parser.error(f"--data {args.data} does not exist")
    for name in ("steps", "batch_size", "eval_steps", "eval_blocks", "new_tokens", "seq_len", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.early <= 1:
        parser.error(f"--early must be in [0, 1], got {args.early}")
    return args


def read_blocks(args: argparse.Namespace) -> LMData:
    """The corpus cut into ``--seq-len`` blocks, through comera's language-model data."""
    cache = args.out / "cache"
    if is_prepared(args.data):
        return build_prepared_lm_data(
            args.data, cache_dir=cache, seq_len=args.seq_len, max_validation_blocks=args.eval_blocks
        )
    return build_lm_data(
        args.data,
        cache_dir=cache,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        validation_fraction=args.validation_fraction,
        max_validation_blocks=args.eval_blocks,
    )


def as_dataset(blocks: torch.utils.data.Dataset) -> Dataset:
    """A ``datasets.Dataset`` with one ``input_ids`` row per block (``(seq_len,)`` token ids)."""
    return Dataset.from_dict({"input_ids": [blocks[i].tolist() for i in range(len(blocks))]})


def hf_tokenizer(lm: LMData) -> PreTrainedTokenizerFast:
    """comera's byte-level BPE (RoBERTa's special tokens) as a ``transformers`` tokenizer."""
    return PreTrainedTokenizerFast(
        tokenizer_object=lm.tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return comera.tensorize_(LlamaForCausalLM(config), tensorize_preset("llm-hf-llama", rank=args.rank))


def perplexity(metrics: dict[str, float]) -> float:
    return math.exp(metrics["eval_loss"])


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = read_blocks(args)
    tokenizer = hf_tokenizer(lm)
    train, evaluation = as_dataset(lm.train), as_dataset(lm.validation)
    print(f"data: {len(train)} training blocks, {len(evaluation)} evaluation blocks of {args.seq_len} tokens")
    model = build_model(args, tokenizer)
    report = comera.compression_report(model)
    print(
        f"model: {report.model_params:,} parameters, tensorized layers {report.tensorized_ratio:.1f}x smaller"
    )
    training = TrainingArguments(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=max(1, min(args.eval_steps, 50)),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        disable_tqdm=True,
    )
    settings = CoMERASettings(target_ratio=args.target_ratio, lr_cores=args.lr_cores, lr_gates=args.lr_gates)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels: the ids, <pad> ignored
    trainer = CoMERATrainer(
        model,
        training,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate,
        processing_class=tokenizer,
        settings=settings,
        early=args.early,
    )
    trainer.train()
    trained = perplexity(trainer.evaluate())
    folder = args.out / "model"
    trainer.save_model(str(folder))
    report = comera.compression_report(trainer.model)
    print(f"trained: perplexity {trained:.2f}, {report.model_params:,} parameters; saved to {folder}")

    loaded = comera.from_pretrained(folder)
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    evaluator = Trainer(
        loaded,
        TrainingArguments(
            output_dir=str(args.out / "loaded"),
            per_device_eval_batch_size=args.batch_size,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        ),
        eval_dataset=evaluation,
        data_collator=collate,
    )
    reloaded = perplexity(evaluator.evaluate())
    prompt_ids = evaluation[0]["input_ids"][: min(16, args.seq_len // 2)]
    prompt = loaded_tokenizer.decode(prompt_ids)
    generator = pipeline("text-generation", model=loaded, tokenizer=loaded_tokenizer)
    (generated,) = generator(prompt, max_new_tokens=args.new_tokens, do_sample=False, return_full_text=False)
    print(f"loaded: perplexity {reloaded:.2f}; {prompt!r} -> {generated['generated_text']!r}")
    summary = {
        "perplexity": trained,
        "loaded_perplexity": reloaded,
        "params": report.model_params,
        "compression": report.tensorized_ratio,
        "events": [[event["step"], event["event"]] for event in trainer.comera_callback.events],
        "prompt": prompt,
        "generated": generated["generated_text"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
