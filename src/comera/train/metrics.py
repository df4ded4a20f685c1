"""``metrics.jsonl``: one JSON object per line, appended as training goes.

Each record has ``"kind"``:

- ``"train"``: ``step, epoch, stage, loss`` (mean task loss since the last record), ``objective``, ``size``,
  ``ratio``, ``ranks`` (``{layer: [active rank per bond]}``), ``lr`` (``{group: lr}``), ``step_time`` (mean
  seconds per step), ``steps_per_second``, ``peak_memory_mib``, ``nonfinite`` (steps skipped so far).
- ``"eval"``: ``step, epoch, stage`` and the evaluation metrics under ``"metrics"``.
- ``"event"``: ``step`` and ``"event"`` (``"late_stage"``, ``"prune"``, ``"rollback"``, ``"resume"``) with
  details.

On resume, records of steps after the checkpoint are dropped (they will be recomputed); events are kept.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["METRICS_NAME", "MetricsLog", "read_metrics", "peak_memory_mib"]

METRICS_NAME = "metrics.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` file (or a run folder); a torn last line is ignored."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: metrics file not found")
    records = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not valid JSON") from None
    return records


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on a CUDA device, else the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class MetricsLog:
    """Appends records to ``directory/metrics.jsonl`` (or keeps nothing when ``directory`` is None)."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.path = None if directory is None else Path(directory) / METRICS_NAME
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it to the OS."""
        if self.path is None:
            return
        with self.path.open("a") as file:
            file.write(json.dumps(record, allow_nan=True) + "\n")

    def drop_after(self, step: int) -> None:
        """Rewrite the file without ``train``/``eval`` records of steps after ``step`` (atomic rename)."""
        if self.path is None or not self.path.is_file():
            return
        kept = [
            record
            for record in read_metrics(self.path)
            if record.get("kind") == "event" or record.get("step", 0) <= step
        ]
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        with temporary.open("w") as file:
            file.writelines(json.dumps(record, allow_nan=True) + "\n" for record in kept)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)
