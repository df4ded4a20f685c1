"""atomic_write: the temporary file lives in the target folder (same filesystem for ``os.replace``), is
synced before the rename, the folder after it, and nothing is left behind or half-written on failure.

The write callback looks at the folder while the write is in progress; ``os.replace`` and ``os.fsync`` are
observed with spies that call through to the real functions.

atomic_replace_folder: the folder ends up with the new files and every other old entry (files as hard links,
or copies where linking fails; sub-folders; symbolic links as links), the files and folders are synced, and
the parent holds nothing else afterwards. It is swapped in with ``renameat2(RENAME_EXCHANGE)`` where the
system has it (the folder never disappears: no ``os.rename``), otherwise (simulated with a stand-in for
``ctypes`` in ``comera.atomic``) the old folder is renamed aside within the parent; a failure before the swap,
or while renaming aside, leaves the old folder as it was.
"""

import ctypes
import errno
import os
import re
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

import comera.atomic
from comera.atomic import atomic_replace_folder, atomic_write, atomic_write_bytes


def _entries(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def _record_moves(monkeypatch, name: str) -> list[tuple[Path, Path]]:
    """Record each ``os.<name>(source, destination)`` call (``replace`` or ``rename``), then make it."""
    moves = []
    real = getattr(os, name)

    def spy(source, destination):
        moves.append((Path(source), Path(destination)))
        return real(source, destination)

    monkeypatch.setattr(os, name, spy)
    return moves


def test_temporary_file_is_created_in_the_target_folder(tmp_path, monkeypatch):
    target = tmp_path / "run" / "weights.bin"
    target.parent.mkdir()
    (target.parent / "neighbour.txt").write_text("untouched")
    renames = _record_moves(monkeypatch, "replace")
    seen = {}

    def write(file):
        file.write(b"payload")
        new = _entries(target.parent) - {"neighbour.txt"}
        assert len(new) == 1, new
        (name,) = new
        seen["name"] = name
        # the entry in the target folder is the very file being written
        assert os.stat(target.parent / name).st_ino == os.fstat(file.fileno()).st_ino

    assert atomic_write(target, write) == target
    name = seen["name"]
    assert name.startswith(".weights.bin.") and name.endswith(".tmp")
    assert renames == [(target.parent / name, target)]
    assert os.stat(renames[0][0].parent).st_dev == os.stat(target.parent).st_dev
    assert target.read_bytes() == b"payload"
    assert _entries(target.parent) == {"weights.bin", "neighbour.txt"}


def test_file_is_synced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(handle):
        info = os.fstat(handle)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
        events.append((kind, info.st_ino))
        return real_fsync(handle)

    def spy_replace(source, destination):
        events.append(("replace", os.stat(source).st_ino))
        return real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    atomic_write_bytes(target, b"{}")
    written = os.stat(target).st_ino
    assert events == [("file", written), ("replace", written), ("folder", os.stat(tmp_path).st_ino)]


def test_missing_parent_folders_are_created_and_an_existing_file_is_replaced(tmp_path):
    target = tmp_path / "a" / "b" / "c.bin"
    assert atomic_write_bytes(str(target), b"first") == target
    assert target.read_bytes() == b"first"
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert _entries(target.parent) == {"c.bin"}


def test_a_reader_sees_the_old_file_until_the_rename(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")

    def write(file):
        file.write(b"new")
        file.flush()
        assert target.read_bytes() == b"old"

    atomic_write(target, write)
    assert target.read_bytes() == b"new"


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, error):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")

    def write(file):
        file.write(b"partial")
        raise error

    with pytest.raises(type(error)):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert _entries(tmp_path) == {"model.bin"}


def test_a_failed_rename_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "model.bin"

    def failing_replace(source, destination):
        raise OSError("cross-device link")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="cross-device"):
        atomic_write_bytes(target, b"data")
    assert _entries(tmp_path) == set()


def test_an_interrupt_right_after_the_rename_propagates_as_itself(tmp_path, monkeypatch):
    target = tmp_path / "model.bin"
    real_replace = os.replace

    def replace_then_interrupt(source, destination):
        real_replace(source, destination)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):  # not a FileNotFoundError from cleaning up the renamed file
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert _entries(tmp_path) == {"model.bin"}


# ---- atomic_replace_folder ----------------------------------------------------------------------------


def _tree(folder: Path, prefix: str = "") -> dict[str, object]:
    """``{relative path: bytes | ("link", target) | "folder"}``, symbolic links not followed."""
    tree = {}
    for entry in sorted(folder.iterdir()):
        key = prefix + entry.name
        if entry.is_symlink():
            tree[key] = ("link", os.readlink(entry))
        elif entry.is_dir():
            tree[key] = "folder"
            tree.update(_tree(entry, key + "/"))
        else:
            tree[key] = entry.read_bytes()
    return tree


def _old_folder(parent: Path) -> Path:
    folder = parent / "ckpt"
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"old weights")
    (folder / "stale.bin").write_bytes(b"old stale")
    (folder / "tokenizer.json").write_bytes(b"tokenizer")
    (folder / "sub" / "notes.txt").write_bytes(b"notes")
    (folder / "sub" / "deeper" / "x.bin").write_bytes(b"x")
    (folder / "sub" / "notes-link").symlink_to("notes.txt")
    (folder / "latest").symlink_to("weights.bin")
    (folder / "sub-link").symlink_to("sub")
    return folder


NEW_FILES = {"weights.bin": b"new weights", "stale.bin": b"new stale", "extra.txt": b"added"}


def _expected_after_replace(old: dict[str, object]) -> dict[str, object]:
    return {**old, **NEW_FILES}


def _exchange_supported(folder: Path) -> bool:
    """Probe, independently of comera, whether this system and filesystem swap two folders in one call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    first, second = folder / "probe-first", folder / "probe-second"
    first.mkdir()
    second.mkdir()
    (first / "mark").touch()
    try:
        return (
            renameat2(-100, os.fsencode(first), -100, os.fsencode(second), 2) == 0
            and (second / "mark").exists()
        )
    finally:
        shutil.rmtree(first)
        shutil.rmtree(second)


def _no_c_library(*args, **kwargs):
    raise OSError("no C library")


_STAND_INS = {
    "no C library": SimpleNamespace(CDLL=_no_c_library),
    "no renameat2": SimpleNamespace(CDLL=lambda *args, **kwargs: SimpleNamespace()),
    # e.g. a filesystem without RENAME_EXCHANGE
    "renameat2 fails": SimpleNamespace(CDLL=lambda *args, **kwargs: SimpleNamespace(renameat2=lambda *a: -1)),
}


@pytest.fixture
def no_exchange(monkeypatch):
    monkeypatch.setattr(comera.atomic, "ctypes", _STAND_INS["no C library"])


@pytest.fixture(params=["renameat2", *_STAND_INS])
def swap(request, monkeypatch, tmp_path):
    """The swap: the system's ``renameat2``, or the fallback where it is missing or fails."""
    if request.param == "renameat2":
        if not _exchange_supported(tmp_path):
            pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    else:
        monkeypatch.setattr(comera.atomic, "ctypes", _STAND_INS[request.param])
    return request.param


def test_replace_folder_writes_the_files_keeps_the_other_entries_and_leaves_nothing_behind(tmp_path, swap):
    folder = _old_folder(tmp_path)
    folder.chmod(0o750)
    old = _tree(folder)
    inodes = {name: os.stat(folder / name).st_ino for name in ("tokenizer.json", "sub/deeper/x.bin")}
    result = atomic_replace_folder(str(folder), NEW_FILES)
    assert isinstance(result, Path) and result == folder
    assert _tree(folder) == _expected_after_replace(old)
    # the entries not rewritten are hard links of the old files, at every depth
    assert {name: os.stat(folder / name).st_ino for name in inodes} == inodes
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o750
    assert _entries(tmp_path) == {"ckpt"}


def test_every_other_entry_is_kept_whichever_one_is_rewritten(tmp_path):
    names = ["a.bin", "b.bin", "c.bin", "d.bin"]
    for index, name in enumerate(names):
        folder = tmp_path / str(index)
        folder.mkdir()
        for other in names:
            (folder / other).write_bytes(other.encode())
        atomic_replace_folder(folder, {name: b"new"})
        assert _tree(folder) == {other: b"new" if other == name else other.encode() for other in names}


def test_a_new_folder_is_created_with_its_missing_parents(tmp_path):
    folder = tmp_path / "a" / "b" / "ckpt"
    result = atomic_replace_folder(str(folder), {"weights.bin": b"w", "config.json": b"{}"})
    assert isinstance(result, Path) and result == folder
    assert _tree(folder) == {"config.json": b"{}", "weights.bin": b"w"}
    assert _entries(folder.parent) == {"ckpt"}


@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_replace_folder_syncs_each_file_then_the_folder_then_its_parent(tmp_path, monkeypatch, exists):
    folder = _old_folder(tmp_path) if exists else tmp_path / "ckpt"
    events = []
    real_fsync = os.fsync

    def spy_fsync(handle):
        info = os.fstat(handle)
        events.append(("folder" if stat.S_ISDIR(info.st_mode) else "file", info.st_ino))
        return real_fsync(handle)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    atomic_replace_folder(folder, {"weights.bin": b"w", "config.json": b"{}"})

    def inode(path):
        return os.stat(path).st_ino

    assert events == [
        ("file", inode(folder / "weights.bin")),
        ("file", inode(folder / "config.json")),
        ("folder", inode(folder)),
        ("folder", inode(tmp_path)),
    ]


def test_an_existing_folder_is_exchanged_without_ever_disappearing(tmp_path, monkeypatch):
    if not _exchange_supported(tmp_path):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    old = _tree(_old_folder(tmp_path))
    renames = _record_moves(monkeypatch, "rename")
    monkeypatch.chdir(tmp_path)  # a relative path: the folder descriptors passed to renameat2 matter
    assert atomic_replace_folder("ckpt", NEW_FILES) == Path("ckpt")
    assert renames == []  # renaming the old folder aside would leave a moment without it
    assert _tree(tmp_path / "ckpt") == _expected_after_replace(old)
    assert _entries(tmp_path) == {"ckpt"}


def test_without_exchange_the_old_folder_is_renamed_aside_within_the_parent(
    tmp_path, monkeypatch, no_exchange
):
    folder = _old_folder(tmp_path)
    old = _tree(folder)
    renames = _record_moves(monkeypatch, "rename")
    atomic_replace_folder(folder, NEW_FILES)
    assert _tree(folder) == _expected_after_replace(old)
    assert _entries(tmp_path) == {"ckpt"}
    (aside_source, aside), (staging, destination) = renames
    assert aside_source == folder and destination == folder
    # a hidden folder of the same parent (same filesystem), named after the folder
    assert aside.parent.parent == tmp_path
    assert aside.parent.name.startswith(".ckpt.") and aside.parent.name.endswith(".old")
    assert staging.parent == tmp_path and staging.name.startswith(".ckpt.") and staging.name.endswith(".tmp")


def test_without_exchange_a_failed_rename_into_place_restores_the_old_folder(
    tmp_path, monkeypatch, no_exchange
):
    folder = _old_folder(tmp_path)
    old = _tree(folder)
    real_rename = os.rename

    def failing_rename(source, destination):
        if Path(source).name.endswith(".tmp"):  # the new folder, after the old one went aside
            assert not folder.exists()
            raise OSError("rename failed")
        return real_rename(source, destination)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="rename failed"):
        atomic_replace_folder(folder, NEW_FILES)
    assert _tree(folder) == old
    assert _entries(tmp_path) == {"ckpt"}


@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_a_failed_write_leaves_the_old_folder_and_no_staging_folder(tmp_path, monkeypatch, exists):
    folder = _old_folder(tmp_path) if exists else tmp_path / "ckpt"
    old = _tree(folder) if exists else None
    real_fsync, calls = os.fsync, []

    def failing_fsync(handle):
        calls.append(handle)
        if len(calls) == 2:  # the second new file
            raise OSError("disk full")
        return real_fsync(handle)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_replace_folder(folder, NEW_FILES)
    if exists:
        assert _tree(folder) == old
        assert _entries(tmp_path) == {"ckpt"}
    else:
        assert _entries(tmp_path) == set()


def test_failing_to_delete_the_old_folder_after_the_swap_is_not_an_error(tmp_path, monkeypatch, swap):
    folder = _old_folder(tmp_path)
    old = _tree(folder)
    real_unlink = os.unlink

    def failing_unlink(path, *args, **kwargs):
        if os.path.basename(path) == "stale.bin":  # only in the old folder: the new one has its own
            raise PermissionError(errno.EACCES, "cannot delete", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    assert atomic_replace_folder(folder, NEW_FILES) == folder
    assert _tree(folder) == _expected_after_replace(old)


def test_files_that_cannot_be_linked_are_copied(tmp_path, monkeypatch):
    folder = _old_folder(tmp_path)
    for name in ("tokenizer.json", "sub/deeper/x.bin"):
        os.utime(folder / name, ns=(1_000_000_000, 1_000_000_000))
    old = _tree(folder)
    before = {name: os.stat(folder / name) for name in ("tokenizer.json", "sub/deeper/x.bin")}
    links = []

    def failing_link(source, target, *args, **kwargs):
        links.append(Path(source).name)
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", failing_link)
    atomic_replace_folder(folder, NEW_FILES)
    assert _tree(folder) == _expected_after_replace(old)
    assert {"tokenizer.json", "x.bin"} <= set(links)
    for name, info in before.items():
        copy = os.stat(folder / name)
        assert copy.st_ino != info.st_ino
        assert copy.st_mtime_ns == info.st_mtime_ns  # a copy with its metadata (shutil.copy2)
    assert _entries(tmp_path) == {"ckpt"}


@pytest.mark.parametrize("name", ["", ".", "sub/notes.txt", "../escape.bin", "/absolute.bin"])
def test_names_that_are_not_plain_file_names_are_rejected_before_anything_changes(tmp_path, name):
    folder = _old_folder(tmp_path)
    old = _tree(folder)
    with pytest.raises(ValueError, match=re.escape(f"got name {name!r}")):
        atomic_replace_folder(folder, {"weights.bin": b"new", name: b"bad"})
    assert _tree(folder) == old
    with pytest.raises(ValueError, match=re.escape(f"got name {name!r}")):
        atomic_replace_folder(tmp_path / "new", {name: b"bad"})
    assert _entries(tmp_path) == {"ckpt"}


def test_a_file_where_the_folder_should_be_is_an_error(tmp_path):
    target = tmp_path / "ckpt"
    target.write_bytes(b"a file")
    with pytest.raises(NotADirectoryError, match=re.escape(f"{target} exists and is not a folder")):
        atomic_replace_folder(target, {"weights.bin": b"new"})
    assert target.read_bytes() == b"a file"
    assert _entries(tmp_path) == {"ckpt"}


def test_a_new_file_gets_the_mode_open_gives_and_a_replaced_file_keeps_its_own(tmp_path):
    reference = tmp_path / "reference.bin"
    reference.write_bytes(b"made by open()")  # 0o666 less this process's umask
    written = atomic_write_bytes(tmp_path / "new.bin", b"new")
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)
    for mode in (0o640, 0o604):
        target = tmp_path / f"kept_{mode:o}.bin"
        target.write_bytes(b"old")
        target.chmod(mode)
        atomic_write_bytes(target, b"new")
        assert stat.S_IMODE(target.stat().st_mode) == mode
        assert target.read_bytes() == b"new"


@pytest.mark.parametrize("name", ["..", "."])
def test_dot_names_get_the_documented_error(tmp_path, name):
    with pytest.raises(
        ValueError, match=re.escape(f"files must map plain file names to bytes, got name {name!r}")
    ):
        atomic_replace_folder(tmp_path / "ckpt", {name: b"bad"})
    assert _entries(tmp_path) == set()


def test_without_exchange_a_failed_move_aside_leaves_the_old_folder_and_nothing_else(
    tmp_path, monkeypatch, no_exchange
):
    folder = _old_folder(tmp_path)
    old = _tree(folder)
    real_rename = os.rename

    def failing_rename(source, destination):
        if Path(source) == folder:  # moving the old folder aside
            raise OSError("rename aside failed")
        return real_rename(source, destination)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="rename aside failed"):
        atomic_replace_folder(folder, NEW_FILES)
    assert _tree(folder) == old
    assert _entries(tmp_path) == {"ckpt"}
