"""The check that a prepared corpus's shards are the ones its index describes, before training reads any,
with a record of shards already checked so that a later start does not hash them again.

Every shard's size is compared with its index entry at each start. Its SHA-256 is computed and compared
once; the result is recorded in the cache folder (``shard-checks/<digest of the folder and its
index>.json``: per shard its size, modification time in ns, inode and the SHA-256 found) and a shard whose
size, modification time and inode are those recorded is not read again (a shard modified in the last two
seconds before its check is not recorded, so a write in the same clock tick is not missed). Changing a
shard's bytes changes its modification time (unless it is set back on purpose), so a damaged shard is hashed
again and named.
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

__all__ = ["CHECKS_FOLDER", "check_shards"]

CHECKS_FOLDER = "shard-checks"
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


def check_shards(folder: str | os.PathLike, index: dict[str, Any], cache_dir: str | os.PathLike) -> int:
    """``ValueError`` naming the first shard of ``index`` (read from ``folder``) that is missing or whose size
    or SHA-256 differs from its entry (module docstring); returns the number of shards hashed in this call.

    A damaged shard is named with what differs and how to redo it (``comera prepare`` again).
    """
    folder, cache_dir = Path(folder), Path(cache_dir)
    path = _record_path(folder, cache_dir)
    record = _read_record(path)
    hashed = 0
    for split in SPLITS:
        for entry in index["splits"][split]["shards"]:
            problem = shard_problem(folder, entry, hash_bytes=False)
            if problem is not None:
                raise _damaged(folder, index, problem)
            stat = (folder / entry["name"]).stat()
            seen = [stat.st_size, stat.st_mtime_ns, stat.st_ino, entry["sha256"]]
            if record.get(entry["name"]) == seen:
                continue
            hashed += 1
            problem = shard_problem(folder, entry)
            if problem is not None:
                raise _damaged(folder, index, problem)
            if time.time_ns() - stat.st_mtime_ns > _SETTLED_NS:
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
