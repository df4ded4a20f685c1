"""``CheckpointManager``: the checkpoints of one :class:`~comera.train.trainer.Trainer`: the state it saves,
where and how many are kept, and the resume (newest readable checkpoint, a given file, or a rollback after
non-finite steps) that restores the model, optimizer, objective, progress and RNG states."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from comera.atomic import remove_stale_temporaries
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
from comera.train.distributed import barrier, gather_objects
from comera.train.fsdp import full_state, load_full_state, unfuse_mixed_groups
from comera.train.metrics import read_metrics
from comera.train.parallel import seed_process
from comera.train.reshard import rebuilt_on
from comera.train.sharded_checkpoint import load_sharded_state, save_sharded_checkpoint
from comera.version import __version__

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves and restores the training state of ``trainer`` in ``folder`` (None: no checkpoints), keeping
    the newest ``config.keep_checkpoints``; under DDP and FSDP every rank calls each method."""

    def __init__(self, trainer: Any, folder: Path | None) -> None:  # a Trainer (which imports this module)
        self.trainer = trainer
        self.folder = folder
        self._deferred_events: list[tuple[str, dict[str, Any]]] = []

    # the state
    def state_dict(self) -> dict[str, Any]:
        """The full training state as tensors and plain values (what a checkpoint file holds); collective
        under DDP (every rank's RNG state) and FSDP (the whole model and optimizer, which only rank 0
        receives)."""
        trainer = self.trainer
        if trainer._sharded:
            model_state, optimizer_state = full_state(trainer.module, trainer.optimizer)
        else:
            model_state, optimizer_state = trainer.module.state_dict(), trainer.optimizer.state_dict()
        return {**self._trainer_state(), "model": model_state, "optimizer": optimizer_state}

    def _trainer_state(self) -> dict[str, Any]:
        """Everything of :meth:`state_dict` but the model and optimizer state; collective under DDP/FSDP."""
        trainer = self.trainer
        rng_per_rank = gather_objects(capture_rng())
        return {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "library_version": __version__,
            "structure": trainer.objective.structure(),
            "objective": trainer.objective.state_dict(),
            "progress": {
                "step": trainer.step,
                "epoch": trainer.epoch,
                "batch_in_epoch": trainer.batch_in_epoch,
                "train_time_s": trainer._train_time(),
            },
            "guard": trainer.guard.state_dict(),
            "window": trainer._window.state_dict(),
            "rng": rng_per_rank[trainer.process_rank],
            "rng_per_rank": rng_per_rank,
            "config": trainer.config.to_dict(),
        }

    def save(self) -> Path:
        """Write the state after the current step atomically and drop all but the newest
        ``keep_checkpoints``; rank 0 writes one file (FSDP: every rank its shards of one folder), and all
        ranks wait until it is in place."""
        trainer = self.trainer
        if self.folder is None:
            raise ValueError("no checkpoint folder: set config.run_dir or config.checkpoint_dir")
        sharded, first = trainer._sharded, trainer.process_rank == 0
        path = checkpoint_path(self.folder, trainer.step, sharded=sharded)
        if first and path.exists() and not (path.is_dir() if sharded else path.is_file()):
            remove_checkpoint(path)  # an entry of the other kind, reported unreadable at the resume
        if sharded:
            save_sharded_checkpoint(path, trainer.module, trainer.optimizer, self._trainer_state())
        elif first:
            save_checkpoint(self.state_dict(), path)
        else:
            self._trainer_state()  # its RNG states are gathered collectively
        if first:
            for _, old in list_checkpoints(self.folder)[: -trainer.config.keep_checkpoints]:
                remove_checkpoint(old)
        barrier()
        return path

    # the start of a fit
    def start(self, resume: bool | str | Path) -> None:
        """Before a fit: delete the temporary files a killed process left, report a torn last line of the
        log, then seed a fresh run (``resume=False``), resume from the newest readable checkpoint
        (``True``) or from the checkpoint file ``resume``."""
        trainer = self.trainer
        if trainer.process_rank == 0:
            for folder in (trainer.run_dir, self.folder):
                if folder is not None:
                    remove_stale_temporaries(folder)
        metrics = trainer.metrics
        if metrics.torn_bytes:
            warnings.warn(
                f"{metrics.path}: dropped a torn last record ({metrics.torn_bytes} bytes without a "
                "newline, left by a process killed mid-write)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._deferred_events.append(("torn_record_dropped", {"bytes": metrics.torn_bytes}))
            metrics.torn_bytes = 0
        if resume is False:
            seed_process(trainer.config.seed, trainer.process_rank)
            self._write_deferred_events()
        elif resume is True:
            self._resume_latest()
        else:
            path = Path(resume)
            self.restore(load_checkpoint(path), rollback=False)
            self._resumed_from(path)

    def _write_deferred_events(self) -> None:
        """Log the events found before the run's state was known (a torn log line, skipped checkpoints) at
        the step the run starts from."""
        for name, details in self._deferred_events:
            self.trainer._event(name, **details)
        self._deferred_events.clear()

    def _skipped(self, kind: str, event: str, path: Path, error: str) -> None:
        warnings.warn(f"skipping {kind}: {error}", RuntimeWarning, stacklevel=5)
        self._deferred_events.append((event, {"checkpoint": str(path), "error": error}))

    def _resume_latest(self) -> None:
        candidates = [] if self.folder is None else list_checkpoints(self.folder)
        for path in [] if self.folder is None else misplaced_entries(self.folder):
            kind = "folder" if path.is_dir() else "file" if path.is_file() else "special file"
            self._skipped(
                "an unreadable checkpoint",
                "unreadable_checkpoint",
                path,
                f"{path}: not a checkpoint, a {kind} with its name",
            )
        for _, path in reversed(candidates):
            try:
                payload = load_checkpoint(path)
            except ValueError as error:
                self._skipped("an unreadable checkpoint", "unreadable_checkpoint", path, str(error))
                continue
            try:
                self.restore(payload, rollback=False)
            except ForeignCheckpointError as error:
                self._skipped("a checkpoint of another model", "foreign_checkpoint", path, f"{path}: {error}")
                continue
            self._resumed_from(path)
            return
        if candidates:  # nothing resumed: the warnings said which were skipped, the log stays as it was
            self._deferred_events.clear()
            raise NoReadableCheckpointError(self.folder, len(candidates))  # type: ignore[arg-type]  # candidates come from it
        where = "no checkpoint folder (config.run_dir and checkpoint_dir are None)"
        if self.folder is not None:
            where = f"no checkpoint in {self.folder}"
        warnings.warn(
            f"resume: {where}; training starts from step 0 (the records of the earlier attempt are dropped)",
            RuntimeWarning,
            stacklevel=4,
        )
        seed_process(self.trainer.config.seed, self.trainer.process_rank)
        self._resumed_from(None)

    def _resumed_from(self, path: Path | None) -> None:
        """Drop the records of steps after the resumed state (and unreadable lines); log the resume."""
        trainer = self.trainer
        unreadable, repeated = trainer.metrics.drop_after(trainer.step)
        self._write_deferred_events()
        details = {"unreadable_lines_dropped": unreadable} if unreadable else {}
        if unreadable:
            warnings.warn(
                f"{trainer.metrics.path}: dropped {unreadable} line(s) that hold no readable record (not "
                "UTF-8, not JSON, not an object, no integer step, or a record that lacks a key of its kind "
                "or holds a value of the wrong type)",
                RuntimeWarning,
                stacklevel=5,
            )
        if repeated:
            details["repeated_records_dropped"] = repeated
            warnings.warn(
                f"{trainer.metrics.path}: dropped {repeated} repeated record(s) (a step's train or eval "
                "record, or an event, logged more than once; the first of each was kept)",
                RuntimeWarning,
                stacklevel=5,
            )
        details["processes"] = trainer.world_size  # a run may resume in another number of processes
        trainer._event("resume", checkpoint=None if path is None else str(path), **details)
        self._warn_of_lost_records()

    def _warn_of_lost_records(self) -> None:
        """Warn (and log an event) when ``metrics.jsonl`` lacks train records of steps up to the resumed one:
        lines lost from the file (cut short, edited) are not written again, the history is incomplete."""
        trainer = self.trainer
        path = trainer.metrics.path
        if path is None or not path.is_file() or trainer.step == 0:
            return
        every = trainer.config.log_every
        logged = {record.get("step") for record in read_metrics(path) if record.get("kind") == "train"}
        missing = [step for step in range(every, trainer.step + 1, every) if step not in logged]
        if not missing:
            return
        warnings.warn(
            f"{path}: the train records of {len(missing)} logged step(s) up to step {trainer.step} are "
            f"missing (the first at step {missing[0]}): lost from the file, they are not written again",
            RuntimeWarning,
            stacklevel=5,
        )
        trainer._event("records_missing", steps=len(missing), first=missing[0])

    # restoring
    def restore(self, payload: dict[str, Any], rollback: bool) -> None:
        """Load a checkpoint's ``payload`` into the trainer: structure (pruning the model to it), model,
        optimizer, objective, progress and RNG states; a rollback keeps the guard's counters and the time.
        ``ForeignCheckpointError`` for another model's checkpoint (before any change, for a whole file)."""
        trainer = self.trainer
        self._check_fits(payload)
        rewrap = trainer.world_size > 1 and not trainer._sharded  # rebuilt on the restored structure
        if rewrap:
            trainer._drop_ddp_wrapper()
        try:
            if trainer._template is not None:
                if payload["structure"] != trainer.objective.structure():
                    fresh = rebuilt_on(
                        trainer._template, trainer.objective, payload["structure"], trainer.module
                    )
                    trainer._install_sharded(fresh)
            else:
                trainer.objective.apply_structure(payload["structure"], trainer.optimizer)
        except ValueError as error:  # before any pruning; gates it set are set again by the next restore
            raise ForeignCheckpointError(str(error)) from error
        self._load_weights(payload)
        if rewrap:
            trainer.model = trainer._ddp()
        trainer.objective.load_state_dict(payload["objective"])
        progress = payload["progress"]
        trainer.step = int(progress["step"])
        trainer.epoch = int(progress["epoch"])
        trainer.batch_in_epoch = int(progress["batch_in_epoch"])
        if not rollback:
            trainer.guard.load_state_dict(payload["guard"])
            trainer._time_before = float(progress.get("train_time_s", 0.0))
            trainer._fit_started = time.perf_counter()
        per_rank = payload.get("rng_per_rank", [])
        restore_rng(per_rank[trainer.process_rank] if len(per_rank) == trainer.world_size else payload["rng"])
        trainer._window.load_state_dict(payload.get("window"))
        trainer._invalidate_graph()

    def _check_fits(self, payload: dict[str, Any]) -> None:
        trainer = self.trainer
        try:
            trainer.objective.check_structure(payload.get("structure"))
        except ValueError as error:
            raise ForeignCheckpointError(str(error)) from error
        if isinstance(payload.get("model"), Mapping):  # a single-file checkpoint: checked before any change
            reference = trainer._template if trainer._template is not None else trainer.module
            own = reference.state_dict(keep_vars=True)
            structure = payload.get("structure") or {}
            shapes = trainer.objective.structure_shapes(structure) if trainer._template is None else {}
            reason = foreign_entry(payload["model"], own, structure, shapes)
            if reason is not None:
                raise ForeignCheckpointError(reason)

    def _load_weights(self, payload: dict[str, Any]) -> None:
        trainer = self.trainer
        if "shards" in payload:
            load_sharded_state(payload["shards"], trainer.module, trainer.optimizer)
            if trainer._sharded:
                unfuse_mixed_groups(trainer.optimizer)
        elif trainer._sharded:
            load_full_state(trainer.module, trainer.optimizer, payload["model"], payload["optimizer"])
        else:
            try:
                trainer.module.load_state_dict(payload["model"])
            except RuntimeError as error:  # what the shape check cannot see (bond sizes off the structure)
                first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
                raise ForeignCheckpointError(first.rstrip(".")) from error
            trainer.optimizer.load_state_dict(payload["optimizer"])

    def rollback(self) -> None:
        """Go back to the newest checkpoint after a run of non-finite steps (the guard raises when none is
        left or the rollbacks ran out), drop the later records and log a ``rollback`` event."""
        trainer = self.trainer
        failed_at = trainer.step
        path = None if self.folder is None else latest_checkpoint(self.folder)
        trainer.guard.begin_rollback(failed_at, path is not None)
        self.restore(load_checkpoint(path), rollback=True)  # type: ignore[arg-type]  # begin_rollback raises without one
        trainer.metrics.drop_after(trainer.step)
        trainer._event("rollback", failed_at=failed_at, checkpoint=str(path), nonfinite=trainer.guard.total)
        if trainer._bar is not None:
            trainer._bar.n = trainer.step
            trainer._bar.refresh()
