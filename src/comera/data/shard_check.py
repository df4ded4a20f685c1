"""The check that a prepared corpus's shards are the ones its index describes (size at each start, SHA-256
once, recorded by size, modification time and inode in the cache folder), before training reads any.
Details: docs/llm.md, 'Bringing a corpus' ('Training').
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from comera.atomic import atomic_write_bytes
from comera.data.token_shards import INDEX_FILE, SPLITS, shard_problem

__all__ = ["CHECKS_FOLDER", "WRITTEN_RECORD", "check_shards", "record_written_shards"]

CHECKS_FOLDER = "shard-checks"
WRITTEN_RECORD = "shard-checks.json"
"""The preparation's record of the shards it wrote, in the prepared folder."""
_SETTLED_NS = 2 * 10**9
"""A shard modified less than this long before its check is not recorded (hashed again next time): a write
within the file system's timestamp granularity of the check would otherwise keep its recorded time."""


def _record_path(folder: Path, cache_dir: Path) -> Path:
    key = hashlib.sha256(str(folder.resolve()).encode() + b"\0" + (folder / INDEX_FILE).read_bytes())
    return cache_dir / CHECKS_FOLDER / f"{key.hexdigest()[:24]}.json"


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _shards(index: dict[str, Any]) -> list[dict[str, Any]]:
    return [entry for split in SPLITS for entry in index["splits"][split]["shards"]]


def _seen(folder: Path, entry: dict[str, Any]) -> list[Any]:
    stat = (folder / entry["name"]).stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, entry["sha256"]]


def _settled(seen: list[Any]) -> bool:
    return time.time_ns() - seen[1] > _SETTLED_NS


def record_written_shards(folder: str | os.PathLike, index: dict[str, Any]) -> None:
    """Write ``WRITTEN_RECORD`` in ``folder``: every shard of the complete ``index`` that its preparation has
    just written, with the SHA-256 the preparation computed while writing it, as :func:`check_shards` records
    a shard it hashed (a shard written in the last two seconds is left out, to be hashed at the first start).
    """
    folder = Path(folder)
    record = {}
    for entry in _shards(index):
        seen = _seen(folder, entry)
        if _settled(seen):
            record[entry["name"]] = seen
    atomic_write_bytes(folder / WRITTEN_RECORD, json.dumps(record).encode())


def check_shards(folder: str | os.PathLike, index: dict[str, Any], cache_dir: str | os.PathLike) -> int:
    """``ValueError`` naming the first shard of ``index`` (read from ``folder``) that is missing or whose size
    or SHA-256 differs from its entry, with how to redo it (``comera prepare`` again); returns the number
    of shards hashed in this call.
    """
    folder, cache_dir = Path(folder), Path(cache_dir)
    path = _record_path(folder, cache_dir)
    record = _read_record(path)
    written = _read_record(folder / WRITTEN_RECORD)
    hashed = 0
    for entry in _shards(index):
        problem = shard_problem(folder, entry, hash_bytes=False)
        if problem is not None:
            raise _damaged(folder, index, problem)
        seen = _seen(folder, entry)
        if seen in (record.get(entry["name"]), written.get(entry["name"])):
            continue
        hashed += 1
        problem = shard_problem(folder, entry)
        if problem is not None:
            raise _damaged(folder, index, problem)
        if _settled(seen):
            record[entry["name"]] = seen
    if hashed:
        atomic_write_bytes(path, json.dumps(record).encode())
    return hashed


def _damaged(folder: Path, index: dict[str, Any], problem: str) -> ValueError:
    source = index.get("source", {}).get("path", "SOURCE")
    return ValueError(
        f"--data {folder}: {problem}; training reads no shard of it. Encode it again with comera prepare llm "
        f"--data {source} --out {folder} (the same settings)"
    )
