"""The recipe registry (:mod:`comera.recipes.base`), the data fingerprint (:mod:`comera.recipes.fingerprint`)
and the run-folder check (:mod:`comera.recipes.folders`), against hand-built references."""

from __future__ import annotations

import hashlib
import re
import tempfile

import pytest

from comera.recipes import base
from comera.recipes.base import Recipe, get_recipe, recipe_names, register_recipe
from comera.recipes.fingerprint import data_fingerprint, fingerprint_difference
from comera.recipes.folders import writable_folder


def _exactly(message: str) -> str:
    """A ``match`` pattern accepting ``message`` and nothing else."""
    return "^" + re.escape(message) + "$"


def _entry(content: bytes) -> dict:
    """The fingerprint entry of a file holding ``content``, computed with hashlib directly."""
    return {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}


@pytest.fixture
def registry(monkeypatch):
    """An empty recipe registry for one test (the real one is left as it was)."""
    fresh: dict = {}
    monkeypatch.setattr(base, "_RECIPES", fresh)
    return fresh


# --- comera.recipes.base -------------------------------------------------------------------------------


def test_register_recipe_records_the_class_and_get_recipe_instantiates_it(registry):
    """A named Recipe subclass is returned unchanged, stored under its name, listed, and ``get_recipe``
    makes a new instance of it on every call."""

    class Toy(Recipe):
        name = "toy-parts"

    assert register_recipe(Toy) is Toy
    assert registry == {"toy-parts": Toy}
    assert recipe_names() == ("toy-parts",)
    first, second = get_recipe("toy-parts"), get_recipe("toy-parts")
    assert type(first) is Toy and type(second) is Toy
    assert first is not second


def test_register_recipe_refuses_a_recipe_subclass_without_a_name(registry):
    """A Recipe subclass whose ``name`` is empty is refused with the whole message, and not registered."""

    class Nameless(Recipe):
        pass

    with pytest.raises(
        TypeError, match=_exactly(f"recipe must be a Recipe subclass with a name, got {Nameless!r}")
    ):
        register_recipe(Nameless)
    assert registry == {}


def test_register_recipe_refuses_a_named_class_that_is_not_a_recipe(registry):
    """A class with a ``name`` that does not derive from Recipe is refused, and not registered."""

    class Impostor:
        name = "impostor"

    with pytest.raises(
        TypeError, match=_exactly(f"recipe must be a Recipe subclass with a name, got {Impostor!r}")
    ):
        register_recipe(Impostor)
    assert registry == {}


def test_register_recipe_refuses_a_non_class_with_its_own_message(registry):
    """A string (not a class at all) gets the registry's message, not ``issubclass``'s."""
    with pytest.raises(TypeError, match=_exactly("recipe must be a Recipe subclass with a name, got 'toy'")):
        register_recipe("toy")
    assert registry == {}


def test_get_recipe_unknown_name_lists_the_registered_ones_sorted(registry):
    """An unknown name is refused with the whole message, naming it and the valid names in sorted order."""

    class Beta(Recipe):
        name = "beta"

    class Alpha(Recipe):
        name = "alpha"

    register_recipe(Beta)
    register_recipe(Alpha)
    with pytest.raises(
        ValueError,
        match=_exactly(
            "unknown workload 'gamma'; choose one of ['alpha', 'beta'] (a built-in workload registers its "
            "recipe when comera.workloads.load_recipe(NAME) imports it)"
        ),
    ):
        get_recipe("gamma")


# --- comera.recipes.fingerprint ------------------------------------------------------------------------


def test_data_fingerprint_of_a_file_is_its_name_size_and_sha256(tmp_path):
    """A single file gives one entry under its own name with its byte count and hashlib's SHA-256."""
    content = b"label\ttext\n1\thello\n"
    (tmp_path / "train.tsv").write_bytes(content)
    assert data_fingerprint(tmp_path / "train.tsv") == {"train.tsv": _entry(content)}


def test_data_fingerprint_of_a_folder_covers_every_file_below_it(tmp_path):
    """A folder gives every regular file below it (nested and hidden ones included, empty folders not),
    under ``/``-separated relative names, in name order; None stays None."""
    files = {"a.txt": b"alpha", "b/.hidden": b"", "b/c/d.bin": bytes(range(256)), "e.txt": b"x" * 3000}
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / "empty").mkdir()
    fingerprint = data_fingerprint(str(tmp_path))
    assert fingerprint == {name: _entry(content) for name, content in files.items()}
    assert list(fingerprint) == ["a.txt", "b/.hidden", "b/c/d.bin", "e.txt"]
    assert data_fingerprint(None) is None


def test_fingerprint_difference_agreeing_fingerprints_give_none():
    """Equal fingerprints (both None, both empty, the same files) differ in nothing."""
    same = {"a": _entry(b"a"), "b": _entry(b"b")}
    assert fingerprint_difference(None, None) is None
    assert fingerprint_difference({}, {}) is None
    assert fingerprint_difference(same, dict(same)) is None


def test_fingerprint_difference_names_the_first_changed_file_with_both_descriptions():
    """The first file whose entry changed is named (not an earlier one that agrees), with its size
    (thousands separated) and the first 12 hex digits of its digest, then and now."""
    old, new = b"o" * 1024, b"n" * 1030
    recorded = {"a.txt": _entry(b"same"), "b.txt": _entry(old), "c.txt": _entry(b"c")}
    current = {"a.txt": _entry(b"same"), "b.txt": _entry(new), "c.txt": _entry(b"changed too")}
    expected = (
        f"b.txt: 1,024 bytes, sha256 {hashlib.sha256(old).hexdigest()[:12]} then, "
        f"1,030 bytes, sha256 {hashlib.sha256(new).hexdigest()[:12]} now"
    )
    assert fingerprint_difference(recorded, current) == expected


def test_fingerprint_difference_names_a_file_gone_since_the_run():
    """A file the run read that is gone now is named as absent now, even when every common file agrees."""
    gone = b"g" * 5
    recorded = {"a.txt": _entry(b"same"), "b.txt": _entry(gone)}
    current = {"a.txt": _entry(b"same")}
    assert fingerprint_difference(recorded, current) == (
        f"b.txt: 5 bytes, sha256 {hashlib.sha256(gone).hexdigest()[:12]} then, absent now"
    )


def test_fingerprint_difference_names_a_file_added_since_the_run():
    """A file that appeared since the run is named as absent then."""
    added = b"added"
    recorded = {"a.txt": _entry(b"same")}
    current = {"a.txt": _entry(b"same"), "z.txt": _entry(added)}
    assert fingerprint_difference(recorded, current) == (
        f"z.txt: absent then, 5 bytes, sha256 {hashlib.sha256(added).hexdigest()[:12]} now"
    )


def test_fingerprint_difference_between_embedded_data_and_a_data_path():
    """Embedded data then and a path now, or a path then and none now, are each said in words."""
    files = {"a.txt": _entry(b"a")}
    assert (
        fingerprint_difference(None, files)
        == "the run used the embedded data, this command gives a data path"
    )
    assert fingerprint_difference(files, None) == "the run used a data path, this command gives none"
    assert (
        fingerprint_difference(None, {}) == "the run used the embedded data, this command gives a data path"
    )


# --- comera.recipes.folders ----------------------------------------------------------------------------


def test_writable_folder_creates_missing_parents(tmp_path):
    """A folder several levels below missing parents is created and returned."""
    target = tmp_path / "a" / "b" / "c"
    assert writable_folder(target, "--out") == target
    assert target.is_dir()
    assert list(target.iterdir()) == []  # the write check leaves nothing behind


def test_writable_folder_checks_the_folder_itself_not_the_temporary_folder(tmp_path, monkeypatch):
    """The write check happens in the folder: an unusable system temporary folder does not matter."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    target = tmp_path / "out"
    assert writable_folder(target, "--out") == target
    assert target.is_dir()


def test_writable_folder_refuses_a_file(tmp_path):
    """A path that is a file is refused, naming the option and the path."""
    target = tmp_path / "results"
    target.write_text("not a folder")
    with pytest.raises(ValueError, match=_exactly(f"--out {target} is a file, not a folder")):
        writable_folder(target, "--out")
    assert target.read_text() == "not a folder"


def test_writable_folder_refuses_a_file_among_the_parents(tmp_path):
    """A parent that is a file is refused, naming the option, the path and that parent."""
    blocker = tmp_path / "results"
    blocker.write_text("x")
    target = blocker / "run" / "one"
    with pytest.raises(ValueError, match=_exactly(f"--cache {target}: {blocker} is a file, not a folder")):
        writable_folder(target, "--cache")


def test_writable_folder_reports_why_the_folder_cannot_be_created(tmp_path):
    """A dangling symbolic link cannot become a folder: it is named, with the OS's reason (its strerror)."""
    target = tmp_path / "link"
    target.symlink_to(tmp_path / "missing")
    with pytest.raises(
        ValueError,
        match=_exactly(
            f"--out {target}: {target} is a symbolic link that leads nowhere (No such file or directory)"
        ),
    ):
        writable_folder(target, "--out")


def test_writable_folder_name_too_long_is_a_value_error(tmp_path):
    """A folder name longer than the file system allows is refused as a ValueError naming the reason
    (not a raw OSError escaping the parents check)."""
    target = tmp_path / ("a" * 300) / "b"
    with pytest.raises(
        ValueError, match=_exactly(f"--out {target}: cannot create or write to it (File name too long)")
    ):
        writable_folder(target, "--out")


def test_a_file_that_cannot_be_read_is_fingerprinted_as_unreadable_not_raised(tmp_path, monkeypatch):
    """No permission on one data file: its entry holds its size, no digest and the reason, and the others
    are hashed (the reader then skips and counts it, or names it); a later change of state is named."""
    (tmp_path / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "locked.py").write_bytes(b"secret\n")
    opened = type(tmp_path).open

    def refusing(path, *args, **kwargs):
        if path.name == "locked.py":
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "open", refusing)
    locked = data_fingerprint(tmp_path)
    assert locked == {
        "a.py": {"bytes": 6, "sha256": hashlib.sha256(b"x = 1\n").hexdigest()},
        "locked.py": {"bytes": 7, "sha256": None, "unreadable": "Permission denied"},
    }
    monkeypatch.setattr(type(tmp_path), "open", opened)
    readable = data_fingerprint(tmp_path)
    expected = (
        "locked.py: 7 bytes, unreadable (Permission denied) then, 7 bytes, sha256 "
        + hashlib.sha256(b"secret\n").hexdigest()[:12]
        + " now"
    )
    assert fingerprint_difference(locked, readable) == expected


def test_one_data_file_under_another_name_with_the_same_content_is_the_same_data(tmp_path):
    """A run on crit.txt resumed with --data naming a link to it (or a renamed copy): one file each time,
    the same content, no difference; another content under the other name is named."""
    data = tmp_path / "crit.txt"
    data.write_bytes(b"1\t2\n")
    link = tmp_path / "crit_link.txt"
    link.symlink_to(data)
    assert fingerprint_difference(data_fingerprint(data), data_fingerprint(link)) is None
    other = tmp_path / "other.txt"
    other.write_bytes(b"3\t4\n")
    assert fingerprint_difference(data_fingerprint(data), data_fingerprint(other)).startswith(
        "crit.txt: 4 bytes"
    )


def test_a_run_resumes_on_its_data_by_content_wherever_the_data_lies_now(tmp_path):
    """header_difference: the same data (by fingerprint) under another path (a link, a renamed copy or
    folder) is the same run; other content is named with both names; a folder written before fingerprints
    still compares paths."""
    from comera.recipes.run_folder import header_difference

    data = tmp_path / "crit.txt"
    data.write_bytes(b"1\t2\n")
    link = tmp_path / "crit_link.txt"
    link.symlink_to(data)
    other = tmp_path / "other.txt"
    other.write_bytes(b"3\t4\n")

    def header(path):
        return {"recipe": "dlrm", "data": str(path), "data_files": data_fingerprint(path), "settings": {}}

    assert header_difference(header(data), header(link)) is None
    changed = header_difference(header(data), header(other))
    assert changed.startswith("the data changed since the run started (crit.txt: 4 bytes, sha256 ")
    assert ", other.txt: 4 bytes, sha256 " in changed
    old = {key: value for key, value in header(data).items() if key != "data_files"}
    assert header_difference(old, header(link)) == (
        f"it was started with other settings (data: {str(data)!r} then, {str(link)!r} now)"
    )
    renamed = {**header(data), "preset": "small", "method": "comera"}
    assert header_difference(renamed, {**header(data), "preset": "smoke", "method": "comera"}) == (
        "it was started with other settings (preset: 'small' then, 'smoke' now)"
    )


@pytest.mark.parametrize("odd", ["link to a file", "pipe", "link to /dev/null"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_nothing_is_overwritten(tmp_path, odd):
    """The run folder's lock is never taken through a link (a link to a user's file would have the file
    overwritten with a process id) or on a pipe: one line naming it, the link's target left as it was."""
    import os

    from comera.recipes.folders import LOCK_NAME, lock_run_folder

    out = tmp_path / "run"
    out.mkdir()
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me\n")
    lock = out / LOCK_NAME
    if odd == "pipe":
        os.mkfifo(lock)
    else:
        lock.symlink_to(precious if odd == "link to a file" else "/dev/null")
    with pytest.raises(ValueError, match=rf"its lock file {re.escape(str(lock))} .*move it away"):
        lock_run_folder(out)
    assert precious.read_text() == "keep me\n"
