"""``Trainer``: CoMERA's two training stages for any model and loss, with checkpoints that never lose work.

One step, top to bottom: ``loss_fn(model, batch)`` gives the task loss; :meth:`comera.RankAdaptation.loss`
turns it into the stage's objective; backward; the non-finite guard checks ``objective + gradient norm``
(one host sync, which also fetches the logged numbers); the optimizer steps or the step is skipped.

Between steps, in this order: a metrics record every ``log_every`` steps; at an epoch end, pruning if
configured; at the end of the early stage, pruning (``"early_end"``) and the switch to the late stage; at the
last step, pruning (``"end"``); evaluation and checkpoint when due; then the callbacks. A prune that changes
the model is followed by a checkpoint (when checkpoints are on), so a rollback never has to grow a layer.

With ``config.cuda_graph`` the whole step (guard included) is a replayed CUDA graph
(:class:`comera.train.cuda_graph.CudaGraphStep`) that hands back its four numbers; the graphs are dropped and
recaptured after a prune that changes the model, at the switch to the late stage and after loading a
checkpoint.

Distributed data parallel (``torchrun``; the process group must use nccl for a CUDA model, gloo for a CPU one,
see :func:`comera.train.distributed.backend_for`): when a process group with several ranks
is running, the model is wrapped in ``DistributedDataParallel`` (rebuilt at every prune point),
a map-style dataset is sharded by rank, the task loss the objective reads is averaged over ranks (so the
late-stage switch and targets agree), rank 0 alone writes metrics, plots and checkpoints (which hold every
rank's RNG state), and evaluation sums over all ranks.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from comera.cpu import reuse_freed_memory
from comera.modules import unwrap_model
from comera.nn.linear import TTLinear
from comera.rank.adaptation import RankAdaptation
from comera.rank.groups import param_groups
from comera.rank.prune import prune_
from comera.rank.size import gated_trains
from comera.train.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    capture_rng,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from comera.train.config import AUTO_COMPILE_MIN_STEPS, TrainConfig
from comera.train.cuda_graph import CudaGraphStep, capturable_adam
from comera.train.data import EpochData
from comera.train.distributed import barrier, check_backend, gather_objects, globally_averaged, world
from comera.train.guard import NonFiniteGuard, total_grad_norm
from comera.train.metrics import MetricsLog, peak_memory_mib
from comera.train.structure import apply_structure, model_structure
from comera.version import __version__

__all__ = ["Trainer", "FitResult"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
EvalFn = Callable[[nn.Module, Any], Mapping[str, Any]]
_END = object()


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` reached: final step, stage, size ratio, last evaluation, guard counters."""

    step: int
    stage: str
    size: int
    ratio: float
    eval: dict[str, float] = field(default_factory=dict)
    nonfinite: int = 0
    rollbacks: int = 0


def _graph_device(device: torch.device) -> bool:
    """Whether a model on ``device`` can run its step as a CUDA graph."""
    return device.type == "cuda"


def _with_last(batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    iterator = iter(batches)
    current = next(iterator, _END)
    while current is not _END:
        following = next(iterator, _END)
        yield current, following is _END
        current = following


class Trainer:
    """Runs the early stage, then the late stage when ``config.late > 0``, on any model with gated layers.

    Args:
        model: the model (``torch.compile`` / DDP wrappers allowed); it must contain comera gated layers.
        loss_fn: ``loss_fn(model, batch) -> 0-dim task loss``; it moves the batch to the model's device.
        train_data: a map-style dataset (batched with ``config.batch_size``) or a re-iterable of batches
            (a ``DataLoader``); see :mod:`comera.train.data` for the reproducibility contract.
        config: a :class:`TrainConfig`.
        eval_data: dataset or iterable of batches for evaluation, or None.
        eval_fn: ``eval_fn(model, batch) -> {name: number}``, averaged over batches; default
            ``{"loss": loss_fn(model, batch)}``.
        optimizer: default AdamW on :func:`comera.param_groups` with the config's rates (``capturable=True``
            with ``config.cuda_graph``). A custom optimizer must hold the model's parameters; pruning slices
            its state in place. With ``config.cuda_graph`` it must be AdamW or Adam with ``capturable=True``.
        collate_fn: batching of dataset samples (default ``torch.utils.data.default_collate``).
        callbacks: ``callback(trainer)`` after every step's bookkeeping.

    Attributes:
        step, epoch, batch_in_epoch: progress (steps done, epochs done, batches done in this epoch).
        rank: the :class:`comera.RankAdaptation` driving the objective.
        guard: the :class:`comera.train.guard.NonFiniteGuard` with its counters.
        graph_step: the :class:`comera.train.cuda_graph.CudaGraphStep` running each step, or None (eager or
            compiled step). A callback that changes learning rates must call its ``invalidate()``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        train_data: Any,
        *,
        config: TrainConfig | None = None,
        eval_data: Any = None,
        eval_fn: EvalFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        callbacks: Iterable[Callable[[Trainer], None]] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
            )
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable or None, got {type(eval_fn).__name__}")
        config = TrainConfig() if config is None else config
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        if isinstance(model, DistributedDataParallel):
            raise TypeError(
                "model must not be wrapped in DistributedDataParallel: pass the plain model; the Trainer "
                "wraps it itself because it must rebuild the wrapper after pruning"
            )
        self.config = config
        self.model = model
        self.module = unwrap_model(model)
        self.loss_fn = loss_fn
        self.eval_fn = eval_fn
        self.callbacks = list(callbacks)
        self.process_rank, self.world_size = world()
        if config.cuda_graph and self.world_size > 1:
            raise ValueError(
                "cuda_graph=True supports single-process runs only, got a process group of "
                f"{self.world_size} ranks (DDP): the captured step has no gradient all-reduce; "
                "set cuda_graph=False"
            )
        if self.world_size > 1:
            check_backend(self._device())
            self.model = DistributedDataParallel(self.module)
        self.rank = RankAdaptation(
            self.module, gamma=config.gamma, tau=config.tau, surrogate=config.surrogate
        )
        self.optimizer = optimizer or torch.optim.AdamW(
            param_groups(
                self.module,
                lr_cores=config.lr_cores,
                lr_gates=config.lr_gates,
                lr_other=config.lr_other,
                weight_decay=config.weight_decay,
            ),
            capturable=config.cuda_graph,
        )
        batching = {
            "batch_size": config.batch_size,
            "seed": config.seed,
            "collate_fn": collate_fn,
            "rank": self.process_rank,
            "world_size": self.world_size,
        }
        self.train_data = EpochData(
            train_data, shuffle=config.shuffle, drop_last=config.drop_last, **batching
        )
        if not self.train_data.has_length():
            if config.unit == "epoch":
                raise ValueError(
                    "train_data must have a len() (batches per epoch) to count stages in epochs; "
                    "use unit='step' for data without one"
                )
        elif len(self.train_data) == 0:
            raise ValueError(
                "train_data yields no batches (empty, or fewer samples than batch_size with drop_last)"
            )
        if config.cuda_graph and config.graph_buckets is None and self.train_data.is_dataset:
            samples = self.train_data.shard_size()
            if not config.drop_last and samples % config.batch_size:
                raise ValueError(
                    f"cuda_graph=True without graph_buckets needs batches of one shape, but train_data's "
                    f"{samples} samples leave a last batch of {samples % config.batch_size} (batch_size="
                    f"{config.batch_size}): set drop_last=True, or graph_buckets and graph_pad"
                )
        self.eval_data = (
            None
            if eval_data is None
            else EpochData(eval_data, shuffle=False, drop_last=False, equal_shards=False, **batching)
        )
        run_dir = None if config.run_dir is None else Path(config.run_dir)
        self.run_dir = run_dir
        self.checkpoint_dir = (
            Path(config.checkpoint_dir)
            if config.checkpoint_dir is not None
            else (None if run_dir is None else run_dir / "checkpoints")
        )
        self.metrics = MetricsLog(run_dir if self.process_rank == 0 else None)
        self.guard = NonFiniteGuard(config.max_nonfinite, config.max_rollbacks)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.last_eval: dict[str, float] = {}
        self._bf16 = config.precision == "bf16"
        if config.precision == "fp8":
            for layer in self.module.modules():
                if isinstance(layer, TTLinear):
                    layer.gemm = "fp8"
        self._device_type = self._device().type
        if config.reuse_cpu_memory and self._device_type == "cpu":
            reuse_freed_memory()
        self._compute, self._apply = self._step_functions()
        self.graph_step = self._graph_step() if config.cuda_graph else None
        self._window = {"loss": 0.0, "objective": 0.0, "count": 0, "time": 0.0, "steps": 0}
        self._bar = None

    # lengths
    def _steps(self, length: int) -> int:
        return length * len(self.train_data) if self.config.unit == "epoch" else length

    @property
    def early_steps(self) -> int:
        """Steps of the early stage."""
        return self._steps(self.config.early)

    @property
    def total_steps(self) -> int:
        """Steps of the whole run (early + late)."""
        return self._steps(self.config.early) + self._steps(self.config.late)

    # one step
    def _forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self._device_type, dtype=torch.bfloat16, enabled=self._bf16):
            task = globally_averaged(self.loss_fn(self.model, batch))
            objective = self.rank.loss(task)
        objective.backward()
        return task.detach(), objective.detach()

    def compiles(self) -> bool:
        """Whether the training step runs under ``torch.compile`` (``config.compile``, "auto" resolved)."""
        if self.config.cuda_graph:
            return False
        if self.config.compile == "auto":
            return self._device_type == "cpu" and self.total_steps >= AUTO_COMPILE_MIN_STEPS
        return bool(self.config.compile)

    def _step_functions(self):
        if not self.compiles():
            return self._forward_backward, self.optimizer.step
        backend = self.config.compile_backend
        return (
            torch.compile(self._forward_backward, backend=backend),
            torch.compile(self.optimizer.step, backend=backend),
        )

    def _graph_step(self) -> CudaGraphStep:
        device = self._device()
        if not _graph_device(device):
            raise ValueError(f"cuda_graph needs a CUDA model; on CPU use compile (the model is on {device})")
        if not capturable_adam(self.optimizer):
            raise ValueError(
                "optimizer must be torch.optim.AdamW or torch.optim.Adam built with capturable=True in every "
                f"param group when cuda_graph=True, got {type(self.optimizer).__name__}"
            )
        config = self.config
        return CudaGraphStep(
            self.module,
            self.loss_fn,
            self.optimizer,
            self.rank,
            buckets=config.graph_buckets,
            pad=config.graph_pad,
            length_dim=config.graph_length_dim,
            grad_clip=config.grad_clip,
            warmup=config.graph_warmup,
            autocast_dtype=torch.bfloat16 if self._bf16 else None,
        )

    def _invalidate_graph(self) -> None:
        if self.graph_step is not None:
            self.graph_step.invalidate()

    def _parameters(self) -> list[torch.Tensor]:
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def _eager_step(self, batch: Any) -> tuple[float, float, bool]:
        saved_average = self.rank.loss_average_state()
        task, objective = self._compute(batch)
        params = self._parameters()
        norm = total_grad_norm(params).to(objective.device)
        values = torch.stack([task.float(), objective.float(), norm.float()]).tolist()
        finite = NonFiniteGuard.is_finite(values[1] + values[2])
        if finite:
            if self.config.grad_clip is not None:
                torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
            self._apply()
        else:
            self.rank.restore_loss_average(saved_average)
        self.optimizer.zero_grad(set_to_none=True)
        return values[0], values[1], finite

    def train_step(self, batch: Any) -> bool:
        """Forward, objective, backward and (if everything is finite) the optimizer step; True if applied.

        With ``config.cuda_graph`` this is one replay of :attr:`graph_step` (a capture first when needed) on
        the unwrapped model; gradients then stay in the graph's memory between steps instead of being set
        to None.
        """
        start = time.perf_counter()
        if self.graph_step is None:
            task, objective, finite = self._eager_step(batch)
        else:
            task, objective, _, applied = self.graph_step.step(batch).tolist()
            finite = applied == 1.0
        if finite:
            self._window["loss"] += task
            self._window["objective"] += objective
            self._window["count"] += 1
        self._window["time"] += time.perf_counter() - start
        self._window["steps"] += 1
        return finite

    # the run
    def fit(self, resume: bool | str | Path = False) -> FitResult:
        """Train to ``total_steps``.

        Args:
            resume: False starts fresh (seeding torch, ``random`` and numpy with ``config.seed``); True
                continues from the latest checkpoint in the checkpoint folder if there is one (else starts
                fresh); a path continues from that checkpoint file.
        """
        if resume is False:
            self._seed()
        else:
            path = latest_checkpoint(self.checkpoint_dir) if resume is True and self.checkpoint_dir else None
            if resume is not True:
                path = Path(resume)
            if path is None:
                self._seed()
            else:
                self._restore(load_checkpoint(path), rollback=False)
                self.metrics.drop_after(self.step)
                self._event("resume", checkpoint=str(path))
        total = self.total_steps
        self.model.train()
        if self.step == 0 and self.early_steps == 0 and self.rank.stage == "early":
            self._begin_late_stage()
        progress = sys.stderr.isatty() if self.config.progress is None else self.config.progress
        progress = progress and self.process_rank == 0
        self._bar = tqdm(
            total=total, initial=self.step, disable=not progress, dynamic_ncols=True, unit="step"
        )
        try:
            while self.step < total:
                self._run_epoch(total)
        finally:
            self._bar.close()
            self._bar = None
        if self.run_dir is not None and self.config.plot and self.process_rank == 0:
            self._plot()
        size = self.rank.size()
        return FitResult(
            step=self.step,
            stage=self.rank.stage,
            size=size,
            ratio=size / self.rank.initial_size,
            eval=dict(self.last_eval),
            nonfinite=self.guard.total,
            rollbacks=self.guard.rollbacks,
        )

    def _run_epoch(self, total: int) -> None:
        ran = False
        for batch, last in _with_last(self.train_data.epoch(self.epoch, self.batch_in_epoch)):
            ran = True
            finite = self.train_step(batch)
            self.step += 1
            self.batch_in_epoch += 1
            self._bar.update(1)
            if self.guard.record(finite):
                self._rollback()
                return
            self._after_step(epoch_end=last)
            if self.step >= total:
                return
        if not ran:
            raise ValueError(
                f"train_data yielded no batches in epoch {self.epoch} from batch {self.batch_in_epoch}"
            )

    def _after_step(self, epoch_end: bool) -> None:
        config = self.config
        last_step = self.step == self.total_steps
        if self.step % config.log_every == 0 or last_step:
            self._log_train()
        pruned = False
        if epoch_end:
            self.epoch += 1
            self.batch_in_epoch = 0
            late_epoch = self.rank.stage == "late" and "late_epoch" in config.prune_at
            if "epoch" in config.prune_at or late_epoch:
                pruned |= self._prune("epoch_end")
        if self.step == self.early_steps and config.late > 0 and self.rank.stage == "early":
            if "early_end" in config.prune_at:
                pruned |= self._prune("early_end")
            self._begin_late_stage()
        if last_step and "end" in config.prune_at:
            pruned |= self._prune("end")
        if self.eval_data is not None and self._due(config.eval_every, epoch_end, last_step):
            self._log_eval()
        if self.checkpoint_dir is not None and (
            pruned or self._due(config.checkpoint_every, epoch_end, last_step)
        ):
            self.save_checkpoint()
        for callback in self.callbacks:
            callback(self)

    def _due(self, every: int | None, epoch_end: bool, last_step: bool) -> bool:
        return last_step or (epoch_end if every is None else self.step % every == 0)

    def _seed(self) -> None:
        torch.manual_seed(self.config.seed)
        random.seed(self.config.seed)
        np.random.seed(self.config.seed)

    def _begin_late_stage(self) -> None:
        config = self.config
        self.rank.begin_late_stage(config.target_ratio, config.target_loss, config.rho, config.ema)
        self._invalidate_graph()
        self._event("late_stage", target_size=self.rank.target_size, target_loss=self.rank.target_loss)

    def _prune(self, point: str) -> bool:
        if self.world_size > 1:
            self._drop_ddp_wrapper()
        result = prune_(self.module, self.optimizer)
        if self.world_size > 1:
            self.model = DistributedDataParallel(self.module)
        if result.changed:
            self._invalidate_graph()
            self._event(
                "prune",
                point=point,
                stored_before=result.stored_before,
                stored_after=result.stored_after,
                removed=list(result.removed),
                layers={layer.name: list(layer.ranks_after) for layer in result.layers},
            )
        return result.changed

    def _drop_ddp_wrapper(self) -> None:
        """Free the DDP wrapper before pruning: it keeps the parameters' gradient accumulators alive, and
        those would still expect the old shapes after :func:`comera.prune_` swaps the parameters' data."""
        self.model = self.module
        gc.collect()

    # evaluation
    def evaluate(self) -> dict[str, float]:
        """Mean of ``eval_fn`` (default: the task loss) over the evaluation data; ``{}`` without eval data.

        Runs in eval mode without gradients on the unwrapped model; the global RNG state is left as it was.
        Under DDP each rank evaluates its shard and the means cover all ranks' batches.
        """
        if self.eval_data is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        sums: dict[str, float] = {}
        count = 0
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for batch in self.eval_data.epoch(0):
                    values = (
                        self.eval_fn(self.module, batch)
                        if self.eval_fn is not None
                        else {"loss": self.loss_fn(self.module, batch)}
                    )
                    for name, value in values.items():
                        sums[name] = sums.get(name, 0.0) + float(value)
                    count += 1
        finally:
            self.model.train(was_training)
        totals: dict[str, float] = {}
        batches = 0
        for rank_sums, rank_count in gather_objects((sums, count)):
            batches += rank_count
            for name, value in rank_sums.items():
                totals[name] = totals.get(name, 0.0) + value
        return {name: total / max(batches, 1) for name, total in totals.items()}

    # records
    def _log_train(self) -> None:
        window = self._window
        size = self.rank.size()
        count = window["count"]
        step_time = window["time"] / max(window["steps"], 1)
        record = {
            "kind": "train",
            "step": self.step,
            "epoch": self.epoch,
            "stage": self.rank.stage,
            "loss": window["loss"] / count if count else float("nan"),
            "objective": window["objective"] / count if count else float("nan"),
            "size": size,
            "ratio": size / self.rank.initial_size,
            "ranks": {name: list(train.ranks) for name, train in gated_trains(self.module)},
            "lr": {
                str(group.get("name", i)): group["lr"] for i, group in enumerate(self.optimizer.param_groups)
            },
            "step_time": step_time,
            "steps_per_second": 1.0 / step_time if step_time > 0 else float("nan"),
            "peak_memory_mib": peak_memory_mib(self._device()),
            "nonfinite": self.guard.total,
        }
        self.metrics.write(record)
        if self._bar is not None:
            shown = {
                "loss": f"{record['loss']:.4g}",
                "ratio": f"{record['ratio']:.3f}",
                "stage": record["stage"],
            }
            if self.guard.total:
                shown["skipped"] = self.guard.total
            self._bar.set_postfix(shown)
        self._window = {"loss": 0.0, "objective": 0.0, "count": 0, "time": 0.0, "steps": 0}

    def _log_eval(self) -> None:
        self.last_eval = self.evaluate()
        record = {"kind": "eval", "step": self.step, "epoch": self.epoch, "stage": self.rank.stage}
        self.metrics.write({**record, "metrics": self.last_eval})

    def _event(self, name: str, **details: Any) -> None:
        self.metrics.write({"kind": "event", "step": self.step, "event": name, **details})

    def _device(self) -> torch.device:
        first = next(iter(self.module.parameters()), None)
        return torch.device("cpu") if first is None else first.device

    def _plot(self) -> None:
        try:
            from comera.train.plots import plot_run
        except ImportError:
            return
        plot_run(self.run_dir)

    # checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The full training state as tensors and plain values (what a checkpoint file holds).

        Under DDP this is collective (it gathers every rank's RNG state).
        """
        rng_per_rank = gather_objects(capture_rng())
        return {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "library_version": __version__,
            "model": self.module.state_dict(),
            "structure": model_structure(self.module),
            "optimizer": self.optimizer.state_dict(),
            "rank_adaptation": self.rank.state_dict(),
            "progress": {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch},
            "guard": self.guard.state_dict(),
            "rng": rng_per_rank[self.process_rank],
            "rng_per_rank": rng_per_rank,
            "config": self.config.to_dict(),
        }

    def save_checkpoint(self) -> Path:
        """Write the state after the current step atomically; keep the newest ``keep_checkpoints`` files.

        Under DDP every rank calls it; rank 0 writes, and all ranks wait until the file is in place.
        """
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint folder: set config.run_dir or config.checkpoint_dir")
        path = checkpoint_path(self.checkpoint_dir, self.step)
        payload = self.state_dict()
        if self.process_rank == 0:
            save_checkpoint(payload, path)
            for _, old in list_checkpoints(self.checkpoint_dir)[: -self.config.keep_checkpoints]:
                old.unlink(missing_ok=True)
        barrier()
        return path

    def _restore(self, payload: dict[str, Any], rollback: bool) -> None:
        apply_structure(self.module, payload["structure"], self.optimizer)
        self.module.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.rank.load_state_dict(payload["rank_adaptation"])
        progress = payload["progress"]
        self.step = int(progress["step"])
        self.epoch = int(progress["epoch"])
        self.batch_in_epoch = int(progress["batch_in_epoch"])
        if not rollback:
            self.guard.load_state_dict(payload["guard"])
        per_rank = payload.get("rng_per_rank", [])
        restore_rng(per_rank[self.process_rank] if len(per_rank) == self.world_size else payload["rng"])
        self._window = {"loss": 0.0, "objective": 0.0, "count": 0, "time": 0.0, "steps": 0}
        self._invalidate_graph()

    def _rollback(self) -> None:
        failed_at = self.step
        path = None if self.checkpoint_dir is None else latest_checkpoint(self.checkpoint_dir)
        self.guard.begin_rollback(failed_at, path is not None)
        self._restore(load_checkpoint(path), rollback=True)
        self.metrics.drop_after(self.step)
        self._event("rollback", failed_at=failed_at, checkpoint=str(path), nonfinite=self.guard.total)
        if self._bar is not None:
            self._bar.n = self.step
            self._bar.refresh()
