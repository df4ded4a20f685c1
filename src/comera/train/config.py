"""``TrainConfig``: the generic settings of a training run (any method), checked on construction; a method's
own settings (CoMERA's: :class:`comera.methods.comera.CoMERASettings`) are not here. Details:
docs/training.md, 'The loop'.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from comera.checks import check_int, check_number, check_optional_int
from comera.train.padding import check_buckets
from comera.train.schedule import check_schedule

__all__ = [
    "TrainConfig",
    "AUTO_COMPILE_MIN_STEPS",
    "MAX_SEED",
    "PARALLEL_MODES",
    "DEVICE_NAME",
    "PRECISIONS",
    "UNITS",
]

UNITS = ("epoch", "step")
PRECISIONS = ("fp32", "bf16", "fp8")
PARALLEL_MODES = ("ddp", "fsdp")
"""How a run in several processes holds the model (``TrainConfig.parallel``)."""
DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")
"""The forms :attr:`TrainConfig.device` takes (besides None)."""
MAX_SEED = 2**63 - 2
"""The largest ``TrainConfig.seed``: the seeds derived from it (per epoch, per rank) are taken modulo
``2**63 - 1``, which keeps them in the range every generator accepts."""
AUTO_COMPILE_MIN_STEPS = 10_000
"""With ``compile="auto"``, CPU runs of at least this many steps compile the training step."""


def _pad_key(key: object) -> bool:
    return isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and key >= 0)


def _pad_value(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


_DEFAULT_BACKEND = "inductor"
"""torch.compile's default backend, always registered."""


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :class:`comera.train.Trainer`; paper values where the paper gives them. Intervals count
    steps; a run also evaluates and checkpoints at its last step.

    Attributes:
        early: length of the early stage (>= 0) in ``unit`` s. Paper: 20 epochs.
        late: length of the late stage (>= 0); 0 skips it (an objective without stages runs ``early + late``).
            Paper: 10 epochs.
        unit: ``"epoch"`` or ``"step"``.
        lr_other: learning rate of the parameters the objective gives no rate of its own (default AdamW on the
            objective's ``param_groups``).
        weight_decay: AdamW's decay.
        grad_clip: clip the total gradient norm to this value (> 0); None = no clipping.
        lr_schedule: ``"constant"`` or ``"cosine"`` (linear warm-up, then a half cosine down to
            ``min_lr_ratio`` of each group's peak; :mod:`comera.train.schedule`).
        warmup: fraction of the run's steps that warm up (in ``[0, 1)``).
        min_lr_ratio: the rate the cosine ends at, as a fraction of each group's peak (in ``[0, 1]``).
        batch_size: as ``torch.utils.data.DataLoader`` (map-style data only; the global batch under
            ``torchrun``).
        shuffle: as ``torch.utils.data.DataLoader`` (map-style data only).
        drop_last: as ``torch.utils.data.DataLoader`` (map-style data only).
        seed: seeds torch, ``random`` and numpy at the start of a fresh run, and the data order.
        log_every: steps between metric records and progress-bar updates.
        eval_every: steps between evaluations; None = every epoch end.
        run_dir: folder for ``metrics.jsonl`` and plots; None = no files.
        checkpoint_dir: folder for checkpoints; None = ``run_dir/checkpoints`` (or none without run_dir).
        checkpoint_every: steps between checkpoints; None = every epoch end.
        keep_checkpoints: how many recent checkpoints to keep (>= 1).
        max_nonfinite: consecutive non-finite steps (skipped) before rolling back to the last checkpoint.
        max_rollbacks: rollbacks allowed before giving up with ``NonFiniteError``.
        progress: show a tqdm progress bar; None = only when stderr is a terminal.
        plot: write the PNG plots into ``run_dir`` at the end of :meth:`Trainer.fit`.
        compile: ``torch.compile`` the training step: True, False, or ``"auto"`` (on CPU when the run has at
            least :data:`AUTO_COMPILE_MIN_STEPS` steps).
        compile_backend: ``torch.compile``'s backend.
        precision: ``"fp32"``, ``"bf16"`` (forward and objective under bfloat16 autocast; parameters,
            gradients and optimizer state fp32) or ``"fp8"`` (every ``TTLinear``'s batch-sized GEMMs in FP8).
        device: None (where the model is), ``"cpu"``, ``"cuda"`` (GPU ``LOCAL_RANK`` under ``torchrun``) or
            ``"cuda:N"``; the model is moved there in place before wrapping or building an optimizer.
        reuse_cpu_memory: on CPU, call :func:`comera.cpu.reuse_freed_memory` (a process-wide glibc setting)
            when the Trainer is built.
        cuda_graph: replay the whole step as a CUDA graph (:class:`comera.train.cuda_graph.CudaGraphStep`);
            needs a CUDA model, one process, ``compile`` not True and capturable AdamW/Adam.
        graph_buckets: sequence lengths to pad batches to (strictly increasing), one graph each; None for
            fixed-shape batches.
        graph_pad: with ``graph_buckets``, ``{batch key or tuple index: pad value}`` of the entries to pad.
        graph_length_dim: the dimension padded (>= 0; default 1, ``(batch, length, ...)``).
        graph_warmup: warm-up steps before each capture (>= 1); their effects are undone.
        parallel: under ``torchrun``, ``"ddp"`` (every rank holds the whole model) or ``"fsdp"`` (FSDP2 shards
            the dense parts; :mod:`comera.train.fsdp`).
        shard_cores: with ``"fsdp"``, shard the tensorized layers' parameters too (a prune point then rebuilds
            the model: :mod:`comera.train.reshard`).

    Examples:
        >>> import comera
        >>> config = comera.TrainConfig(early=100, late=50, unit="step", batch_size=32, lr_schedule="cosine")
        >>> config.early + config.late, config.lr_schedule
        (150, 'cosine')
        >>> comera.TrainConfig.from_dict(config.to_dict()) == config
        True
    """

    early: int = 1
    late: int = 0
    unit: str = "epoch"
    lr_other: float = 5e-5
    weight_decay: float = 0.0
    grad_clip: float | None = None
    lr_schedule: str = "constant"
    warmup: float = 0.1
    min_lr_ratio: float = 0.1
    batch_size: int = 32
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None
    run_dir: str | os.PathLike | None = None
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    max_nonfinite: int = 3
    max_rollbacks: int = 2
    progress: bool | None = None
    plot: bool = True
    compile: bool | str = "auto"
    compile_backend: str = _DEFAULT_BACKEND
    precision: str = "fp32"
    device: str | None = None
    reuse_cpu_memory: bool = True
    cuda_graph: bool = False
    graph_buckets: tuple[int, ...] | None = None
    graph_pad: dict[str | int, float] | None = None
    graph_length_dim: int = 1
    graph_warmup: int = 3
    parallel: str = "ddp"
    shard_cores: bool = False

    def __post_init__(self) -> None:
        check_int(self.early, "early", 0)
        check_int(self.late, "late", 0)
        if self.early + self.late == 0:
            raise ValueError("early + late must be >= 1: the run has no steps")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        for name in ("lr_other", "weight_decay"):
            check_number(getattr(self, name), name, 0.0)
        if self.grad_clip is not None:
            check_number(self.grad_clip, "grad_clip", 0.0, open_low=True)
        check_schedule(self.lr_schedule, self.warmup, self.min_lr_ratio)
        check_int(self.batch_size, "batch_size", 1)
        check_int(self.seed, "seed", 0, MAX_SEED)
        check_int(self.log_every, "log_every", 1)
        check_optional_int(self.eval_every, "eval_every", 1)
        check_optional_int(self.checkpoint_every, "checkpoint_every", 1)
        check_int(self.keep_checkpoints, "keep_checkpoints", 1)
        check_int(self.max_nonfinite, "max_nonfinite", 1)
        check_int(self.max_rollbacks, "max_rollbacks", 0)
        for name in ("run_dir", "checkpoint_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a path (str or os.PathLike) or None, got {value!r}")
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {self.compile!r}")
        # torch.compile's own default is always registered; asking the registry imports torch._dynamo
        # (about a second), which a run that never compiles need not pay
        backend = self.compile_backend
        if not isinstance(backend, str) or (
            backend != _DEFAULT_BACKEND and backend not in torch.compiler.list_backends(exclude_tags=())
        ):
            raise ValueError(
                "compile_backend must be a torch.compile backend name (one of "
                f"{torch.compiler.list_backends(exclude_tags=())}, or one registered with "
                f"torch._dynamo.register_backend), got {backend!r}"
            )
        if self.device is not None and not (
            isinstance(self.device, str) and DEVICE_NAME.fullmatch(self.device)
        ):
            raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N' (N >= 0), got {self.device!r}")
        if not isinstance(self.reuse_cpu_memory, bool):
            raise ValueError(f"reuse_cpu_memory must be True or False, got {self.reuse_cpu_memory!r}")
        self._check_graph()
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        if not isinstance(self.shard_cores, bool):
            raise ValueError(f"shard_cores must be True or False, got {self.shard_cores!r}")

    def _check_graph(self) -> None:
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {self.cuda_graph!r}")
        if self.cuda_graph and self.compile is True:
            raise ValueError(
                "cuda_graph=True excludes compile=True (the graph replays the eager step); "
                "set compile=False or 'auto'"
            )
        if self.graph_buckets is not None:
            try:
                object.__setattr__(self, "graph_buckets", check_buckets(self.graph_buckets))
            except ValueError:
                raise ValueError(
                    "graph_buckets must be None or a strictly increasing tuple of ints >= 1, "
                    f"got {self.graph_buckets!r}"
                ) from None
        if self.graph_pad is not None:
            if (
                not isinstance(self.graph_pad, Mapping)
                or not self.graph_pad
                or not all(_pad_key(key) and _pad_value(value) for key, value in self.graph_pad.items())
            ):
                raise ValueError(
                    "graph_pad must be None or a non-empty dict {batch key (str) or tuple index (int >= 0): "
                    f"finite pad value}}, got {self.graph_pad!r}"
                )
            object.__setattr__(self, "graph_pad", dict(self.graph_pad))
        if (self.graph_buckets is None) != (self.graph_pad is None):
            raise ValueError(
                "graph_buckets and graph_pad go together: give both (padded lengths) or neither "
                "(fixed shapes)"
            )
        if self.graph_buckets is not None and not self.cuda_graph:
            raise ValueError("graph_buckets and graph_pad are used only with cuda_graph=True")
        check_int(self.graph_length_dim, "graph_length_dim", 0)
        check_int(self.graph_warmup, "graph_warmup", 1)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (lists for tuples), storable in a ``weights_only`` checkpoint or JSON."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig keys {unknown}; valid keys: {sorted(known)}")
        fields: dict[str, Any] = {key: tuple(v) if isinstance(v, list) else v for key, v in values.items()}
        return cls(**fields)
