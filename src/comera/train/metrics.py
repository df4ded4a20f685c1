"""``metrics.jsonl``: one JSON object per line (``"kind"``: ``"train"``, ``"eval"`` or ``"event"``), appended
as training goes; a torn last line is ignored when read and cut off before appending. Details:
docs/recipes.md, 'The run folder'.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from comera.atomic import atomic_write_bytes
from comera.cpu import reset_peak_resident, status_kib

__all__ = [
    "METRICS_NAME",
    "HISTORY_EVENTS",
    "MetricsLog",
    "carries_ranks",
    "read_metrics",
    "record_problem",
    "peak_memory_mib",
    "reset_peak_memory",
]

METRICS_NAME = "metrics.jsonl"
HISTORY_EVENTS = (
    "resume",
    "rollback",
    "unreadable_checkpoint",
    "foreign_checkpoint",
    "torn_record_dropped",
    "records_missing",
)
"""Events kept when the records after a checkpoint are dropped: the run's own history, not its training."""
STEP_KINDS = ("train", "eval", "event")
"""The kinds of record the Trainer writes, each with its step."""


def _record(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """``(the record a line holds, "")``, or ``(None, why it holds none)``: not UTF-8, not JSON, not a JSON
    object, a ``"step"`` that is not an integer, or none in a record of the Trainer's kinds."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "is not UTF-8"
    except json.JSONDecodeError:
        return None, "is not valid JSON"
    if not isinstance(record, dict):
        return None, f"is a {type(record).__name__}, not a JSON object"
    kind = record.get("kind")
    if kind in STEP_KINDS and "step" not in record:
        return None, f"is a record of kind {kind!r} without a step"
    if kind == "event" and not isinstance(record.get("event"), str):
        return None, "is an event record without an event name"
    step = record.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int):
        return None, f"has a step that is not an integer ({step!r})"
    return record, ""


_NEEDED = {"train": ("step", "loss", "ratio"), "eval": ("step", "metrics"), "event": ("step", "event")}
"""The keys a record of each of the Trainer's kinds must hold to be read (plotted, summarised)."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rank_record(ranks: object) -> bool:
    """Whether ``ranks`` is what a train record holds under ``"ranks"``: layer name -> list of ints."""
    return isinstance(ranks, dict) and all(
        isinstance(bonds, list) and all(isinstance(rank, int) for rank in bonds) for bonds in ranks.values()
    )


def carries_ranks(records: list[dict[str, Any]]) -> bool:
    """Whether a run's train records carry ranks (a rank-adaptive objective): then each of them must."""
    return any("ranks" in record for record in records if record.get("kind") == "train")


def record_problem(record: dict[str, Any], ranked: bool) -> str | None:
    """Why a record of the Trainer's kinds cannot be read, as the end of a sentence naming it, or None: it
    lacks a key its kind needs, a train record's ``loss`` or ``ratio`` is not a number (NaN, for a window of
    skipped steps, is one), or (``ranked``: the run's train
    records carry ranks, :func:`carries_ranks`) a train record's ``ranks`` is not layer -> list of ints."""
    kind = record.get("kind")
    missing = [key for key in _NEEDED.get(kind, ()) if key not in record]
    if missing:
        return f"lacks {missing}"
    if kind == "train":
        wrong = [f"{key}={record[key]!r}" for key in ("loss", "ratio") if not _number(record[key])]
        if wrong:
            return f"holds {wrong[0]}, not what its kind holds"
        if ranked and not _rank_record(record.get("ranks")):
            return (
                "has no ranks of its layers (a mapping of layer names to lists of ranks), got "
                f"{record.get('ranks')!r}"
            )
    return None


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]], bool]:
    """The records of ``path``, ``(number, why)`` of the lines that hold no record (:func:`_record`), and
    whether the last of those is the file's torn tail (a last line without its newline)."""
    data = path.read_bytes()
    lines = data.splitlines()
    records, invalid = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, why = _record(line)
        if record is None:
            invalid.append((number, why))
        else:
            records.append(record)
    torn = bool(invalid) and invalid[-1][0] == len(lines) and not data.endswith(b"\n")
    return records, invalid, torn


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` file (or a run folder); a torn last line is ignored.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the path is not a regular file (a pipe), or a line other than a torn last one holds
            no record (not UTF-8, not a JSON object, a step that is not an integer).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path}: metrics file not found")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file (a pipe, a device), so it holds no records to read")
    records, invalid, torn = _parse_lines(path)
    damaged = invalid[:-1] if torn else invalid
    if damaged:
        number, why = damaged[0]
        raise ValueError(f"{path}: line {number} {why}")
    return records


def reset_peak_memory(device: torch.device) -> None:
    """Start :func:`peak_memory_mib`'s peak afresh from what is in memory now: the CUDA allocator's peak on a
    CUDA device, else the kernel's resident high-water mark (Linux; elsewhere the process's lifetime peak
    stays what is reported). The Trainer calls it when :meth:`~comera.train.Trainer.fit` starts, so a run's
    peak covers training, not what the process did before (building the data, training a tokenizer)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_resident()


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory since the last :func:`reset_peak_memory` (or the process's start): CUDA allocator peak on
    a CUDA device, else the resident high-water mark (``VmHWM``; the process's ``ru_maxrss`` where the
    kernel does not report it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    high = status_kib("VmHWM")
    if high is not None:
        return high / 2**10
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _repeat_key(record: dict[str, Any]) -> str | None:
    """What makes a second record a repeat of the first: kind and step for ``train``/``eval``, the whole
    record for an event other than a history event (two resumes from one checkpoint are two resumes); None
    for records that may repeat."""
    kind = record.get("kind")
    if kind in ("train", "eval"):
        return f"{kind}:{record.get('step')}"
    if kind == "event" and record.get("event") not in HISTORY_EVENTS:
        return json.dumps(record, sort_keys=True, allow_nan=True)
    return None


class MetricsLog:
    """Appends records to ``directory/metrics.jsonl`` (or keeps nothing when ``directory`` is None); an
    existing file's torn last line is cut off when the log is opened (:attr:`torn_bytes`: bytes cut).

    Raises:
        ValueError: something other than a regular file (a folder, a pipe) is ``directory/metrics.jsonl``.
    """

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.path = None if directory is None else Path(directory) / METRICS_NAME
        self.torn_bytes = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and not self.path.is_file():
                raise ValueError(
                    f"{self.path}: not a regular file (the metrics log goes there); move it away"
                )
            self.torn_bytes = self._cut_torn_tail()

    def _cut_torn_tail(self) -> int:
        if not self.path.is_file():
            return 0
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return 0
        whole = data.rfind(b"\n") + 1
        with self.path.open("r+b") as file:
            file.truncate(whole)
            file.flush()
            os.fsync(file.fileno())
        return len(data) - whole

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it to the OS."""
        if self.path is None:
            return
        with self.path.open("a") as file:
            file.write(json.dumps(record, allow_nan=True) + "\n")

    def drop_after(self, step: int) -> tuple[int, int]:
        """Rewrite the file (atomically) without the records of steps after ``step`` (but for
        :data:`HISTORY_EVENTS`), without lines that hold no record or a record that cannot be read
        (:func:`record_problem`: a train record without its loss, say), and without repeats: a second
        ``train`` or ``eval`` record of one step, a second copy of an event other than a history event (a
        log whose lines were copied twice would otherwise count them twice; the first is kept). Returns
        ``(lines holding no readable record, repeats)`` dropped."""
        if self.path is None or not self.path.is_file():
            return 0, 0
        records, invalid, _ = _parse_lines(self.path)
        ranked = carries_ranks(records)
        readable = [record for record in records if record_problem(record, ranked) is None]
        kept = [
            record
            for record in readable
            if record.get("step", 0) <= step or record.get("event") in HISTORY_EVENTS
        ]
        seen: set[str] = set()
        unique = []
        for record in kept:
            key = _repeat_key(record)
            if key is not None and key in seen:
                continue
            if key is not None:
                seen.add(key)
            unique.append(record)
        text = "".join(json.dumps(record, allow_nan=True) + "\n" for record in unique)
        atomic_write_bytes(self.path, text.encode())
        return len(invalid) + len(records) - len(readable), len(kept) - len(unique)
