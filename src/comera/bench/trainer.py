"""Trainer benchmark on a small transformer built from comera layers: the Trainer's overhead against a
hand-written loop (target <= 3 %), and eager against ``torch.compile`` of the training step. Details:
docs/benchmarks.md, "Trainer: overhead and torch.compile, fp32"."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from comera.measure import machine_description, markdown_file_argument, update_section
from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.nn.linear import TTLinear
from comera.rank.adaptation import RankAdaptation
from comera.rank.groups import param_groups
from comera.train import TrainConfig, Trainer

VOCAB, D_MODEL, HEADS, FFN, BLOCKS, SEQ, BATCH, CLASSES, RANK = 512, 128, 4, 512, 2, 32, 32, 3, 8
RATES = {"lr_cores": 1e-3, "lr_gates": 1e-3, "lr_other": 1e-3}


class Block(nn.Module):
    """Post-LN encoder block whose projections and FFN are ``TTLinear`` layers."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value, self.out = (TTLinear(D_MODEL, D_MODEL, rank=RANK) for _ in range(4))
        self.up, self.down = TTLinear(D_MODEL, FFN, rank=RANK), TTLinear(FFN, D_MODEL, rank=RANK)
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t):
            return t.view(batch, length, HEADS, D_MODEL // HEADS).transpose(1, 2)

        attended = nn.functional.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        )
        x = self.norm1(x + self.out(attended.transpose(1, 2).reshape(batch, length, D_MODEL)))
        return self.norm2(x + self.down(nn.functional.gelu(self.up(x))))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``BLOCKS`` blocks, mean pooling, linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tokens(ids) + self.positions).mean(dim=1))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return nn.functional.cross_entropy(model(ids), labels)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def make_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (steps, BATCH, SEQ), generator=generator)
    labels = torch.randint(CLASSES, (steps, BATCH), generator=generator)
    return list(zip(ids, labels))


class HandLoop:
    """The hand-written loop, one step at a time: RankAdaptation objective, backward, AdamW step."""

    def __init__(self) -> None:
        self.model = make_model()
        self.rank = RankAdaptation(self.model)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, **RATES))

    def step(self, batch) -> None:
        self.rank.loss(loss_fn(self.model, batch)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def trainer(batches: list, compile_step: bool = False, callbacks=()) -> Trainer:
    config = TrainConfig(
        early=len(batches), unit="step", progress=False, compile=compile_step, lr_other=RATES["lr_other"]
    )
    model = make_model()
    settings = CoMERASettings(prune_at=(), lr_cores=RATES["lr_cores"], lr_gates=RATES["lr_gates"])
    objective = CoMERAObjective(model, settings)
    return Trainer(model, loss_fn, batches, config=config, objective=objective, callbacks=callbacks)


def overhead(steps: int) -> dict[str, float]:
    """ms per step of the Trainer and of the hand loop, interleaved step by step: a Trainer callback times one
    hand-loop step on the same batch, and the Trainer's step is the time between consecutive callbacks."""
    hand = HandLoop()
    hand_times: list[float] = []
    trainer_times: list[float] = []
    finished: list[float] = []

    def interleave(run: Trainer) -> None:
        now = time.perf_counter()
        if finished:
            trainer_times.append(now - finished[-1])
        start = time.perf_counter()
        hand.step(batches[run.step - 1])
        hand_times.append(time.perf_counter() - start)
        finished.append(time.perf_counter())

    batches = make_batches(steps + 1)
    trainer(batches, callbacks=[interleave]).fit()
    hand_times = hand_times[1:]
    result = {
        "hand_ms": 1e3 * statistics.median(hand_times),
        "trainer_ms": 1e3 * statistics.median(trainer_times),
    }
    result["median_pct"] = 100 * (result["trainer_ms"] / result["hand_ms"] - 1)
    result["total_pct"] = 100 * (sum(trainer_times) / sum(hand_times) - 1)
    return result


def step_times(steps: int, warmup: int, compile_step: bool) -> dict[str, float]:
    """Median ms per step after ``warmup`` steps, the seconds the warm-up took and the peak RSS in MiB."""
    stamps: list[float] = []
    run = trainer(make_batches(warmup + steps), compile_step, [lambda _: stamps.append(time.perf_counter())])
    start = time.perf_counter()
    run.fit()
    intervals = [later - earlier for earlier, later in zip(stamps[warmup:], stamps[warmup + 1 :])]
    return {
        "step_ms": 1e3 * statistics.median(intervals),
        "warmup_s": stamps[warmup - 1] - start,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def step_times_in_fresh_process(steps: int, threads: int, compile_step: bool) -> dict[str, float]:
    """:func:`step_times` run in a new interpreter, so its peak memory is its own."""
    command = [sys.executable, "-m", "comera.bench.trainer", "--steps", str(steps), "--threads", str(threads)]
    command += ["--case", "compiled" if compile_step else "eager"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def payoff(eager: dict[str, float], compiled: dict[str, float]) -> str:
    """When the compiled step is faster: after how many steps its extra warm-up time is paid back."""
    saved_s = (eager["step_ms"] - compiled["step_ms"]) / 1e3
    if saved_s <= 0:
        return " The compiled step is not faster here."
    extra_s = compiled["warmup_s"] - eager["warmup_s"]
    return f" Compiling pays for itself after about {max(0.0, extra_s) / saved_s:.0f} steps."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is steadiest on shared CPUs)"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    parser.add_argument(
        "--write",
        type=markdown_file_argument,
        metavar="MARKDOWN",
        help="update the 'trainer' section of this file",
    )
    parser.add_argument("--case", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    if args.case is not None:
        print(json.dumps(step_times(args.steps, 3, args.case == "compiled")))
        return 0
    print(machine_description())
    cost = overhead(args.steps)
    lines = [
        "| loop | ms / step (median) |",
        "|---|---|",
        f"| hand-written (objective, backward, AdamW) | {cost['hand_ms']:.2f} |",
        f"| `Trainer.fit` | {cost['trainer_ms']:.2f} ({cost['median_pct']:+.1f} % median, "
        f"{cost['total_pct']:+.1f} % total) |",
    ]
    if not args.no_compile:
        eager = step_times_in_fresh_process(args.steps, args.threads, False)
        compiled = step_times_in_fresh_process(args.steps, args.threads, True)
        lines += [
            "",
            "| step | ms / step (steady) | first 3 steps, s | peak RSS, MiB |",
            "|---|---|---|---|",
            f"| eager | {eager['step_ms']:.2f} | {eager['warmup_s']:.1f} | {eager['peak_mib']:.0f} |",
            f"| `torch.compile` (inductor) | {compiled['step_ms']:.2f} | {compiled['warmup_s']:.1f} | "
            f"{compiled['peak_mib']:.0f} |",
            "",
            f"Compiled / eager step time: {compiled['step_ms'] / eager['step_ms']:.2f}."
            + payoff(eager, compiled),
        ]
    table = "\n".join(lines)
    print(table)
    if args.write:
        body = (
            "## Trainer: overhead and torch.compile, fp32\n\n"
            f"Machine: {machine_description()}. Command: `comera bench trainer --steps "
            f"{args.steps} --threads {args.threads}`. Model: {BLOCKS} post-LN "
            f"encoder blocks, d_model {D_MODEL}, {HEADS} heads, FFN {FFN}, all projections `TTLinear` "
            f"(rank {RANK}), batch {BATCH} x {SEQ} tokens. Overhead: {args.steps} steps of each loop, "
            "interleaved step by step (median step; total). Compile: each mode in a fresh process, median "
            "step after 3 warm-up steps (which include compilation), peak resident memory of the process. "
            "Both loops use the Trainer's default CPU allocation setting (`reuse_cpu_memory=True`).\n\n"
            f"{table}\n"
        )
        update_section(args.write, "trainer", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
