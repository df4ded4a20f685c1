"""``CoMERATrainer``: a ``transformers.Trainer`` that trains a tensorized model the CoMERA way (the rank
objective once per optimizer step, CoMERA's parameter groups, stages and prune points, size logs, saving
with :func:`comera.save_pretrained` and resuming with CoMERA's state); everything else is Hugging Face's,
and settings it cannot honour are refused. Details, with the list of refused settings and why:
docs/training.md, 'Training with Hugging Face's Trainer'.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from comera.atomic import atomic_write_bytes
from comera.integrations.hf_loss import ChunkedLossMixin
from comera.integrations.hf_stages import CoMERACallback, early_steps_of, inner_optimizer
from comera.io import read_saved, save_pretrained
from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.modules import unwrap_model
from comera.report import compression_report
from comera.version import __version__

__all__ = ["CoMERATrainer", "STATE_NAME", "read_state"]

STATE_NAME = "comera_state.json"
"""The file of a checkpoint folder that holds CoMERA's part of the run's state
(:meth:`CoMERATrainer.comera_state`)."""
STATE_FORMAT = "comera-hf-trainer-state"


def read_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The :data:`STATE_NAME` record of a checkpoint folder (``{"format", "format_version",
    "library_version", "structure", "objective", "schedule"}``).

    Raises:
        ValueError: the folder holds no such file, or one that is not CoMERATrainer's.
    """
    path = Path(folder) / STATE_NAME
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: the checkpoint was not written by CoMERATrainer, which records there the "
            "pruned ranks and the controller's state that a resumed run needs"
        )
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: not a CoMERATrainer state (its format is not {STATE_FORMAT!r})")
    return state


PRUNABLE_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")
"""The ``args.optim`` values a run that prunes may use: ``torch.optim`` optimizers whose state is per entry of
the parameter (or a scalar), which :func:`comera.prune_` slices with the parameter."""

_REFUSED_FLAGS = (
    (
        "load_best_model_at_end",
        "Hugging Face would load the best checkpoint's weights with its own loader into a model that a later "
        "prune may have shrunk; leave it False and load the best checkpoint with "
        "comera.load_pretrained(folder, base_model=...) after training",
    ),
    (
        "auto_find_batch_size",
        "a retry after running out of memory restarts at step 0 with the model already trained and pruned "
        "and the objective in its later stage",
    ),
    (
        "enable_jit_checkpoint",
        "its checkpoint is taken before CoMERA's work at the end of the step (controller, stages, prunes), "
        "so a resume from it would not continue the run",
    ),
    (
        "use_liger_kernel",
        "Liger's kernels replace the model's MLP and its head's loss by fused ones that read dense weights, "
        "which the tensorized layers do not have",
    ),
)

_IGNORED_OPTIM_ARGS = {
    "adamw_torch": (),
    "adamw_torch_fused": (),
    "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr_decay", "weight_decay", "eps"),
    "rmsprop": ("momentum", "alpha", "eps", "weight_decay"),
}
"""The keys of ``args.optim_args`` that ``transformers`` passes to each of :data:`PRUNABLE_OPTIMIZERS` (it
drops any other key without a word)."""

FOREACH_OPTIMIZERS = (
    torch.optim.AdamW,
    torch.optim.Adam,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)
"""``torch.optim`` classes that :meth:`CoMERATrainer.create_optimizer` builds with ``foreach=True`` when they
are not fused and the keyword arguments do not choose (torch's own default is ``foreach`` on GPUs only; on
the CPU a per-parameter loop over CoMERA's many small cores and gates is slower)."""


def _check_arguments(args: TrainingArguments) -> None:
    """``ValueError`` naming the first field of ``args`` that CoMERATrainer cannot honour (see the module
    docstring)."""
    parallel = getattr(args, "parallelism_config", None) is not None
    if args.deepspeed or args.fsdp or parallel or args.n_gpu > 1:
        raise ValueError(
            "CoMERATrainer trains with DDP (one process per device, torchrun) or in one process: "
            "args.deepspeed, args.fsdp and args.parallelism_config must be unset and args.n_gpu at most 1 "
            f"(got n_gpu={args.n_gpu}); pruning changes parameter shapes, which those wrappers do not follow"
        )
    if args.torch_compile and args.world_size > 1:
        raise ValueError(
            "CoMERATrainer does not support args.torch_compile=True with more than one process "
            f"(world_size={args.world_size}): after a prune it rebuilds DDP's wrapper, which accelerate "
            "compiled"
        )
    for name, reason in _REFUSED_FLAGS:
        if getattr(args, name, False):
            raise ValueError(f"CoMERATrainer does not support args.{name}=True: {reason}")
    if args.fp16 and args.device.type == "cpu":
        raise ValueError(
            "CoMERATrainer does not support args.fp16=True on the CPU: accelerate runs neither fp16 autocast "
            "nor a loss scaler there, so the run would be fp32 without a word; use bf16=True (CPU autocast)"
        )
    if getattr(args, "optim_target_modules", None) is not None:
        raise ValueError(
            f"CoMERATrainer does not support args.optim_target_modules={args.optim_target_modules!r}: it "
            "names the layers of an optimizer that builds its own parameter groups (GaLore, APOLLO ...), "
            "and CoMERATrainer builds CoMERA's"
        )


def _check_optimizer(args: TrainingArguments, prune_at: tuple[str, ...]) -> None:
    """``ValueError`` when the run prunes and ``args.optim`` keeps state a prune cannot slice, or when
    ``args.optim_args`` holds a key that ``transformers`` would drop for a ``torch.optim`` optimizer."""
    optim = getattr(args.optim, "value", args.optim)
    if prune_at and optim not in PRUNABLE_OPTIMIZERS:
        raise ValueError(
            f"CoMERATrainer does not support args.optim={optim!r} in a run that prunes (prune_at="
            f"{prune_at!r}): a prune slices only optimizer state shaped like the parameter; use one of "
            f"{PRUNABLE_OPTIMIZERS} or CoMERASettings(prune_at=())"
        )
    taken = _IGNORED_OPTIM_ARGS.get(optim)
    if taken is not None and args.optim_args:
        for pair in args.optim_args.replace(" ", "").split(","):
            key = pair.split("=", 1)[0]
            if key not in taken:
                raise ValueError(
                    f"CoMERATrainer does not support {key!r} in args.optim_args with args.optim={optim!r}: "
                    f"transformers passes only {taken or 'no key'} to that optimizer and would drop it; set "
                    "it through optimizer_cls_and_kwargs"
                )


class CoMERATrainer(ChunkedLossMixin, Trainer):
    """``transformers.Trainer`` with CoMERA's rank objective, parameter groups, stages and prune points.

    Args:
        model: a model with gated layers (``comera.tensorize_`` first) whose forward returns the task loss
            (``output.loss``); None with ``model_init=``, then every ``train()`` trains a fresh model.
        args: the ``TrainingArguments``.
        settings: CoMERA's settings (default :class:`CoMERASettings`).
        early: length of the early stage: an int (optimizer steps) or a float in ``[0, 1]`` (that fraction of
            the run's ``max_steps``); the late stage is the rest of the run.
        loss_chunk_size: None (the model's own loss), or tokens per chunk of the causal-LM loss
            (:class:`comera.integrations.hf_loss.ChunkedLossMixin`).
        **kwargs: ``transformers.Trainer``'s other arguments (``train_dataset``, ``model_init`` ...).

    Attributes:
        objective: the run's :class:`CoMERAObjective`, on the model being trained (``trainer.model``).
        comera_callback: the :class:`CoMERACallback` running the schedule; its ``events`` list what happened
            between steps.

    Raises:
        ValueError: an unsupported setting (docs/training.md lists them), or a model without gated layers.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *,
        settings: CoMERASettings | None = None,
        early: int | float = 0.5,
        loss_chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be a transformers.TrainingArguments, got {type(args).__name__}")
        _check_arguments(args)
        early_steps_of(early, 0)
        self._settings, self._early = settings, early
        self.objective: CoMERAObjective | None = None
        super().__init__(model=model, args=args, loss_chunk_size=loss_chunk_size, **kwargs)
        self._bind(self.model)
        self._task_loss_sum: torch.Tensor | None = None
        self._task_loss_count = 0
        self._step_task: torch.Tensor | None = None
        self._wrapped_shapes: tuple[nn.Module, list[tuple[int, ...]]] | None = None

    def _bind(self, model: nn.Module) -> None:
        """Build the objective on ``model`` and the callback that runs its schedule (replacing any earlier
        one's)."""
        self.objective = CoMERAObjective(unwrap_model(model), self._settings)
        _check_optimizer(self.args, self.objective.settings.prune_at)
        if getattr(self, "comera_callback", None) is not None:
            self.remove_callback(self.comera_callback)
        self.comera_callback = CoMERACallback(self.objective, self._early)
        self.add_callback(self.comera_callback)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.train``, after checking ``self.args`` again as the constructor did: an
        argument set on ``trainer.args`` after it was built (``load_best_model_at_end``, ...) is refused with
        the same ``ValueError`` before any step."""
        _check_arguments(self.args)
        return super().train(*args, **kwargs)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``transformers.Trainer.call_model_init`` (the constructor's and every ``train()``'s fresh model
        from ``model_init``), with a new objective and schedule bound to the new model."""
        model = super().call_model_init(trial)
        if self.objective is not None:
            self._bind(model)
        return model

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer on CoMERA's parameter groups: ``optimizer_cls_and_kwargs`` if given, else
        ``args.optim``'s (with its betas, epsilon, fused ...); one passed through ``optimizers=`` is kept,
        and one of :data:`FOREACH_OPTIMIZERS` choosing neither ``fused`` nor ``foreach`` gets
        ``foreach=True``.

        Raises:
            ValueError: the optimizer builds its own parameter groups (GaLore, LOMO, layer-wise ...) or is not
                a ``torch.optim.Optimizer`` class.
        """
        if self.optimizer is None:
            if getattr(self, "optimizer_cls_and_kwargs", None) is not None:
                source = "optimizer_cls_and_kwargs"
                optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
            else:
                source = f"args.optim={self.args.optim!r}"
                optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(
                    self.args, self.model if model is None else model
                )
            own_groups = {"params", "model", "optimizer_dict"} & set(optimizer_kwargs)
            if own_groups or not (
                isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
            ):
                raise ValueError(
                    f"{source} builds its own parameter groups or is not a torch.optim.Optimizer; "
                    f"CoMERATrainer needs one that takes CoMERA's groups (e.g. {PRUNABLE_OPTIMIZERS})"
                )
            groups = self.objective.param_groups(
                lr=self.args.learning_rate, weight_decay=self.args.weight_decay
            )
            if optimizer_cls in FOREACH_OPTIMIZERS and not {"fused", "foreach"} & set(optimizer_kwargs):
                optimizer_kwargs = {**optimizer_kwargs, "foreach": True}
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """``transformers.Trainer.training_step``, then, on the micro-batch that ends an optimizer step, the
        rank term once for the whole step (:meth:`add_rank_term`) on the step's task loss averaged over the
        processes; under DDP, a prune since the last step first gets the model a new DDP wrapper.

        Returns:
            The detached 0-dim loss this micro-batch adds to the step's logged loss (a step's
            micro-batches add up to the objective).
        """
        wrapper = self._wrapper_for_current_shapes(model)
        no_sync = wrapper is not model and not self.accelerator.sync_gradients
        with wrapper.no_sync() if no_sync else contextlib.nullcontext():
            task = super().training_step(wrapper, inputs, num_items_in_batch)
        self._step_task = task if self._step_task is None else self._step_task + task
        if not self.accelerator.sync_gradients:
            return task
        local_task, self._step_task = self._step_task, None
        step_task = self.accelerator.reduce(local_task, reduction="mean")
        objective = self.add_rank_term(wrapper, step_task)
        self._task_loss_sum = step_task if self._task_loss_sum is None else self._task_loss_sum + step_task
        self._task_loss_count += 1
        return task + (objective - step_task)

    def _wrapper_for_current_shapes(self, model: nn.Module) -> nn.Module:
        """``model``, or under DDP after a prune changed parameter shapes a new ``DistributedDataParallel``
        around ``self.model`` (DDP's gradient buckets keep the shapes it was built with), made with
        ``accelerate``'s DDP settings and ``find_unused_parameters`` once a prune removed a layer; it becomes
        ``self.model_wrapped``. Every process prunes alike (the gates are the same everywhere), so every
        process rewraps at the same step."""
        if not isinstance(self.model_wrapped, DistributedDataParallel):
            return model
        shapes = [tuple(param.shape) for param in self.model.parameters()]
        known = self._wrapped_shapes is not None and self._wrapped_shapes[0] is self.model_wrapped
        if not known or shapes == self._wrapped_shapes[1]:
            self._wrapped_shapes = (self.model_wrapped, shapes)
            return self.model_wrapped
        handler = self.accelerator.ddp_handler
        settings = handler.to_kwargs() if handler is not None else {}
        if self.objective.leaves_parameters_unused():
            settings["find_unused_parameters"] = True
        old = self.model_wrapped
        self.model_wrapped = DistributedDataParallel(
            self.model, device_ids=old.device_ids, output_device=old.output_device, **settings
        )
        self._wrapped_shapes = (self.model_wrapped, shapes)
        return self.model_wrapped

    def add_rank_term(self, model: nn.Module, step_task: torch.Tensor) -> torch.Tensor:
        """Turn the accumulated task-loss gradients ``d T / d params`` into the gradients of CoMERA's
        objective of the whole step: :meth:`CoMERAObjective.loss` is evaluated once on a stand-in leaf for
        ``T``, its derivative ``d objective / d T`` scales the gradients and its backward adds the size
        term's gradients.

        Args:
            model: the model being trained (its parameters' ``.grad`` hold the step's task-loss gradients).
            step_task: 0-dim detached tensor, the step's task loss ``T``.

        Returns:
            The objective's value (0-dim, detached).
        """
        stand_in = step_task.detach().clone().requires_grad_(True)
        objective = self.objective.loss(stand_in)
        (weight,) = torch.autograd.grad(objective, stand_in, retain_graph=True)
        grads = [param.grad for param in model.parameters() if param.grad is not None]
        if grads:
            torch._foreach_mul_(grads, weight)
        scaler = self.accelerator.scaler  # fp16's loss scaler scaled the task loss's gradients alike
        (objective if scaler is None else scaler.scale(objective)).backward()
        return objective.detach()

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.evaluation_loop`` after :meth:`CoMERAObjective.before_evaluation` (drops the
        tensor-train layers' inference caches)."""
        self.objective.before_evaluation()
        return super().evaluation_loop(*args, **kwargs)

    def comera_metrics(self) -> dict[str, float]:
        """The size entries added to every log record (docs/training.md; syncs with the device)."""
        size = self.objective.size()
        report = compression_report(self.objective.model)
        metrics = {
            "comera_size": float(size),
            "comera_size_ratio": size / self.objective.initial_size,
            "comera_params": float(report.model_params),
            "comera_compression": report.tensorized_ratio,
        }
        if self._task_loss_count:
            metrics["comera_task_loss"] = float(self._task_loss_sum) / self._task_loss_count
            self._task_loss_sum, self._task_loss_count = None, 0
        return metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``transformers.Trainer.log`` with :meth:`comera_metrics` added to ``logs``."""
        super().log({**logs, **self.comera_metrics()}, start_time)

    def comera_state(self) -> dict[str, Any]:
        """CoMERA's part of the run's state, as every checkpoint records it in :data:`STATE_NAME` (plain
        values): the pruned structure (:meth:`CoMERAObjective.structure`: each gated layer's ranks, removed
        layers), the objective's and controller's state (:meth:`CoMERAObjective.state_dict`) and the
        schedule's (:meth:`CoMERACallback.state_dict`). The weights, the optimizer, the scheduler, the random
        generators and the ``TrainerState`` are in Hugging Face's files beside it."""
        return {
            "format": STATE_FORMAT,
            "format_version": 1,
            "library_version": __version__,
            "structure": self.objective.structure(),
            "objective": self.objective.state_dict(),
            "schedule": self.comera_callback.state_dict(),
        }

    def _save_checkpoint(self, model: nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Write :meth:`comera_state` into the checkpoint folder, then Hugging Face's checkpoint (weights
        through :meth:`_save`, optimizer, scheduler, random generators, ``trainer_state.json``; older
        ``transformers`` also pass ``metrics``)."""
        if self.args.should_save:
            folder = (
                Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            atomic_write_bytes(
                folder / STATE_NAME, (json.dumps(self.comera_state(), indent=1) + "\n").encode()
            )
        super()._save_checkpoint(model, trial, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Prune a fresh, unpruned model to the checkpoint's recorded structure, load its weights strictly and
        restore the objective's and the schedule's state, before Hugging Face builds the optimizer and
        loads its state (``train(resume_from_checkpoint=...)`` calls it).

        Raises:
            ValueError: the folder holds no :data:`STATE_NAME`, or a structure or weights this model cannot
                take (naming the file).
        """
        state = read_state(resume_from_checkpoint)
        root = unwrap_model(self.model if model is None else model)
        try:
            self.objective.check_structure(state["structure"])
            self.objective.apply_structure(state["structure"], inner_optimizer(self.optimizer))
        except ValueError as error:
            raise ValueError(f"{Path(resume_from_checkpoint) / STATE_NAME}: {error}") from None
        saved = read_saved(resume_from_checkpoint)
        try:
            root.load_state_dict(saved.tensors, strict=True)
        except RuntimeError as error:
            raise ValueError(f"{saved.directory}: its weights do not fit the model ({error})") from None
        self.objective.load_state_dict(state["objective"])
        self.comera_callback.load_state_dict(state["schedule"])

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write :func:`comera.save_pretrained`'s files, the model's ``config.json`` (with ``architectures``,
        the model's class, as ``transformers`` records it), its ``generation_config.json`` (a model that
        generates) and the processing class into ``output_dir`` (``transformers.Trainer.save_model`` and every
        checkpoint call this; the unwrapped model's own state is saved, so ``state_dict`` is not used)."""
        if not self.args.should_save:
            return
        folder = Path(self.args.output_dir if output_dir is None else output_dir)
        model = unwrap_model(self.accelerator.unwrap_model(self.model))
        save_pretrained(model, folder)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.architectures = [type(model).__name__]  # what transformers' save_pretrained records
            config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(folder)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)
