"""The built-in demo: the same MLP trained dense, with fixed-rank comera TT layers, and rank-adaptively.

The task is a 10-class classification of 512-dimensional inputs whose labels come from a random teacher
network with tensor-train-structured weights, so a compressed student can fit it. The dense and fixed-rank
students get the same data, optimiser and number of steps; the rank-adaptive student runs CoMERA's early
stage for as many steps and a late stage toward half its size. The demo prints parameters, compression,
time per step and held-out loss/accuracy side by side, and the adaptive model's compression report.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from torch import nn

from comera.cpu import reuse_freed_memory
from comera.nn.linear import TTLinear

__all__ = ["DemoResult", "make_task", "build_mlp", "train", "evaluate", "run_demo", "main"]


@dataclass
class DemoResult:
    """What one student reached: parameters, mean step time and held-out metrics."""

    name: str
    parameters: int
    step_ms: float
    loss: float
    accuracy: float


def make_task(samples: int, features: int = 512, classes: int = 10, seed: int = 0, teacher_seed: int = 0):
    """Inputs ``(samples, features)`` and labels ``(samples,)`` from a TT-structured random teacher.

    ``seed`` draws the inputs; ``teacher_seed`` the teacher, so splits with different ``seed`` share it.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    with torch.random.fork_rng():
        torch.manual_seed(teacher_seed)
        teacher = nn.Sequential(
            TTLinear(features, 1024, rank=4), nn.GELU(), TTLinear(1024, classes, rank=4)
        ).requires_grad_(False)
        logits = teacher(inputs)
    labels = logits.argmax(dim=-1)
    return inputs, labels


def build_mlp(features: int, hidden: int, classes: int, rank: int | None) -> nn.Sequential:
    """A 3-layer GELU MLP; with ``rank`` its two large layers are ``TTLinear`` of that max rank."""

    def linear(n_in: int, n_out: int) -> nn.Module:
        return nn.Linear(n_in, n_out) if rank is None else TTLinear(n_in, n_out, rank=rank)

    return nn.Sequential(
        linear(features, hidden), nn.GELU(), linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)
    )


def train(model: nn.Module, data, steps: int, batch: int, lr: float, seed: int = 0) -> float:
    """AdamW on cross-entropy for ``steps`` minibatches; returns mean step ms (after 5 warm-up steps)."""
    inputs, labels = data
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for step in range(steps):
        index = torch.randint(0, inputs.shape[0], (batch,), generator=generator)
        start = time.perf_counter()
        loss = loss_fn(model(inputs[index]), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= 5:
            times.append(time.perf_counter() - start)
    return 1e3 * sum(times) / max(len(times), 1)


@torch.no_grad()
def evaluate(model: nn.Module, data) -> tuple[float, float]:
    """Cross-entropy and accuracy on ``data``."""
    inputs, labels = data
    logits = model(inputs)
    return nn.functional.cross_entropy(logits, labels).item(), (
        logits.argmax(-1) == labels
    ).float().mean().item()


def _train_rank_adaptive(
    model: nn.Module, data, held_out, steps: int, batch: int, seed: int, run_dir: str | None
) -> float:
    """CoMERA's two stages with the Trainer: ``steps`` early steps, ``steps // 2`` late steps to half size.

    Evaluates on ``held_out`` (loss and accuracy) five times during the run; returns wall-clock ms per step,
    evaluation and checkpoints included.
    """
    from comera.train import TrainConfig, Trainer

    def loss_fn(module: nn.Module, pair) -> torch.Tensor:
        inputs, labels = pair
        return nn.functional.cross_entropy(module(inputs), labels)

    def eval_fn(module: nn.Module, pair) -> dict[str, float]:
        loss, accuracy = evaluate(module, pair)
        return {"loss": loss, "accuracy": accuracy}

    config = TrainConfig(
        early=steps,
        late=steps // 2,
        unit="step",
        gamma=0.3,
        lr_cores=1e-3,
        lr_gates=1e-2,
        lr_other=1e-3,
        target_ratio=0.5,
        prune_at=("early_end", "end"),
        batch_size=batch,
        seed=seed,
        run_dir=run_dir,
        compile=False,
        log_every=max(steps // 20, 1),
        eval_every=max((steps + steps // 2) // 5, 1),
    )
    start = time.perf_counter()
    dataset, held_out = (torch.utils.data.TensorDataset(*pair) for pair in (data, held_out))
    Trainer(model, loss_fn, dataset, eval_data=held_out, eval_fn=eval_fn, config=config).fit()
    return 1e3 * (time.perf_counter() - start) / (steps + steps // 2)


def run_demo(
    steps: int = 300, batch: int = 256, rank: int = 8, seed: int = 0, run_dir: str | None = "runs/demo"
) -> list[DemoResult]:
    """Train a dense, a fixed-rank comera and a rank-adaptive comera student; print and return results.

    The rank-adaptive student runs CoMERA's early and late stages through :class:`comera.train.Trainer`
    and writes its metrics and plots to ``run_dir`` (None: no files).
    """
    from comera.report import compression_report

    features, hidden, classes = 512, 1024, 10
    train_data = make_task(16384, features, classes, seed=seed, teacher_seed=seed)
    held_out = make_task(4096, features, classes, seed=seed + 100, teacher_seed=seed)
    results = []
    for name, student_rank in (("dense nn.Linear", None), (f"comera TT r={rank}", rank)):
        torch.manual_seed(seed)
        model = build_mlp(features, hidden, classes, student_rank)
        step_ms = train(model, train_data, steps, batch, lr=1e-3, seed=seed)
        loss, accuracy = evaluate(model, held_out)
        parameters = sum(p.numel() for p in model.parameters())
        results.append(DemoResult(name, parameters, step_ms, loss, accuracy))
    torch.manual_seed(seed)
    adaptive = build_mlp(features, hidden, classes, rank)
    step_ms = _train_rank_adaptive(adaptive, train_data, held_out, steps, batch, seed, run_dir)
    report = compression_report(adaptive)
    loss, accuracy = evaluate(adaptive, held_out)
    results.append(
        DemoResult(f"comera rank-adaptive r<={rank}", report.model_params, step_ms, loss, accuracy)
    )

    dense = results[0]
    print(
        f"{'model':<30} {'params':>10} {'compression':>12} {'step ms':>9} {'held-out loss':>14} "
        f"{'accuracy':>9}"
    )
    for result in results:
        print(
            f"{result.name:<30} {result.parameters:>10,} {dense.parameters / result.parameters:>11.1f}x "
            f"{result.step_ms:>9.2f} {result.loss:>14.4f} {result.accuracy:>9.3f}"
        )
    print(f"step time ratio dense / comera TT: {dense.step_ms / results[1].step_ms:.2f}x")
    print(f"\nrank-adaptive student after the early and late stages (pruned):\n{report}")
    if run_dir is not None:
        print(f"metrics and plots: {run_dir}/")
    return results


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``comera demo [--steps N] [--rank R]``."""
    parser = argparse.ArgumentParser(prog="comera demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps per model (>= 10)")
    parser.add_argument("--rank", type=int, default=8, help="max TT rank of the comera students (>= 1)")
    parser.add_argument("--run-dir", default="runs/demo", help="metrics and plots of the rank-adaptive run")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error(f"--steps must be >= 10, got {args.steps}")
    if args.rank < 1:
        parser.error(f"--rank must be >= 1, got {args.rank}")
    reuse_freed_memory()
    run_demo(steps=args.steps, rank=args.rank, run_dir=args.run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
