"""``Trainer``: one training loop for every method (CoMERA's two stages, or a plain task loss for the
baselines), with checkpoints that never lose work.

One step, top to bottom: ``loss_fn(model, batch)`` gives the task loss; the run's
:class:`comera.train.objective.Objective` turns it into the optimised scalar (CoMERA: the stage's objective;
baselines: the task loss itself); backward; the non-finite guard checks ``objective + gradient norm`` (one
host sync, which also fetches the logged numbers); the optimizer steps or the step is skipped; the
objective's host-side ``after_step`` runs.

Between steps, in this order: a metrics record every ``log_every`` steps; at an epoch end, pruning if
configured; at the end of the early stage, pruning (``"early_end"``) and the switch to the late stage; at the
last step, pruning (``"end"``); evaluation and checkpoint when due; then the callbacks. A prune that changes
the model is followed by a checkpoint (when checkpoints are on), so a rollback never has to grow a layer.
Stages and pruning apply to objectives that have them (:class:`comera.methods.comera.CoMERAObjective`): the
Trainer asks its objective through the hooks of :class:`comera.train.objective.Objective` and knows no method;
with :class:`comera.train.objective.TaskObjective` a run is ``early + late`` steps of the task loss.

With ``config.cuda_graph`` the whole step (guard included) is a replayed CUDA graph
(:class:`comera.train.cuda_graph.CudaGraphStep`) that hands back its four numbers; the graphs are dropped and
recaptured after a prune that changes the model, at the switch to the late stage and after loading a
checkpoint.

Distributed data parallel (``torchrun``; the process group must use nccl for a CUDA model, gloo for a CPU one,
see :func:`comera.train.distributed.backend_for`): when a process group with several ranks
is running, the model is wrapped in ``DistributedDataParallel`` (rebuilt at every prune point),
a map-style dataset is sharded by rank, the task loss the objective reads is averaged over ranks (so the
late-stage switch and targets agree), rank 0 alone writes metrics, plots and checkpoints (which hold every
rank's RNG state), and evaluation sums over all ranks. With ``config.parallel == "fsdp"`` the model is
sharded with FSDP2 instead (:mod:`comera.train.fsdp`; built once, pruning leaves the sharded parts alone).
The non-finite guard's verdict is the AND over ranks, train records carry every rank's step time and peak
memory, and a rank that stops makes the others raise :class:`comera.train.parallel.RankLostError`
(:mod:`comera.train.parallel`).
"""

from __future__ import annotations

import gc
import math
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from comera.atomic import remove_stale_temporaries
from comera.cpu import reuse_freed_memory
from comera.modules import unwrap_model
from comera.train.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    ForeignCheckpointError,
    NoReadableCheckpointError,
    capture_rng,
    checkpoint_path,
    foreign_entry,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    misplaced_entries,
    remove_checkpoint,
    restore_rng,
    save_checkpoint,
)
from comera.train.config import AUTO_COMPILE_MIN_STEPS, TrainConfig
from comera.train.distributed import barrier, check_backend, gather_objects, globally_averaged, world
from comera.train.evaluation import Evaluator, MeanEvaluator, run_evaluation
from comera.train.fsdp import (
    check_sharding,
    clip_gradients,
    full_state,
    gathered,
    grad_norm,
    load_full_state,
    reduce_replicated_gradients,
    shard_model,
    unfuse_mixed_groups,
)
from comera.train.guard import NonFiniteError, NonFiniteGuard
from comera.train.metrics import MetricsLog, read_metrics, reset_peak_memory
from comera.train.objective import Objective, default_objective
from comera.train.parallel import all_true, lost_rank, peer_failure, per_rank_values, rank_seed
from comera.train.records import StepWindow, train_record
from comera.train.reshard import (
    fresh_copy,
    load_whole_optimizer_state,
    meta_template,
    whole_model_state,
    whole_optimizer_state,
)
from comera.train.schedule import apply_lr_schedule, lr_factor
from comera.train.setup import (
    batches_for,
    check_arguments,
    default_optimizer,
    graph_step_for,
    place_model,
)
from comera.train.sharded_checkpoint import load_sharded_state, save_sharded_checkpoint
from comera.version import __version__

__all__ = ["Trainer", "FitResult"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
EvalFn = Callable[[nn.Module, Any], Mapping[str, Any]]
_END = object()


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` reached: final step, stage, size ratio, last evaluation, guard counters, and
    ``train_time_s``: seconds spent in :meth:`Trainer.fit` by this process and, for a resumed run, by the
    earlier processes up to the checkpoint it resumed from (not compared: two equal runs take their own
    time)."""

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
            :func:`comera.train.objective.default_objective`: CoMERA's rank objective with default settings
            (:class:`comera.methods.comera.CoMERAObjective`, registered by :mod:`comera.methods`) for a model
            with gated layers, else the plain task loss (:class:`comera.train.objective.TaskObjective`). For
            other CoMERA settings pass ``objective=CoMERAObjective(model, CoMERASettings(gamma=...))``.
        eval_data: dataset or iterable of batches for evaluation, or None.
        eval_fn: ``eval_fn(model, batch) -> {name: number}``, averaged over batches; default
            ``{"loss": loss_fn(model, batch)}``.
        evaluator: an :class:`comera.train.evaluation.Evaluator` for metrics exact over the whole evaluation
            set (instead of ``eval_fn``).
        optimizer: default AdamW on the objective's parameter groups (``config.lr_other`` and
            ``config.weight_decay``; CoMERA: cores and gates at its own rates, other; ``capturable=True``
            with ``config.cuda_graph``). A method that brings its own
            optimizer (GaLore, APOLLO, ...) passes it here; it must hold the model's parameters, and pruning
            slices its state in place. With ``config.cuda_graph`` it must be AdamW or Adam with
            ``capturable=True``.
        collate_fn: batching of dataset samples (default ``torch.utils.data.default_collate``).
        callbacks: ``callback(trainer)`` after every step's bookkeeping.

    Attributes:
        step, epoch, batch_in_epoch: progress (steps done, epochs done, batches done in this epoch).
        objective: the :class:`comera.train.objective.Objective` driving the run.
        process_rank, world_size: this process's place in a DDP process group (0 and 1 without one).
        guard: the :class:`comera.train.guard.NonFiniteGuard` with its counters.
        graph_step: the :class:`comera.train.cuda_graph.CudaGraphStep` running each step, or None (eager or
            compiled step). A callback that changes learning rates must call its ``invalidate()``.

    Examples:
        >>> import tempfile
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
        if config.cuda_graph and self.world_size > 1:
            raise ValueError(
                "cuda_graph=True supports single-process runs only, got a process group of "
                f"{self.world_size} ranks (DDP): the captured step has no gradient all-reduce; "
                "set cuda_graph=False"
            )
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
        self.metrics = MetricsLog(run_dir if self.process_rank == 0 else None)
        self.guard = NonFiniteGuard(config.max_nonfinite, config.max_rollbacks)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.last_eval: dict[str, float] = {}
        self._deferred_events: list[tuple[str, dict[str, Any]]] = []
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

        With ``config.cuda_graph`` this is one replay of :attr:`graph_step` (a capture first when needed) on
        the unwrapped model; gradients then stay in the graph's memory between steps instead of being set
        to None.
        """
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
            resume: False starts fresh (seeding torch, ``random`` and numpy with ``config.seed``, on rank r
                of a process group with :func:`comera.train.parallel.rank_seed`); True
                continues from the newest readable checkpoint in the checkpoint folder (a corrupt newest
                checkpoint is reported and the previous one used); without any checkpoint it warns and
                starts fresh, dropping the ``train``/``eval`` records of the earlier attempt; a path
                continues from that checkpoint file.

        Before anything else, the temporary files that a killed process left in the run and checkpoint
        folders are deleted, and a torn last line of ``metrics.jsonl`` is reported (a warning and a
        ``"torn_record_dropped"`` event).

        Raises:
            NoReadableCheckpointError: ``resume=True`` and every checkpoint file is unreadable.
            comera.train.parallel.RankLostError: another process of the run stopped (or stopped answering)
                while this one waited for it in a collective call.
        """
        self._fit_started = time.perf_counter()
        reset_peak_memory(self._device())  # the run's peak: training, not what the process did before
        if self.process_rank == 0:
            for folder in (self.run_dir, self.checkpoint_dir):
                if folder is not None:
                    remove_stale_temporaries(folder)
        if self.metrics.torn_bytes:
            warnings.warn(
                f"{self.metrics.path}: dropped a torn last record ({self.metrics.torn_bytes} bytes without a "
                "newline, left by a process killed mid-write)",
                RuntimeWarning,
                stacklevel=2,
            )
            self._deferred_events.append(("torn_record_dropped", {"bytes": self.metrics.torn_bytes}))
            self.metrics.torn_bytes = 0
        if resume is False:
            self._seed()
            self._write_deferred_events()
        elif resume is True:
            self._resume_latest()
        else:
            path = Path(resume)
            self._restore(load_checkpoint(path), rollback=False)
            self._resumed_from(path)
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
        """Train from the current step to ``total``, then evaluate a resumed end, plot, and refuse an end
        in divergence (:class:`NonFiniteError`, which :meth:`fit` logs as a ``diverged`` event)."""
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
            self._plot()
        self._refuse_a_diverged_end()

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

    def _refuse_a_diverged_end(self) -> None:
        """Raise :class:`NonFiniteError` when the run ran out of steps while diverging: it ended in non-finite
        (skipped) steps and its final evaluation is not finite, so the rollbacks it had left never got to
        run out. With a finite final evaluation, or none, such an end warns: skipped steps leave the model
        of the last applied step, sound after a lone loss-scale overflow, untrained after a stage of them."""
        if self.guard.consecutive == 0:
            return
        count = self.guard.consecutive
        steps = f"{count} non-finite step{'s' if count > 1 else ''}"
        streak = (
            f"the run ended in {steps} in a row at step {self.step} ({self.guard.total} in all, "
            f"{self.guard.rollbacks} rollbacks)"
        )
        broken = sorted(
            name
            for name, value in self.last_eval.items()
            if isinstance(value, float) and not math.isfinite(value)
        )
        if broken:
            raise NonFiniteError(f"{streak} and its final evaluation is not finite ({', '.join(broken)})")
        checked = "nothing evaluated it" if not self.last_eval else "its final evaluation is finite"
        warnings.warn(
            f"{streak}; {checked}: the model is that of the last applied step, check it",
            RuntimeWarning,
            stacklevel=3,
        )

    def _train_time(self) -> float:
        return self._time_before + time.perf_counter() - self._fit_started

    def _resumed_from(self, path: Path | None) -> None:
        """Drop the records of steps after the resumed state (and unreadable lines); log the resume."""
        unreadable, repeated = self.metrics.drop_after(self.step)
        self._write_deferred_events()
        details = {"unreadable_lines_dropped": unreadable} if unreadable else {}
        if unreadable:
            warnings.warn(
                f"{self.metrics.path}: dropped {unreadable} line(s) that hold no readable record (not UTF-8, "
                "not JSON, not an object, no integer step, or a record that lacks a key of its kind or "
                "holds a value of the wrong type)",
                RuntimeWarning,
                stacklevel=4,
            )
        if repeated:
            details["repeated_records_dropped"] = repeated
            warnings.warn(
                f"{self.metrics.path}: dropped {repeated} repeated record(s) (a step's train or eval record, "
                "or an event, logged more than once; the first of each was kept)",
                RuntimeWarning,
                stacklevel=4,
            )
        details["processes"] = self.world_size  # a run may resume in another number of processes
        self._event("resume", checkpoint=None if path is None else str(path), **details)
        self._warn_of_lost_records()

    def _warn_of_lost_records(self) -> None:
        """Warn (and log an event) when ``metrics.jsonl`` lacks train records of steps up to the resumed one:
        lines lost from the file (cut short, edited) are not written again, the history is incomplete."""
        if self.metrics.path is None or not self.metrics.path.is_file() or self.step == 0:
            return
        every = self.config.log_every
        logged = {
            record.get("step") for record in read_metrics(self.metrics.path) if record.get("kind") == "train"
        }
        missing = [step for step in range(every, self.step + 1, every) if step not in logged]
        if not missing:
            return
        warnings.warn(
            f"{self.metrics.path}: the train records of {len(missing)} logged step(s) up to step {self.step} "
            f"are missing (the first at step {missing[0]}): lost from the file, they are not written again",
            RuntimeWarning,
            stacklevel=4,
        )
        self._event("records_missing", steps=len(missing), first=missing[0])

    def _resume_latest(self) -> None:
        candidates = [] if self.checkpoint_dir is None else list_checkpoints(self.checkpoint_dir)
        for path in [] if self.checkpoint_dir is None else misplaced_entries(self.checkpoint_dir):
            kind = "folder" if path.is_dir() else "file" if path.is_file() else "special file"
            error = f"{path}: not a checkpoint, a {kind} with its name"
            warnings.warn(f"skipping an unreadable checkpoint: {error}", RuntimeWarning, stacklevel=3)
            self._deferred_events.append(("unreadable_checkpoint", {"checkpoint": str(path), "error": error}))
        for _, path in reversed(candidates):
            try:
                payload = load_checkpoint(path)
            except ValueError as error:
                warnings.warn(f"skipping an unreadable checkpoint: {error}", RuntimeWarning, stacklevel=3)
                self._deferred_events.append(
                    ("unreadable_checkpoint", {"checkpoint": str(path), "error": str(error)})
                )
                continue
            try:
                self._restore(payload, rollback=False)
            except ForeignCheckpointError as error:
                warnings.warn(f"skipping a checkpoint of another model: {path}: {error}", RuntimeWarning, 3)
                details = {"checkpoint": str(path), "error": str(error)}
                self._deferred_events.append(("foreign_checkpoint", details))
                continue
            self._resumed_from(path)
            return
        if candidates:  # nothing resumed: the warnings said which were skipped, the log stays as it was
            self._deferred_events.clear()
            raise NoReadableCheckpointError(self.checkpoint_dir, len(candidates))  # type: ignore[arg-type]  # candidates come from it
        where = "no checkpoint folder (config.run_dir and checkpoint_dir are None)"
        if self.checkpoint_dir is not None:
            where = f"no checkpoint in {self.checkpoint_dir}"
        warnings.warn(
            f"resume: {where}; training starts from step 0 (the records of the earlier attempt are dropped)",
            RuntimeWarning,
            stacklevel=3,
        )
        self._seed()
        self._resumed_from(None)

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
                self._rollback()
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

    def _seed(self) -> None:
        seed = rank_seed(self.config.seed, self.process_rank)
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)  # NumPy's legacy seed takes [0, 2**32); config seeds and ranks go beyond

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
        does, under DDP and FSDP too; the objective's details when shapes changed, else None. When shapes
        changed and ``point`` is given (``"save"``: before the model is saved), a ``"prune"`` event with
        that point and the details is logged, as at a prune point.

        With ``parallel="fsdp"`` and ``shard_cores=True`` the sharded model is rebuilt
        (:mod:`comera.train.reshard`): ``self.module``, ``self.model`` and ``self.optimizer`` are new objects
        afterwards, and the objective is bound to the new module. Collective under DDP and FSDP.
        """
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

    def _rebuilt_on(self, structure: dict[str, Any]) -> nn.Module:
        """A fresh unsharded copy of the model (uninitialised) with the shapes ``structure`` records, the
        objective bound to it; on a structure this model cannot take, the objective is bound back and the
        ``ValueError`` raised."""
        old = self.module
        fresh = fresh_copy(self._template, self._device())  # type: ignore[arg-type]  # set wherever a prune can rebuild
        self.objective.rebind(fresh)
        try:
            self.objective.apply_structure(structure, None)
        except ValueError:
            self.objective.rebind(old)
            raise
        return fresh

    def _install_sharded(self, fresh: nn.Module) -> None:
        """Shard ``fresh`` and make it the trained model, with a new optimizer on its parameters."""
        self.module = fresh
        self.model = self._shard(fresh)
        self.optimizer = default_optimizer(self.objective, self.config)
        self._compute, self._apply = self._step_functions()  # the step of the new optimizer
        gc.collect()

    def _prune_sharded_cores(self) -> dict[str, Any] | None:
        """Prune a model whose cores are sharded: gather the whole state on every rank, prune an unsharded
        copy with a plain optimizer, shard the copy and move the pruned optimizer state to a new optimizer."""
        old_module = self.module
        structure = self.objective.structure()
        model_state = whole_model_state(self.module)
        optimizer_state = whole_optimizer_state(self.module, self.optimizer)
        fresh = self._rebuilt_on(structure)
        fresh.load_state_dict(model_state)
        del model_state
        staging = default_optimizer(self.objective, self.config)
        load_whole_optimizer_state(fresh, staging, optimizer_state)
        details = self.objective.prune(staging)
        if details is None:
            self.objective.rebind(old_module)
            return None
        pruned_state = whole_optimizer_state(fresh, staging)
        del staging, optimizer_state
        self._install_sharded(fresh)
        load_whole_optimizer_state(self.module, self.optimizer, pruned_state)
        unfuse_mixed_groups(self.optimizer)
        return details

    def _ddp(self) -> DistributedDataParallel:
        """The module wrapped in DDP; one that may leave parameters without a gradient (a pruned model that
        lost a layer: :meth:`~comera.train.objective.Objective.leaves_parameters_unused`) has DDP look for
        them at each step, instead of failing on the first step that leaves one out."""
        return DistributedDataParallel(
            self.module, find_unused_parameters=self.objective.leaves_parameters_unused()
        )

    def _drop_ddp_wrapper(self) -> None:
        """Free the DDP wrapper before pruning: it keeps the parameters' gradient accumulators alive, and
        those would still expect the old shapes after :func:`comera.prune_` swaps the parameters' data."""
        self.model = self.module
        gc.collect()

    # evaluation
    def evaluate(self) -> dict[str, float]:
        """The evaluator's metrics over the evaluation data (default: the mean task loss); ``{}`` without.

        Runs in eval mode without gradients on the unwrapped model; the global RNG state is left as it was.
        Under DDP each rank evaluates its shard and the metrics cover all ranks' batches. The layers'
        objective's :meth:`~comera.train.objective.Objective.before_evaluation` runs first (it drops the
        tensor-train layers' inference caches: steps replayed from a CUDA graph do not show in them).
        """
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
            shown = {
                "loss": f"{record['loss']:.4g}",
                "ratio": f"{record['ratio']:.3f}",
                "stage": record["stage"],
            }
            if self.guard.total:
                shown["skipped"] = self.guard.total
            self._bar.set_postfix(shown)
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

    def _write_deferred_events(self) -> None:
        """Log the events found before the run's state was known (a torn log line, skipped checkpoints) at
        the step the run starts from."""
        for name, details in self._deferred_events:
            self._event(name, **details)
        self._deferred_events.clear()

    def _device(self) -> torch.device:
        first = next(iter(self.module.parameters()), None)
        return torch.device("cpu") if first is None else first.device

    def _plot(self) -> None:
        """The run's plots (a by-product: a log with no training record, as a resume at the last step of a
        run whose log was lost leaves, a record the plots cannot read or a ``plots/`` path that cannot be
        written warns instead of failing the run)."""
        try:
            from comera.train.plots import NoTrainingRecordError, plot_run
        except ImportError:
            return
        try:
            plot_run(self.run_dir)  # type: ignore[arg-type]  # called with a run_dir
        except NoTrainingRecordError:
            warnings.warn(
                f"{self.run_dir}: metrics.jsonl holds no training record, so no plot was drawn",
                RuntimeWarning,
                stacklevel=3,
            )
        except (ValueError, OSError) as error:  # a record the plots cannot read, a plots/ path in the way
            warnings.warn(f"not every plot was drawn: {error}", RuntimeWarning, stacklevel=3)

    # checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The full training state as tensors and plain values (what a checkpoint file holds).

        Under DDP this is collective (it gathers every rank's RNG state); under FSDP it also gathers the
        whole model and optimizer state, which only rank 0 receives (the other ranks' ``"model"`` and
        ``"optimizer"`` are empty).
        """
        if self._sharded:
            model_state, optimizer_state = full_state(self.module, self.optimizer)
        else:
            model_state, optimizer_state = self.module.state_dict(), self.optimizer.state_dict()
        return {**self._trainer_state(), "model": model_state, "optimizer": optimizer_state}

    def _trainer_state(self) -> dict[str, Any]:
        """Everything of :meth:`state_dict` but the model and optimizer state; collective under DDP/FSDP."""
        rng_per_rank = gather_objects(capture_rng())
        return {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "library_version": __version__,
            "structure": self.objective.structure(),
            "objective": self.objective.state_dict(),
            "progress": {
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "train_time_s": self._train_time(),
            },
            "guard": self.guard.state_dict(),
            "window": self._window.state_dict(),
            "rng": rng_per_rank[self.process_rank],
            "rng_per_rank": rng_per_rank,
            "config": self.config.to_dict(),
        }

    def save_checkpoint(self) -> Path:
        """Write the state after the current step atomically; keep the newest ``keep_checkpoints``.

        Under DDP every rank calls it; rank 0 writes one file, and all ranks wait until it is in place. Under
        FSDP every rank writes its own shards into one folder (:mod:`comera.train.sharded_checkpoint`).
        """
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint folder: set config.run_dir or config.checkpoint_dir")
        path = checkpoint_path(self.checkpoint_dir, self.step, sharded=self._sharded)
        if (
            self.process_rank == 0
            and path.exists()
            and not (path.is_dir() if self._sharded else path.is_file())
        ):
            remove_checkpoint(path)  # an entry of the other kind, reported unreadable at the resume
        if self._sharded:
            save_sharded_checkpoint(path, self.module, self.optimizer, self._trainer_state())
        elif self.process_rank == 0:
            save_checkpoint(self.state_dict(), path)
        else:
            self._trainer_state()  # its RNG states are gathered collectively
        if self.process_rank == 0:
            for _, old in list_checkpoints(self.checkpoint_dir)[: -self.config.keep_checkpoints]:
                remove_checkpoint(old)
        barrier()
        return path

    def _restore(self, payload: dict[str, Any], rollback: bool) -> None:
        try:
            self.objective.check_structure(payload.get("structure"))
        except ValueError as error:
            raise ForeignCheckpointError(str(error)) from error
        if isinstance(payload.get("model"), Mapping):  # a single-file checkpoint: checked before any change
            reference = self._template if self._template is not None else self.module
            own = reference.state_dict(keep_vars=True)
            structure = payload.get("structure") or {}
            shapes = self.objective.structure_shapes(structure) if self._template is None else {}
            reason = foreign_entry(payload["model"], own, structure, shapes)
            if reason is not None:
                raise ForeignCheckpointError(reason)
        rewrap = self.world_size > 1 and not self._sharded  # rebuilt on the restored structure
        if rewrap:
            self._drop_ddp_wrapper()
        try:
            if self._template is not None:
                if payload["structure"] != self.objective.structure():
                    self._install_sharded(self._rebuilt_on(payload["structure"]))
            else:
                self.objective.apply_structure(payload["structure"], self.optimizer)
        except ValueError as error:  # before any pruning; gates it set are set again by the next restore
            raise ForeignCheckpointError(str(error)) from error
        if "shards" in payload:
            load_sharded_state(payload["shards"], self.module, self.optimizer)
            if self._sharded:
                unfuse_mixed_groups(self.optimizer)
        elif self._sharded:
            load_full_state(self.module, self.optimizer, payload["model"], payload["optimizer"])
        else:
            try:
                self.module.load_state_dict(payload["model"])
            except RuntimeError as error:  # what the shape check cannot see (bond sizes off the structure)
                first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
                raise ForeignCheckpointError(first.rstrip(".")) from error
            self.optimizer.load_state_dict(payload["optimizer"])
        if rewrap:
            self.model = self._ddp()
        self.objective.load_state_dict(payload.get("objective", payload.get("rank_adaptation")))  # type: ignore[arg-type]  # one of the two is saved
        progress = payload["progress"]
        self.step = int(progress["step"])
        self.epoch = int(progress["epoch"])
        self.batch_in_epoch = int(progress["batch_in_epoch"])
        if not rollback:
            self.guard.load_state_dict(payload["guard"])
            self._time_before = float(progress.get("train_time_s", 0.0))
            self._fit_started = time.perf_counter()
        per_rank = payload.get("rng_per_rank", [])
        restore_rng(per_rank[self.process_rank] if len(per_rank) == self.world_size else payload["rng"])
        self._window.load_state_dict(payload.get("window"))
        self._invalidate_graph()

    def _rollback(self) -> None:
        failed_at = self.step
        path = None if self.checkpoint_dir is None else latest_checkpoint(self.checkpoint_dir)
        self.guard.begin_rollback(failed_at, path is not None)
        self._restore(load_checkpoint(path), rollback=True)  # type: ignore[arg-type]  # begin_rollback raises without one
        self.metrics.drop_after(self.step)
        self._event("rollback", failed_at=failed_at, checkpoint=str(path), nonfinite=self.guard.total)
        if self._bar is not None:
            self._bar.n = self.step
            self._bar.refresh()
