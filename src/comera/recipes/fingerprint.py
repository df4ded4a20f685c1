"""What identifies a run's ``--data``: ``{relative name: {"bytes": size, "sha256": hex digest}}`` over every
regular file of the data file or folder, so that a resume can tell edited data from the data the run
started with; a prepared corpus's shards take the SHA-256 its index records, unread. Details:
docs/recipes.md, 'Resuming and restarting a run'.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from comera.data.token_shards import INDEX_FILE, SPLITS, is_prepared, read_index

__all__ = ["data_fingerprint", "fingerprint_difference"]


def _file_entry(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of ``path``; a file that cannot be read (no permission) gets ``"sha256": None`` and
    the reason, and is left to the data reader, which skips and counts it or names it."""
    try:
        with path.open("rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as error:
        return {"bytes": path.stat().st_size, "sha256": None, "unreadable": error.strerror or str(error)}
    return {"bytes": path.stat().st_size, "sha256": digest}


def data_fingerprint(path: str | os.PathLike | None) -> dict[str, dict[str, Any]] | None:
    """The fingerprint of the data file or folder ``path``; None for None (the
    recipe's embedded data)."""
    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        return {path.name: _file_entry(path)}
    files = sorted(entry for entry in path.rglob("*") if entry.is_file())
    recorded = _recorded_shards(path)
    return {
        entry.relative_to(path).as_posix(): recorded.get(entry.relative_to(path).as_posix())
        or _file_entry(entry)
        for entry in files
    }


def _recorded_shards(path: Path) -> dict[str, dict[str, Any]]:
    """``{shard name: {"bytes": its size, "sha256": the index's}}`` of a prepared corpus at ``path`` (empty
    when it is none, or its index cannot be read)."""
    if not is_prepared(path):
        return {}
    try:
        index = read_index(path)
        entries = [entry for split in SPLITS for entry in index["splits"][split]["shards"]]
    except (ValueError, KeyError, TypeError):
        return {}
    recorded = {}
    for entry in entries:
        shard = path / entry["name"]
        if entry["name"] != INDEX_FILE and shard.is_file():
            recorded[entry["name"]] = {"bytes": shard.stat().st_size, "sha256": entry["sha256"]}
    return recorded


def _describe(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "absent"
    if entry.get("sha256") is None:
        return f"{entry['bytes']:,} bytes, unreadable ({entry.get('unreadable')})"
    return f"{entry['bytes']:,} bytes, sha256 {entry['sha256'][:12]}"


def fingerprint_difference(
    recorded: dict[str, dict[str, Any]] | None, current: dict[str, dict[str, Any]] | None
) -> str | None:
    """None when the two fingerprints agree (a single data file: when its content does, whatever its name);
    else a phrase naming the first file that differs and how (``"train.tsv: 1,024 bytes, sha256 ab12...
    then, 1,030 bytes, sha256 cd34... now"``)."""
    if recorded == current:
        return None
    if recorded is None or current is None:
        then, now = ("the embedded data", "a data path") if recorded is None else ("a data path", "none")
        return f"the run used {then}, this command gives {now}"
    if len(recorded) == len(current) == 1:  # one data file: its content counts, not its name
        (then_name, then), (now_name, now) = next(iter(recorded.items())), next(iter(current.items()))
        if then == now:
            return None
        now_named = "" if now_name == then_name else f"{now_name}: "
        return f"{then_name}: {_describe(then)} then, {now_named}{_describe(now)} now"
    for name in sorted(set(recorded) | set(current)):
        if recorded.get(name) != current.get(name):
            return f"{name}: {_describe(recorded.get(name))} then, {_describe(current.get(name))} now"
    return None
