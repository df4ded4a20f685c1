"""``comera bench transformer``: one training step of the six-encoder transformer, dense against comera.
Each case (method x batch size) runs in a fresh process on random token batches of length 128: median step
time, training memory, whole-process peak and the top operators of a profiled step. Details:
docs/benchmarks.md, 'Transformer training step'.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from comera.cpu import reuse_freed_memory
from comera.measure import (
    add_memory_argument,
    allocation_of,
    machine_description,
    markdown_file_argument,
    median_ms,
    peak_rise_mib,
    profile_steps,
    status_mib,
    update_section,
)
from comera.tensorize import tensorize_
from comera.train.config import TrainConfig
from comera.train.objective import default_objective
from comera.train.setup import default_optimizer

__all__ = ["run_case", "main"]

METHODS = ("dense", "comera")
SEQUENCE = 128


def build(method: str, preset: str = "paper") -> nn.Module:
    """The preset's model, dense or tensorized by ``nli-PRESET`` (random cores: training from scratch)."""
    from comera.workloads.nli.model import TransformerClassifier
    from comera.workloads.nli.presets import TENSORIZE_PRESETS

    torch.manual_seed(0)
    model = TransformerClassifier.from_preset(preset)
    if method == "comera":
        tensorize_(model, TENSORIZE_PRESETS[f"nli-{preset}"])
    return model


def _batch(model: nn.Module, batch: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    return {
        "input_ids": torch.randint(5, vocab, (batch, length), generator=generator),
        "token_type_ids": (torch.arange(length) >= length // 2).long().expand(batch, length).contiguous(),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "labels": torch.randint(0, model.config.num_classes, (batch,), generator=generator),
    }


def _top_operators(step, count: int = 8) -> list[dict[str, Any]]:
    """The ``count`` operators of one profiled ``step`` with the most self time: ``op``, ``ms``, ``calls`` and
    ``share`` (of all operators' self time)."""
    profile = profile_steps(step, 1, top=count)
    total = profile["ms"] or 1.0
    return [{**entry, "share": entry["ms"] / total} for entry in profile["top"]]


def run_case(
    method: str,
    batch: int,
    repeats: int,
    preset: str = "paper",
    length: int = SEQUENCE,
    memory: str = "reuse",
) -> dict:
    """Time and memory of one training step in this process."""
    model = build(method, preset)
    model.train()
    objective = default_objective(model)
    optimizer = default_optimizer(objective, TrainConfig())
    inputs = _batch(model, batch, length)
    labels = inputs.pop("labels")

    def step() -> None:
        logits = model(**inputs)
        loss = objective.loss(nn.functional.cross_entropy(logits, labels))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    built = status_mib("VmRSS", missing=float("nan"))
    start = time.perf_counter()
    rise = peak_rise_mib(step)
    first = time.perf_counter() - start
    repeats = max(3, min(repeats, int(120.0 / max(first, 1e-3))))
    if memory == "reuse":
        reuse_freed_memory()
    return {
        "method": method,
        "batch": batch,
        "preset": preset,
        "memory": memory,
        "ms": median_ms(step, repeats=repeats, warmup=1),
        "train_mib": rise,
        "peak_mib": status_mib("VmHWM", missing=float("nan")),
        "model_mib": built,
        "parameters": sum(param.numel() for param in model.parameters()),
        "top": _top_operators(step),
    }


def _fresh(method: str, batch: int, repeats: int, threads: int | None, preset: str, memory: str) -> dict:
    command = [sys.executable, "-m", "comera.workloads.nli.bench", "--case", f"{method}:{batch}"]
    command += ["--repeats", str(repeats), "--preset", preset, "--memory", memory]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {method}:{batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_report(results: list[dict], command: str) -> str:
    """Markdown: one row per batch size with dense and comera side by side, then each case's top ops."""
    by_case = {(r["method"], r["batch"]): r for r in results}
    lines = [
        "## Transformer training step (six encoders)",
        "",
        f"Machine: {machine_description()}. Command: `{command}`. Each case in a fresh process; median step "
        "time after warm-up (timed steps' allocation: "
        f"{allocation_of(results)}); `train` = peak resident rise during a step "
        "over the built model.",
        "",
        "| batch | dense ms | comera ms | dense / comera | dense train MiB | comera train MiB "
        "| dense / comera memory | parameters dense / comera |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["batch"] for r in results}):
        dense, comera = by_case.get(("dense", batch)), by_case.get(("comera", batch))
        if dense is None or comera is None:
            continue
        lines.append(
            f"| {batch} | {dense['ms']:.0f} | {comera['ms']:.0f} | {dense['ms'] / comera['ms']:.2f}x | "
            f"{dense['train_mib']:.0f} | {comera['train_mib']:.0f} | "
            f"{dense['train_mib'] / max(comera['train_mib'], 1e-9):.2f}x | "
            f"{dense['parameters']:,} / {comera['parameters']:,} |"
        )
    for result in results:
        top = ", ".join(f"{op['op']} {op['share']:.0%}" for op in result["top"][:6])
        lines.append(f"\n- {result['method']} B={result['batch']}: {top}")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="comera bench transformer", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--preset", default="paper", help="model preset (paper, small, smoke)")
    add_memory_argument(parser)
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        default=None,
        help="update the 'transformer' section of this markdown file",
    )
    parser.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``comera bench transformer``."""
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.case is not None:
        method, batch = args.case.split(":")
        print(json.dumps(run_case(method, int(batch), args.repeats, args.preset, memory=args.memory)))
        return 0
    results = [
        _fresh(method, batch, args.repeats, args.threads, args.preset, args.memory)
        for batch in args.batches
        for method in args.methods
    ]
    command = "comera bench transformer " + " ".join(argv if argv is not None else sys.argv[1:])
    report = format_report(results, command.strip())
    print(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    if args.write:
        update_section(args.write, "transformer", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
