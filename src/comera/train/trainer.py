"""``Trainer``: one training loop for every method (CoMERA's two stages, or a plain task loss for the
baselines) on one process or under ``torchrun`` (DDP, FSDP2); its checkpoints are kept by
:class:`comera.train.resume.CheckpointManager`. The order of a step and of what runs between steps is in
docs/training.md, "The loop"."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from comera.cpu import reuse_freed_memory
from comera.modules import unwrap_model
from comera.train.config import AUTO_COMPILE_MIN_STEPS, TrainConfig
from comera.train.distributed import check_backend, globally_averaged, world
from comera.train.evaluation import Evaluator, MeanEvaluator, run_evaluation
from comera.train.fsdp import (
    check_sharding,
    clip_gradients,
    gathered,
    grad_norm,
    reduce_replicated_gradients,
    shard_model,
    unfuse_mixed_groups,
)
from comera.train.guard import NonFiniteError, NonFiniteGuard
from comera.train.metrics import MetricsLog, read_metrics, reset_peak_memory
from comera.train.objective import Objective, default_objective
from comera.train.parallel import all_true, lost_rank, peer_failure, per_rank_values
from comera.train.plots import plot_finished_run
from comera.train.records import StepWindow, bar_postfix, train_record
from comera.train.reshard import (
    load_whole_optimizer_state,
    meta_template,
    pruned_copy,
)
from comera.train.resume import CheckpointManager
from comera.train.schedule import apply_lr_schedule, lr_factor
from comera.train.setup import (
    batches_for,
    check_arguments,
    check_world,
    default_optimizer,
    graph_step_for,
    place_model,
)

__all__ = ["Trainer", "FitResult"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
EvalFn = Callable[[nn.Module, Any], Mapping[str, Any]]
_END = object()


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` reached: final step, stage, size ratio, last evaluation, guard counters, and
    ``train_time_s`` (in fit, earlier processes of a resumed run included; not compared)."""

    step: int
    stage: str
    size: int
    ratio: float
    eval: dict[str, float] = field(default_factory=dict)
    nonfinite: int = 0
    rollbacks: int = 0
    train_time_s: float = field(default=0.0, compare=False)


def _with_last(batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    iterator = iter(batches)
    current = next(iterator, _END)
    while current is not _END:
        following = next(iterator, _END)
        yield current, following is _END
        current = following


class Trainer:
    """Trains any model through one loop: CoMERA's early and late stages, or a baseline's task loss.

    Args:
        model: the model (``torch.compile`` wrapper allowed; not DDP-wrapped: the Trainer wraps it).
        loss_fn: ``loss_fn(model, batch) -> 0-dim task loss``; it moves the batch to the model's device.
        train_data: a map-style dataset (batched with ``config.batch_size``) or a re-iterable of batches
            (a ``DataLoader``); see :mod:`comera.train.data` for the reproducibility contract.
        config: a :class:`TrainConfig`.
        objective: what is optimised on top of the task loss; default
            :func:`comera.train.objective.default_objective` (CoMERA's for a model with gated layers, else the
            plain task loss).
        eval_data: dataset or iterable of batches for evaluation, or None.
        eval_fn: ``eval_fn(model, batch) -> {name: number}``, averaged over batches; default
            ``{"loss": loss_fn(model, batch)}``.
        evaluator: an :class:`comera.train.evaluation.Evaluator` for metrics exact over the whole evaluation
            set (instead of ``eval_fn``).
        optimizer: default AdamW on the objective's parameter groups; a method's own optimizer (GaLore,
            APOLLO, ...) must hold the model's parameters (pruning slices its state in place), and with
            ``config.cuda_graph`` be AdamW or Adam with ``capturable=True``.
        collate_fn: batching of dataset samples (default ``torch.utils.data.default_collate``).
        callbacks: ``callback(trainer)`` after every step's bookkeeping.

    Attributes:
        step, epoch, batch_in_epoch: progress (steps done, epochs done, batches done in this epoch).
        objective: the :class:`comera.train.objective.Objective` driving the run.
        process_rank, world_size: this process's place in a DDP process group (0 and 1 without one).
        guard, checkpoints: the run's :class:`comera.train.guard.NonFiniteGuard` (with its counters) and
            :class:`comera.train.resume.CheckpointManager`.
        graph_step: the :class:`comera.train.cuda_graph.CudaGraphStep` running each step, or None; a
            callback that changes learning rates calls its ``invalidate()``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 2))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randint(0, 2, (64,)))
        >>> def loss_fn(model, batch):
        ...     x, y = batch
        ...     return nn.functional.cross_entropy(model(x), y)
        >>> config = comera.TrainConfig(early=2, late=1, unit="epoch", batch_size=16, progress=False)
        >>> result = comera.Trainer(model, loss_fn, data, config=config).fit()  # CoMERA's objective
        >>> result.step, result.stage  # 64 / 16 = 4 steps an epoch, 3 epochs
        (12, 'late')
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        train_data: Any,
        *,
        config: TrainConfig | None = None,
        objective: Objective | None = None,
        eval_data: Any = None,
        eval_fn: EvalFn | None = None,
        evaluator: Evaluator | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        callbacks: Iterable[Callable[[Trainer], None]] = (),
    ) -> None:
        config = check_arguments(model, loss_fn, config, optimizer, objective, eval_fn, evaluator)
        self.config = config
        self.model = model
        self.module = unwrap_model(model)
        place_model(self.module, config.device, optimizer)
        self.loss_fn = loss_fn
        self.callbacks = list(callbacks)
        self.process_rank, self.world_size = world()
        check_world(config, self.world_size)
        if objective is not None and objective.model is not self.module:
            raise ValueError("objective must be built on the same (unwrapped) model the Trainer trains")
        self.objective = objective or default_objective(self.module)
        self.objective.check_stages(early=config.early, late=config.late)
        self._sharded = self.world_size > 1 and config.parallel == "fsdp"
        self._template: nn.Module | None = None
        if self.world_size > 1:
            check_backend(self._device())
            if self._sharded:
                check_sharding(optimizer is not None)
                if config.shard_cores:  # what a prune (or a pruned checkpoint) rebuilds the model from
                    self._template = meta_template(self.module)
                self.model = self._shard(self.module)
            else:
                self.model = self._ddp()
        self.optimizer = optimizer or default_optimizer(self.objective, config)
        if self._sharded:
            unfuse_mixed_groups(self.optimizer)
        self.train_data, self.eval_data = batches_for(
            train_data, eval_data, config, collate_fn, self.process_rank, self.world_size
        )
        self.evaluator = evaluator or (
            MeanEvaluator(eval_fn if eval_fn is not None else self._default_eval)
            if self.eval_data is not None
            else None
        )
        run_dir = None if config.run_dir is None else Path(config.run_dir)
        self.run_dir = run_dir
        self.checkpoint_dir = (
            Path(config.checkpoint_dir)
            if config.checkpoint_dir is not None
            else (None if run_dir is None else run_dir / "checkpoints")
        )
        self.checkpoints = CheckpointManager(self, self.checkpoint_dir)
        self.metrics = MetricsLog(run_dir if self.process_rank == 0 else None)
        self.guard = NonFiniteGuard(config.max_nonfinite, config.max_rollbacks)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.last_eval: dict[str, float] = {}
        self._time_before = 0.0
        self._fit_started = time.perf_counter()
        self._bf16 = config.precision == "bf16"
        self.objective.set_precision(config.precision)
        self._device_type = self._device().type
        if config.reuse_cpu_memory and self._device_type == "cpu":
            reuse_freed_memory()
        self._compute, self._apply = self._step_functions()
        self.graph_step = (
            graph_step_for(self.module, loss_fn, self.optimizer, self.objective, config, self._device())
            if config.cuda_graph
            else None
        )
        self._window = StepWindow()
        self._bar: Any = None  # a tqdm progress bar while fit() runs

    def _default_eval(self, module: nn.Module, batch: Any) -> dict[str, Any]:
        return {"loss": self.loss_fn(module, batch)}

    # lengths
    def _steps(self, length: int) -> int:
        return length * len(self.train_data) if self.config.unit == "epoch" else length

    @property
    def early_steps(self) -> int:
        """Steps of the early stage (of the whole run for an objective without stages)."""
        if not self.objective.has_stages:
            return self.total_steps
        return self._steps(self.config.early)

    @property
    def total_steps(self) -> int:
        """Steps of the whole run (early + late)."""
        return self._steps(self.config.early) + self._steps(self.config.late)

    def lr_factor(self, step: int) -> float:
        """The factor of every param group's peak rate before optimizer step ``step`` (0-based) of this run
        (``config.lr_schedule``; :func:`comera.train.schedule.lr_factor`)."""
        config = self.config
        return lr_factor(step, self.total_steps, config.lr_schedule, config.warmup, config.min_lr_ratio)

    # one step
    def _forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self._device_type, dtype=torch.bfloat16, enabled=self._bf16):
            task = self.loss_fn(self.model, batch)
            if not isinstance(task, torch.Tensor) or not task.requires_grad:
                raise ValueError(
                    "loss_fn returned a loss that no trainable parameter reaches (a detached tensor or a "
                    f"number: {task!r}); nothing would be trained. Return the loss computed from the model"
                )
            task = globally_averaged(task)
            objective = self.objective.loss(task)
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
        # a scheduled rate is a new Python float every step, which a compiled optimizer step recompiles for
        scheduled = self.config.lr_schedule != "constant"
        return (
            torch.compile(self._forward_backward, backend=backend),
            self.optimizer.step if scheduled else torch.compile(self.optimizer.step, backend=backend),
        )

    def _invalidate_graph(self) -> None:
        if self.graph_step is not None:
            self.graph_step.invalidate()

    def _parameters(self) -> list[torch.Tensor]:
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def _eager_step(self, batch: Any) -> tuple[float, float, bool]:
        saved = self.objective.snapshot()
        task, objective = self._compute(batch)
        params = self._parameters()
        if self._sharded:
            reduce_replicated_gradients(params)
        norm = grad_norm(params).to(objective.device)
        values = torch.stack([task.float(), objective.float(), norm.float()]).tolist()
        finite = all_true(NonFiniteGuard.is_finite(values[1] + values[2]))
        if finite:
            if self.config.grad_clip is not None:
                clip_gradients(params, self.config.grad_clip, norm)
            self._apply()
        else:
            self.objective.restore(saved)
        self.optimizer.zero_grad(set_to_none=True)
        return values[0], values[1], finite

    def train_step(self, batch: Any) -> bool:
        """Forward, objective, backward and (if everything is finite) the optimizer step; True if applied.
        With ``config.cuda_graph``: one replay of :attr:`graph_step` (gradients stay in its memory)."""
        start = time.perf_counter()
        if self.config.lr_schedule != "constant":
            apply_lr_schedule(self.optimizer, self.lr_factor(self.step))
        if self.graph_step is None:
            task, objective, finite = self._eager_step(batch)
        else:
            task, objective, _, applied = self.graph_step.step(batch).tolist()
            finite = applied == 1.0
        self._window.add(task, objective, finite, start)
        return finite

    # the run
    def fit(self, resume: bool | str | Path = False) -> FitResult:
        """Train to ``total_steps``.

        Args:
            resume: False starts fresh (seeded with ``config.seed``, per rank with
                :func:`comera.train.parallel.rank_seed`); True continues from the newest readable checkpoint
                (without one it warns and starts fresh); a path continues from that checkpoint file
                (:meth:`comera.train.resume.CheckpointManager.start`).

        Raises:
            NoReadableCheckpointError: ``resume=True`` and every checkpoint file is unreadable.
            comera.train.parallel.RankLostError: another process of the run stopped (or stopped answering)
                while this one waited for it in a collective call.
        """
        self._fit_started = time.perf_counter()
        reset_peak_memory(self._device())  # the run's peak: training, not what the process did before
        self.checkpoints.start(resume)
        total = self.total_steps
        self.model.train()
        if self.step == 0 and self._late_stage_due():
            self._begin_late_stage()
        progress = self.config.progress
        if progress is None:  # a terminal shows the bar; stderr may also be closed (None)
            progress = sys.stderr is not None and sys.stderr.isatty()
        progress = progress and self.process_rank == 0
        self._bar = tqdm(
            total=total, initial=self.step, disable=not progress, dynamic_ncols=True, unit="step"
        )
        try:
            self._train_to(total)
        except NonFiniteError as error:
            self._event("diverged", reason=str(error))
            raise
        size = self.objective.size()
        return FitResult(
            step=self.step,
            stage=self.objective.stage,
            size=size,
            ratio=size / self.objective.initial_size,
            eval=dict(self.last_eval),
            nonfinite=self.guard.total,
            rollbacks=self.guard.rollbacks,
            train_time_s=self._train_time(),
        )

    def _train_to(self, total: int) -> None:
        """Train from the current step to ``total``, then evaluate a resumed end, plot, check the guard."""
        try:
            while self.step < total:
                self._run_epoch(total)
        except NonFiniteError:  # a RuntimeError, but never a lost peer
            raise
        except RuntimeError as error:
            if self.world_size > 1 and peer_failure(error):
                raise lost_rank(error, self.checkpoint_dir) from error
            raise
        finally:
            self._bar.close()
            self._bar = None
        self._evaluate_a_resumed_end()
        if self.run_dir is not None and self.config.plot and self.process_rank == 0:
            plot_finished_run(self.run_dir)
        self.guard.check_end(self.step, self.last_eval)

    def _evaluate_a_resumed_end(self) -> None:
        """A run resumed at its last step trains nothing, so nothing evaluated it in this process: evaluate
        it, and log the last step's ``eval`` record again when the log lost it (a torn last line)."""
        if self.last_eval or self.eval_data is None or self.step == 0 or self.step < self.total_steps:
            return
        self.last_eval = self.evaluate()
        path = self.metrics.path
        records = read_metrics(path) if path is not None and path.is_file() else []
        if not any(record.get("kind") == "eval" and record.get("step") == self.step for record in records):
            self._write_eval_record()

    def _train_time(self) -> float:
        return self._time_before + time.perf_counter() - self._fit_started

    def _late_stage_due(self) -> bool:
        return (
            self.objective.has_stages
            and self.objective.stage == "early"
            and self.config.late > 0
            and self.step == self._steps(self.config.early)
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
                self.checkpoints.rollback()
                return
            if finite:
                self._objective_after_step()
            self._after_step(epoch_end=last)
            if self.step >= total:
                return
        if not ran:
            raise ValueError(
                f"train_data yielded no batches in epoch {self.epoch} from batch {self.batch_in_epoch}"
            )

    def _objective_after_step(self) -> None:
        if self._template is not None and self.objective.stage == "late":
            # the late stage's trims score entries by the cores' values: gathered whole for them
            with gathered(self.module):
                event = self.objective.after_step(self.step)
        else:
            event = self.objective.after_step(self.step)
        if event:
            if event.get("changed", True):
                self._invalidate_graph()
            self._event("objective", **event)

    def _after_step(self, epoch_end: bool) -> None:
        config = self.config
        last_step = self.step == self.total_steps
        if self.step % config.log_every == 0 or last_step:
            self._log_train()
        pruned = False
        if epoch_end:
            self.epoch += 1
            self.batch_in_epoch = 0
            pruned |= self._prune("epoch_end")
        if self._late_stage_due():
            pruned |= self._prune("early_end")
            self._begin_late_stage()
        if last_step:
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

    def _begin_late_stage(self) -> None:
        if self.step > 0 and self.guard.total >= self.step and self.guard.rollbacks == 0:
            raise NonFiniteError(
                f"every one of the {self.step} steps of the early stage was non-finite, so the late stage "
                "has no loss to start from (max_nonfinite is larger than the early stage)"
            )
        details = self.objective.begin_late_stage(late_steps=self._steps(self.config.late))
        self._invalidate_graph()
        self._event("late_stage", **details)

    def _prune(self, point: str) -> bool:
        """Prune at ``point`` if the objective wants to; True when the model's shapes changed."""
        if not self.objective.prunes_at(point):
            return False
        return self.prune(point) is not None

    def prune(self, point: str | None = None) -> dict[str, Any] | None:
        """Prune the model (and the optimizer's state) to the objective's active ranks now, as a prune point
        does (collective under DDP and FSDP); the objective's details when shapes changed (then a ``"prune"``
        event at ``point``, if given), else None. With ``shard_cores`` the module, model and optimizer are
        new objects afterwards."""
        if self._template is not None:
            details = self._prune_sharded_cores()
        else:
            rewrap = self.world_size > 1 and not self._sharded  # FSDP leaves replicated layers alone
            if rewrap:
                self._drop_ddp_wrapper()
            details = self.objective.prune(self.optimizer)
            if rewrap:
                self.model = self._ddp()
        if details is not None:
            self._invalidate_graph()
            if point is not None:
                self._event("prune", point=point, **details)
        return details

    def _shard(self, module: nn.Module) -> nn.Module:
        """``module`` sharded for this run: TT layers replicated, or (``shard_cores``) all but what the
        objective reads between steps (its gates)."""
        keep = self.objective.whole_parameters() if self.config.shard_cores else ()
        return shard_model(module, self.config.shard_cores, keep_whole=keep)

    def _install_sharded(self, fresh: nn.Module) -> None:
        """Shard ``fresh`` and make it the trained model, with a new optimizer on its parameters."""
        self.module = fresh
        self.model = self._shard(fresh)
        self.optimizer = default_optimizer(self.objective, self.config)
        self._compute, self._apply = self._step_functions()  # the step of the new optimizer
        gc.collect()

    def _prune_sharded_cores(self) -> dict[str, Any] | None:
        """Prune a model whose cores are sharded, through an unsharded copy (:func:`pruned_copy`)."""
        new_optimizer = lambda: default_optimizer(self.objective, self.config)  # noqa: E731
        pruned = pruned_copy(self.module, self.optimizer, self._template, self.objective, new_optimizer)  # type: ignore[arg-type]  # set with shard_cores
        if pruned is None:
            return None
        details, fresh, optimizer_state = pruned
        self._install_sharded(fresh)
        load_whole_optimizer_state(self.module, self.optimizer, optimizer_state)
        unfuse_mixed_groups(self.optimizer)
        return details

    def _ddp(self) -> DistributedDataParallel:
        """The module wrapped in DDP, looking for unused parameters where a pruned model may leave some."""
        return DistributedDataParallel(
            self.module, find_unused_parameters=self.objective.leaves_parameters_unused()
        )

    def _drop_ddp_wrapper(self) -> None:
        """Free the DDP wrapper before pruning (its gradient accumulators expect the old shapes)."""
        self.model = self.module
        gc.collect()

    # evaluation
    def evaluate(self) -> dict[str, float]:
        """The evaluator's metrics over the evaluation data (default: the mean task loss; ``{}`` without), in
        eval mode without gradients, the RNG state left as it was; under DDP over all ranks' batches."""
        if self.eval_data is None:
            return {}
        self.objective.before_evaluation()
        return run_evaluation(self.model, self.module, self.eval_data.epoch(0), self.evaluator)  # type: ignore[arg-type]  # set with eval_data

    # records
    def _log_train(self) -> None:
        record = train_record(
            self._window,
            step=self.step,
            epoch=self.epoch,
            objective=self.objective,
            optimizer=self.optimizer,
            device=self._device(),
            nonfinite=self.guard.total,
        )
        if self.world_size > 1:
            record.update(
                per_rank_values(step_time=record["step_time"], peak_memory_mib=record["peak_memory_mib"])
            )
        self.metrics.write(record)
        if self._bar is not None:
            self._bar.set_postfix(bar_postfix(record, skipped=self.guard.total))
        self._window.clear()

    def _log_eval(self) -> None:
        self.last_eval = self.evaluate()
        self._write_eval_record()

    def _write_eval_record(self) -> None:
        record = {
            "kind": "eval",
            "step": self.step,
            "epoch": self.epoch,
            "stage": self.objective.stage,
            "train_time_s": self._train_time(),
        }
        self.metrics.write({**record, "metrics": self.last_eval})

    def _event(self, name: str, **details: Any) -> None:
        self.metrics.write({"kind": "event", "step": self.step, "event": name, **details})

    def _device(self) -> torch.device:
        first = next(iter(self.module.parameters()), None)
        return torch.device("cpu") if first is None else first.device

    # checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The full training state as tensors and plain values (what a checkpoint file holds); collective
        under DDP and FSDP (:meth:`comera.train.resume.CheckpointManager.state_dict`)."""
        return self.checkpoints.state_dict()

    def save_checkpoint(self) -> Path:
        """Write the state after the current step atomically; keep the newest ``keep_checkpoints``; every
        rank calls it (:meth:`comera.train.resume.CheckpointManager.save`)."""
        return self.checkpoints.save()
