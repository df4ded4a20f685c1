"""Training memory of a model that is never dense against GaLore's, at batch 1
(``python -m comera.bench.meta_memory``): Hugging Face ``BertForSequenceClassification`` at the paper's sizes,
built on the meta device and tensorized for comera, dense under ``GaLoreAdamW``, each in a fresh process.
Details: docs/benchmarks.md, "Training memory of a model that is never dense (batch 1)"."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from comera.measure import peak_rise_mib
from comera.rank import RankAdaptation, param_groups
from comera.tensorize import materialize_, tensorize_

__all__ = ["PAPER", "QUICK", "METHODS", "build_galore", "build_comera", "run_case", "main"]

PAPER = {
    "model": dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072
    ),
    "tokens": 128,
    "linear_rank": 30,
    "embedding_rank": 32,
    "embedding_shapes": {"row_shape": (16, 20, 10, 10), "col_shape": (4, 4, 8, 6)},
}
"""The paper's sizes."""
QUICK = {
    "model": dict(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    ),
    "tokens": 16,
    "linear_rank": 8,
    "embedding_rank": 8,
    "embedding_shapes": {"row_shape": (10, 10, 10), "col_shape": (4, 4, 4)},
}
"""A tiny model for a smoke check."""
METHODS = ("galore", "comera")
GALORE = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}


def build_galore(sizes: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The dense model and ``GaLoreAdamW`` (GaLore groups for the encoder linears' weights)."""
    from galore_torch import GaLoreAdamW

    model = BertForSequenceClassification(BertConfig(**sizes["model"]))
    projected = [
        module.weight
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("bert.encoder.")
    ]
    chosen = {id(weight) for weight in projected}
    rest = [param for param in model.parameters() if id(param) not in chosen]
    groups = [{"params": rest}, {"params": projected, **GALORE}]
    return model, GaLoreAdamW(groups, lr=1e-4, no_deprecation_warning=True), None


def build_comera(sizes: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model built on the meta device, tensorized, materialised; AdamW and CoMERA's objective."""
    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(**sizes["model"]))
    tensorize_(
        model,
        init="random",
        rank=sizes["linear_rank"],
        embeddings=("bert.embeddings.word_embeddings",),
        rank_pattern={"word_embeddings": sizes["embedding_rank"]},
        shape_pattern={"word_embeddings": sizes["embedding_shapes"]},
    )
    materialize_(model)
    adaptation = RankAdaptation(model, gamma=1e-3)
    optimizer = torch.optim.AdamW(param_groups(model, lr_cores=1e-3, lr_gates=1e-2, lr_other=1e-4))
    return model, optimizer, adaptation


def run_case(method: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """Training memory (MiB: the peak resident set over the build and one step, less the resident set after
    the imports) and second-step time of ``method``, in this process."""
    build = {"galore": build_galore, "comera": build_comera}[method]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, sizes["model"]["vocab_size"], (1, sizes["tokens"]), generator=generator)
    labels = torch.zeros(1, dtype=torch.long)
    state: dict[str, Any] = {}

    def step() -> None:
        model, optimizer, adaptation = state["parts"]
        loss = model(input_ids=ids, labels=labels).loss
        if adaptation is not None:
            loss = adaptation.loss(loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def build_and_step() -> None:
        torch.manual_seed(0)
        state["parts"] = build(sizes)
        state["parts"][0].train()
        step()

    train_mib = peak_rise_mib(build_and_step)
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    model = state["parts"][0]
    return {
        "method": method,
        "train_mib": train_mib,
        "step_s": seconds,
        "params": sum(param.numel() for param in model.parameters()),
        "threads": torch.get_num_threads(),
    }


def _fresh(method: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "comera.bench.meta_memory", "--case", method]
    command += ["--quick"] if args.quick else []
    command += ["--threads", str(args.threads)] if args.threads is not None else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {method} case failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run each method in a fresh process and print its memory, step time and the memory ratio."""
    parser = argparse.ArgumentParser(prog="python -m comera.bench.meta_memory", description=__doc__)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (smoke check)")
    parser.add_argument("--case", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else PAPER
    if args.case:
        print(json.dumps(run_case(args.case, sizes)))
        return 0
    results = {method: _fresh(method, args) for method in args.methods}
    for row in results.values():
        print(
            f"{row['method']:>7}: training memory {row['train_mib']:8.1f} MiB, step {row['step_s']:.3f} s, "
            f"{row['params']:,} parameters, {row['threads']} threads"
        )
    if {"galore", "comera"} <= set(results):
        ratio = results["galore"]["train_mib"] / max(results["comera"]["train_mib"], 1e-9)
        print(f"memory galore / comera: {ratio:.2f}x (target: at least 9x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
