"""``comera bench hf_llama``: Hugging Face's ``LlamaForCausalLM`` (GaLore's 60M LLaMA, nothing downloaded)
trained through ``transformers.Trainer`` three ways (``adamw``, ``comera`` through ``CoMERATrainer`` on a
meta-built tensorized model, ``galore``), step time and training memory, each (method, batch) in a fresh
process, ``--memory-savers`` adding gradient checkpointing and the chunked loss. Details: docs/benchmarks.md,
"Hugging Face ``Trainer``" and "How the benchmarks measure"."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch

from comera.cpu import reset_peak_resident, status_kib
from comera.measure import machine_description, markdown_file_argument, source_commit, update_section
from comera.tensorize_config import TensorizeConfig

__all__ = [
    "METHODS",
    "SIZES",
    "TARGET_MEMORY_RATIO",
    "TARGET_SPEEDUP",
    "hf_paper_config",
    "llama_config",
    "main",
    "run_case",
]

METHODS = ("adamw", "comera", "galore")
TARGET_MEMORY_RATIO = 3.0
"""comera's training memory against GaLore's through the same Trainer: at least this many times smaller."""
TARGET_SPEEDUP = 2.0
"""comera's step time against GaLore's through the same Trainer: at least this many times faster."""
SIZES: dict[str, dict[str, int]] = {
    "60m": {"vocab": 32000, "hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "seq": 256},
    "tiny": {"vocab": 96, "hidden": 32, "intermediate": 88, "layers": 2, "heads": 4, "seq": 32},
}
"""``--size`` choices: the 60M shape (:class:`comera.workloads.llm.model.LMConfig`'s defaults) and a smoke
size."""
GALORE = {"rank": 128, "rank_fraction": 0.25, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
"""GaLore's settings for its 60M LLaMA (as :class:`comera.methods.galore.GaLoreMethod`'s defaults)."""
LEARNING_RATE = 1e-3
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_config(size: str) -> Any:
    """The ``transformers.LlamaConfig`` of ``size`` (untied head, RMSNorm epsilon 1e-6 and rotary base
    10000 as :class:`comera.workloads.llm.model.LMConfig`)."""
    from transformers import LlamaConfig

    sizes = SIZES[size]
    return LlamaConfig(
        vocab_size=sizes["vocab"],
        hidden_size=sizes["hidden"],
        intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["heads"],
        max_position_embeddings=sizes["seq"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


def hf_paper_config(size: str) -> TensorizeConfig:
    """The ``llm`` workload's tensorization of its LLaMA (``llm-paper`` at the 60M shape, ``llm-smoke`` at the
    tiny one) on Hugging Face's module names: ``TTLinear`` projections (the attention ``width -> width``, the
    MLP ``width -> mlp`` and back) and head, a ``TTMEmbedding``."""
    from comera.workloads.llm.presets import TENSORIZE_PRESETS

    paper = TENSORIZE_PRESETS["llm-paper" if size == "60m" else "llm-smoke"]
    shapes = paper.shape_pattern
    rename = {
        r"attention\.(q|k|v|o)": r"self_attn\.(q|k|v|o)_proj",
        r"mlp\.(gate|up)": r"mlp\.(gate|up)_proj",
        r"mlp\.down": r"mlp\.down_proj",
        "embed": "embed_tokens",
    }
    return TensorizeConfig(
        target_modules=(*_PROJECTIONS, "lm_head"),
        embeddings=("embed_tokens",),
        format=paper.format,
        rank=paper.rank,
        rank_pattern={"embed_tokens": paper.rank_pattern["embed"]},
        shape_pattern={rename[key]: value for key, value in shapes.items()},  # type: ignore[union-attr]
        init=paper.init,
    )


class RandomTokens(torch.utils.data.Dataset):
    """``size`` sequences of ``seq`` uniform random token ids; items ``{"input_ids", "labels"}``."""

    def __init__(self, size: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(vocab, (size, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _build(method: str, size: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from comera.tensorize import materialize_, tensorize_

    torch.manual_seed(0)
    if method != "comera":
        return LlamaForCausalLM(llama_config(size))
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(size))
    tensorize_(model, hf_paper_config(size))
    return materialize_(model)


def _galore_optimizer(model: torch.nn.Module, size: str) -> torch.optim.Optimizer:
    import galore_torch

    from comera.methods.projected import low_rank_groups

    projection = {key: GALORE[key] for key in ("update_proj_gap", "scale", "proj_type")}
    groups = low_rank_groups(
        model,
        TensorizeConfig(target_modules=_PROJECTIONS),
        rank=GALORE["rank"],
        rank_fraction=GALORE["rank_fraction"],
        lr=LEARNING_RATE,
        weight_decay=0.0,
        projection=projection,
    )
    return galore_torch.GaLoreAdamW(groups, lr=LEARNING_RATE, no_deprecation_warning=True)


def _saved_for_backward_mib(
    model: Any, batch: dict[str, torch.Tensor], loss_chunk_size: int | None
) -> tuple[float, float]:
    """MiB of the tensors one training forward of ``batch`` keeps for backward (each storage once, the
    parameters left out) and of the largest logits tensor the head returns in it. Kept for backward: what
    autograd's saved-tensor hooks see, plus every decoder layer's input and the base model's output, which
    checkpointed regions (``gradient_checkpointing``, the chunked loss) hold outside those hooks. With
    ``loss_chunk_size``, the forward is the chunked loss's
    (:func:`comera.integrations.hf_loss.chunked_forward`)."""
    from comera.integrations.hf_loss import chunked_forward

    storages: dict[int, int] = {}
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    logits = [0]

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        keep(args[0] if args else kwargs["hidden_states"])

    def keep_output(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        keep(output[0])

    def head_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        logits[0] = max(logits[0], output.nbytes)

    hooks = [layer.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in model.model.layers]
    hooks.append(model.model.register_forward_hook(keep_output, with_kwargs=True))
    hooks.append(model.lm_head.register_forward_hook(head_output))
    model.train()
    chunked = contextlib.nullcontext() if loss_chunk_size is None else chunked_forward(model, loss_chunk_size)
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), chunked:
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(storages.values()) / 2**20, logits[0] / 2**20


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """``package.Class`` of ``optimizer``, with ``(fused)`` or ``(foreach)`` where its defaults say so."""
    kind = type(optimizer)
    mode = next((f" ({key})" for key in ("fused", "foreach") if optimizer.defaults.get(key)), "")
    return f"{kind.__module__.split('.')[0]}.{kind.__name__}{mode}"


def run_case(
    method: str,
    batch: int,
    *,
    size: str,
    steps: int,
    warmup: int,
    savers: bool = False,
    loss_chunk: int | None = None,
) -> dict[str, Any]:
    """One (method, batch): build, train ``warmup + steps`` optimizer steps through the ``Trainer``, measure
    (docs/benchmarks.md, "How the benchmarks measure"). ``savers``: with ``gradient_checkpointing=True`` and
    the chunked loss of ``loss_chunk`` tokens per chunk (default
    :data:`comera.integrations.hf_loss.DEFAULT_CHUNK_SIZE`). Meant for a fresh process: the memory figures are
    the process's own."""
    from transformers import TrainerCallback, TrainingArguments

    from comera.integrations.hf_loss import DEFAULT_CHUNK_SIZE, ChunkedLossTrainer
    from comera.integrations.hf_stages import inner_optimizer
    from comera.integrations.hf_trainer import CoMERATrainer
    from comera.measure import weights_optimizer_mib
    from comera.methods.comera import CoMERASettings

    if method == "galore":
        import galore_torch  # noqa: F401  (imported before the baseline, as the other methods' modules are)
    baseline_kib = status_kib("VmRSS") or 0
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(time.perf_counter())

    sizes = SIZES[size]
    data = RandomTokens(batch * (warmup + steps), sizes["seq"], sizes["vocab"])
    args = TrainingArguments(
        output_dir="hf-llama-bench-unused",
        max_steps=warmup + steps,
        per_device_train_batch_size=batch,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=savers,
    )
    model = _build(method, size)
    chunk = (loss_chunk or DEFAULT_CHUNK_SIZE) if savers else None
    common = {"train_dataset": data, "callbacks": [Stamp()], "loss_chunk_size": chunk}
    if method == "comera":
        settings = CoMERASettings(prune_at=(), lr_cores=LEARNING_RATE, lr_gates=LEARNING_RATE)
        trainer: Any = CoMERATrainer(model, args, settings=settings, early=1.0, **common)
    elif method == "galore":
        optimizers = (_galore_optimizer(model, size), None)
        trainer = ChunkedLossTrainer(model, args, optimizers=optimizers, **common)
    else:
        trainer = ChunkedLossTrainer(model, args, **common)
    reset_peak_resident()
    trainer.train()
    training_kib = (status_kib("VmHWM") or 0) - baseline_kib
    intervals = [later - earlier for earlier, later in zip(stamps[warmup - 1 :], stamps[warmup:])]
    optimizer = inner_optimizer(trainer.optimizer)
    first = {"input_ids": data.ids[:batch], "labels": data.ids[:batch]}
    activations, logits = _saved_for_backward_mib(trainer.model, first, chunk)
    return {
        "method": method,
        "batch": batch,
        "savers": savers,
        "size": size,
        "optimizer": optimizer_name(optimizer),
        "ms": 1e3 * statistics.median(intervals),
        "training_mib": training_kib / 1024,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights_opt_mib": weights_optimizer_mib(trainer.model, optimizer),
        "activations_mib": activations,
        "logits_mib": logits,
        "params": sum(param.numel() for param in trainer.model.parameters()),
    }


def run_fresh_case(
    method: str,
    batch: int,
    *,
    size: str,
    steps: int,
    warmup: int,
    threads: int,
    savers: bool = False,
    loss_chunk: int | None = None,
) -> dict:
    """:func:`run_case` in a new interpreter (its memory its own), with a progress line; a failed case comes
    back as ``{"method", "batch", "savers", "error"}`` (the last line of its stderr)."""
    case = f"{method}:{batch}" + (":savers" if savers else "")
    command = [sys.executable, "-m", "comera.bench.hf_llama", "--case", case, "--size", size]
    command += ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    command += [] if loss_chunk is None else ["--loss-chunk", str(loss_chunk)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    label = f"{method}{' +savers' if savers else ''}"
    if done.returncode == 0:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{label:14s} batch {batch:3d} {result['ms']:10.1f} ms {result['training_mib']:9.1f} MiB",
            flush=True,
        )
        return result
    error = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}, nothing on stderr"]
    print(f"{label:14s} batch {batch:3d} failed: {' '.join(error)}", flush=True)
    return {"method": method, "batch": batch, "savers": savers, "error": " ".join(error)}


_MEDIANS = ("ms", "training_mib", "peak_mib", "weights_opt_mib", "activations_mib", "logits_mib")


def summarise(runs: list[dict]) -> dict:
    """One (method, batch)'s rounds: the medians of the measured fields, the rest from the first round; the
    first error if any round failed."""
    failed = [run for run in runs if "error" in run]
    if failed:
        return failed[0]
    return {
        **runs[0],
        **{key: statistics.median(run[key] for run in runs) for key in _MEDIANS},
        "rounds": len(runs),
    }


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x"


Key = tuple[str, int, bool]
"""A case: (method, batch, memory savers on)."""


def table(
    results: dict[Key, dict], methods: list[str], batches: list[int], variants: tuple[bool, ...] = (False,)
) -> list[str]:
    """The markdown table: one row per (batch, savers, method); ratios against GaLore's row of the same batch
    and savers."""
    lines = [
        "| batch | method | memory savers | optimizer | ms / step | vs galore | training MiB | vs galore | "
        "peak RSS MiB | weights+opt MiB | activations MiB | logits MiB | parameters |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        for savers in variants:
            galore = results.get(("galore", batch, savers), {})
            for method in methods:
                row = results[(method, batch, savers)]
                lines.append(_row(row, galore, batch, method, savers))
    return lines


def _row(row: dict, galore: dict, batch: int, method: str, savers: bool) -> str:
    if "error" in row:
        return f"| {batch} | {method} | {'yes' if savers else 'no'} | failed: {row['error']} |" + " |" * 9
    speed = _ratio(galore["ms"], row["ms"]) if "ms" in galore else "n/a"
    memory = _ratio(galore["training_mib"], row["training_mib"]) if "training_mib" in galore else "n/a"
    return (
        f"| {batch} | {method} | {'yes' if savers else 'no'} | {row['optimizer']} | {row['ms']:.0f} | "
        f"{speed} | "
        f"{row['training_mib']:.0f} | {memory} | {row['peak_mib']:.0f} | "
        f"{row['weights_opt_mib']:.1f} | {row['activations_mib']:.0f} | {row['logits_mib']:.0f} | "
        f"{row['params']:,} |"
    )


def targets(results: dict[Key, dict], batches: list[int], variants: tuple[bool, ...] = (False,)) -> list[str]:
    """comera against GaLore at every batch (and, with the memory savers, both with them): the memory and
    speed targets, met or missed."""
    lines = []
    for batch in batches:
        for savers in variants:
            ours, theirs = (
                results.get(("comera", batch, savers), {}),
                results.get(("galore", batch, savers), {}),
            )
            if "ms" not in ours or "ms" not in theirs:
                continue
            memory = theirs["training_mib"] / ours["training_mib"]
            speed = theirs["ms"] / ours["ms"]
            speed_met = "met" if speed >= TARGET_SPEEDUP else "missed"
            case = f"batch {batch}{', both with the memory savers' if savers else ''}"
            lines += [
                f"- {case}, training memory >= {TARGET_MEMORY_RATIO:g}x below GaLore's: {memory:.2f}x "
                f"({ours['training_mib']:.0f} vs {theirs['training_mib']:.0f} MiB), "
                f"{'met' if memory >= TARGET_MEMORY_RATIO else 'missed'}",
                f"- {case}, step >= {TARGET_SPEEDUP:g}x faster than GaLore's: {speed:.2f}x "
                f"({ours['ms']:.0f} vs {theirs['ms']:.0f} ms), {speed_met}",
            ]
    return lines


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=tuple(SIZES), default="60m", help="the model's shape")
    parser.add_argument("--batches", type=_positive, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--methods", choices=METHODS, nargs="+", default=list(METHODS))
    parser.add_argument("--steps", type=_positive, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=_positive, default=2, help="steps before the timed ones")
    parser.add_argument("--rounds", type=_positive, default=1, help="fresh processes per case (medians)")
    parser.add_argument("--threads", type=_positive, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument(
        "--write", type=markdown_file_argument, metavar="MARKDOWN", help="update the 'hf-llama' section"
    )
    parser.add_argument("--note", default="", help="a sentence added to the written section (e.g. the load)")
    parser.add_argument(
        "--label", default="", help="write the section 'hf-llama-LABEL' (beside the default one) instead"
    )
    parser.add_argument(
        "--memory-savers",
        action="store_true",
        help="also run every case with gradient_checkpointing=True and the chunked loss",
    )
    parser.add_argument(
        "--loss-chunk", type=_positive, help="tokens per chunk of the chunked loss (default 256)"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.case is not None:
        method, batch, *rest = args.case.split(":")
        savers = rest == ["savers"]
        result = run_case(
            method,
            int(batch),
            size=args.size,
            steps=args.steps,
            warmup=args.warmup,
            savers=savers,
            loss_chunk=args.loss_chunk,
        )
        print(json.dumps(result))
        return 0
    variants = (False, True) if args.memory_savers else (False,)
    print(machine_description())
    commit = source_commit()  # the code the cases run, before the run's hours let the checkout move on
    runs: dict[Key, list[dict]] = {}
    order = [
        (method, batch, savers) for batch in args.batches for savers in variants for method in args.methods
    ]
    shuffler = random.Random(0)
    for _ in range(args.rounds):
        shuffler.shuffle(order)
        for method, batch, savers in order:
            result = run_fresh_case(
                method,
                batch,
                size=args.size,
                steps=args.steps,
                warmup=args.warmup,
                threads=args.threads,
                savers=savers,
                loss_chunk=args.loss_chunk,
            )
            runs.setdefault((method, batch, savers), []).append(result)
    results = {key: summarise(value) for key, value in runs.items()}
    lines = table(results, args.methods, args.batches, variants) + [
        "",
        "Targets (measured, not asserted):",
        "",
    ]
    lines += targets(results, args.batches, variants)
    text = "\n".join(lines)
    print(text)
    if args.write:
        command = (
            f"comera bench hf_llama --size {args.size} --batches {' '.join(map(str, args.batches))} "
            f"--steps {args.steps} --warmup {args.warmup} --rounds {args.rounds} --threads {args.threads}"
            + (" --memory-savers" if args.memory_savers else "")
            + (f" --loss-chunk {args.loss_chunk}" if args.loss_chunk else "")
        )
        cpu = machine_description().split(",")[0]
        stamp = f"{datetime.now(timezone.utc):%Y-%m-%d}, commit {commit}, {cpu}, {args.threads} threads"
        body = (
            f"## Hugging Face `Trainer`: LlamaForCausalLM {args.size}, AdamW, CoMERATrainer, GaLore "
            f"({stamp})\n\n"
            f"Machine: {machine_description()}. Command: `{command}`. {args.note}\n\n"
            f"{section_legend(args.size, args.memory_savers, args.loss_chunk)}\n\n{text}\n"
        )
        update_section(args.write, "hf-llama" + (f"-{args.label}" if args.label else ""), body)
    return 1 if any("error" in result for result in results.values()) else 0


def section_legend(size: str, savers: bool = False, loss_chunk: int | None = None) -> str:
    """What the section's columns mean."""
    from comera.integrations.hf_loss import DEFAULT_CHUNK_SIZE

    chunk = loss_chunk or DEFAULT_CHUNK_SIZE

    sizes = SIZES[size]
    return (
        f"`LlamaForCausalLM` from a `LlamaConfig` (width {sizes['hidden']}, SwiGLU "
        f"{sizes['intermediate']}, {sizes['layers']} layers, {sizes['heads']} heads, {sizes['vocab']} "
        f"tokens, {sizes['seq']}-token sequences, untied head), random token ids, each (method, batch) in "
        "a fresh process, the same `TrainingArguments` (lr 1e-3 constant, no logging, no checkpoints): "
        "`adamw` is `transformers.Trainer` with its default optimizer on the dense model; `comera` is "
        "`CoMERATrainer` on the model tensorized as the `llm` workload's `paper` preset (TT projections "
        "and head at rank 32, a TTM embedding; built on the meta device, early stage, no prune); "
        "`galore` is `transformers.Trainer` with `optimizers=(galore_torch.GaLoreAdamW(...), None)` "
        "(attention and MLP weights at rank 128, gap 200, scale 0.25). `ms / step`: median time between "
        "consecutive steps after the warm-up. `training MiB`: the resident set's peak during "
        "`trainer.train()` less the resident set after the imports (model, gradients, optimizer, "
        "activations). `peak RSS MiB`: the process's whole-life peak. `weights+opt MiB`: parameters plus "
        "optimizer state. `activations MiB`: what one training forward keeps for backward; `logits MiB`: "
        "the largest logits tensor the head returns in it (the whole `(batch, seq, vocab)` fp32 logits, or "
        "one chunk's). Ratios: GaLore's over the row's of the same batch and memory savers (above 1: the row "
        "is faster or smaller)."
        + (
            " `memory savers` yes: the same run with `gradient_checkpointing=True` and the chunked causal-LM "
            f"loss (`loss_chunk_size={chunk}`, `comera.integrations.hf_loss`; adamw and galore "
            "through `ChunkedLossTrainer`, comera through `CoMERATrainer`), the same settings for all three; "
            "activations then count the checkpointed layers' inputs."
            if savers
            else ""
        )
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
