"""``comera train`` errors in one line: folders that cannot be written and a ``--config`` folder are refused
before any data is built; a corrupt ``config.json`` on resume is named; a diverging run ends with one line."""

import json
import os
from pathlib import Path

import pytest
import toy

from comera.cli.commands.train import main


@pytest.fixture
def no_data(monkeypatch):
    """Fail the test if the recipe builds its data: the error must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the data was built before the error")

    monkeypatch.setattr(toy.ToyRecipe, "build_data", refuse)


def _train(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["toy", "--preset", "smoke", "--out", str(out), "--cache", str(cache), "--no-progress", *extra]


def _one_line_error(capsys, arguments: list[str], status: int = 2) -> str:
    assert main(arguments) == status
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    return error


def test_out_and_cache_under_a_file_are_refused_before_the_data_is_built(tmp_path, capsys, no_data):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    error = _one_line_error(capsys, _train(blocker / "run", tmp_path / "cache"))
    assert f"--out {blocker / 'run'}: {blocker} is a file, not a folder" in error
    error = _one_line_error(capsys, _train(tmp_path / "run", blocker / "cache"))
    assert f"--cache {blocker / 'cache'}: {blocker} is a file, not a folder" in error


def _unwritable_folder(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return locked / "run"
    if not Path("/proc/self").is_dir():
        pytest.skip("needs a folder root cannot write to")
    return Path("/proc/self/comera-run")


def test_an_unwritable_out_is_refused_before_the_data_is_built(tmp_path, capsys, no_data):
    out = _unwritable_folder(tmp_path)
    error = _one_line_error(capsys, _train(out, tmp_path / "cache"))
    assert f"--out {out}: cannot create or write to it" in error


def test_a_config_folder_is_refused(tmp_path, capsys, no_data):
    error = _one_line_error(capsys, _train(tmp_path / "run", tmp_path / "cache", "--config", str(tmp_path)))
    assert f"--config {tmp_path}: a folder; expected a TOML file" in error


def test_a_corrupt_config_json_on_resume_is_named(tmp_path, capsys, no_data):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"recipe": "toy", ')
    error = _one_line_error(capsys, _train(out, tmp_path / "cache", "--resume"))
    assert f"{out / 'config.json'} is not valid JSON" in error


def test_a_diverging_run_ends_with_one_line(tmp_path, capsys):
    rates = [f"--set=method.{name}=1e30" for name in ("lr_cores", "lr_gates")] + ["--set=train.lr_other=1e30"]
    error = _one_line_error(capsys, _train(tmp_path / "run", tmp_path / "cache", *rates), status=1)
    assert error.startswith("comera train: training diverged:") and str(tmp_path / "run") in error
    reason = error.removeprefix("comera train: training diverged: ").rsplit("; run folder:", 1)[0]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert events[-1] == {"kind": "event", "step": events[-1]["step"], "event": "diverged", "reason": reason}
    from comera.report import describe_folder

    with pytest.raises(FileNotFoundError, match=r"a run that diverged \(.*\), so it has no model; resuming"):
        describe_folder(tmp_path / "run")


@pytest.mark.parametrize("plot", [True, False])
def test_the_run_folder_line_names_only_what_the_run_wrote(tmp_path, capsys, plot):
    """The closing line lists the outputs that exist: ``plots/`` only when the run plotted."""
    out = tmp_path / "run"
    assert main(_train(out, tmp_path / "cache", f"--set=train.plot={str(plot).lower()}")) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run folder:"))
    listed = ["results.json", "metrics.jsonl", *(["plots/"] if plot else []), "model/"]
    assert line == f"run folder: {out} ({', '.join(listed)})"
    assert (out / "plots").is_dir() == plot


def test_a_config_given_as_a_stream_is_read_once_and_applied(tmp_path):
    """``--config <(...)``: a pipe, which a second reader would find empty. Its settings reach the run."""
    import json

    read, write = os.pipe()
    os.write(write, b"[train]\nearly = 3\n")
    os.close(write)
    try:
        assert main([*_train(tmp_path / "run", tmp_path / "cache"), "--config", f"/dev/fd/{read}"]) == 0
    finally:
        os.close(read)
    header = json.loads((tmp_path / "run" / "config.json").read_text())
    assert header["settings"]["train"]["early"] == 3


def test_an_endless_config_stream_is_refused_without_reading_it_to_the_end(tmp_path, capsys, no_data):
    """``--config /dev/zero``: reading stops past the size a settings file could have; one line, status 2."""
    with pytest.raises(SystemExit) as stopped:
        main([*_train(tmp_path / "run", tmp_path / "cache"), "--config", "/dev/zero"])
    assert stopped.value.code == 2
    assert "/dev/zero streams more than 1 MiB, so it is no settings file" in capsys.readouterr().err


def test_ctrl_c_during_training_ends_with_one_line_and_status_130_and_the_run_resumes(
    tmp_path, capsys, monkeypatch
):
    """SIGINT (KeyboardInterrupt) in the middle of training: one line saying how to continue, status 130 as
    a shell reports it, no traceback; --resume then finishes the run."""
    from comera.train import Trainer

    real_step = Trainer.train_step

    def interrupted(self, batch):
        if self.step == 2:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    out = tmp_path / "run"
    error = _one_line_error(capsys, _train(out, tmp_path / "cache"), status=130)
    assert error == f"comera train: interrupted; continue the run with --resume (run folder: {out})"
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert main([*_train(out, tmp_path / "cache"), "--resume"]) == 0
    assert (out / "results.json").is_file()


def test_ctrl_c_before_the_run_started_does_not_point_to_a_resume_that_would_be_refused(
    tmp_path, capsys, monkeypatch
):
    """SIGINT while the data is being built, before the run folder holds its settings: the line says there
    is nothing to resume (``--resume`` would be refused there), and the same command then runs."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(toy.ToyRecipe, "build_data", interrupted)
    out = tmp_path / "run"
    error = _one_line_error(capsys, _train(out, tmp_path / "cache"), status=130)
    assert error == (
        "comera train: interrupted before the run started, so there is nothing to resume; run the same "
        "command again"
    )
    assert not (out / "config.json").exists()
    monkeypatch.undo()
    assert main(_train(out, tmp_path / "cache")) == 0


@pytest.mark.parametrize("option", ["--out", "--cache"])
def test_a_symbolic_link_loop_or_a_dangling_link_is_named_with_its_reason(tmp_path, capsys, no_data, option):
    first, second, dangling = tmp_path / "loop1", tmp_path / "loop2", tmp_path / "dangling"
    first.symlink_to(second)
    second.symlink_to(first)
    dangling.symlink_to(tmp_path / "nowhere")
    for link, reason in (
        (first, "Too many levels of symbolic links"),
        (dangling, "No such file or directory"),
    ):
        target = link / "run"
        out, cache = (target, tmp_path / "cache") if option == "--out" else (tmp_path / "run", target)
        error = _one_line_error(capsys, _train(out, cache))
        assert f"{option} {target}: {link} is a symbolic link that leads nowhere ({reason})" in error


def test_a_looping_or_broken_data_link_is_named_as_such(tmp_path, capsys, no_data):
    """``--data`` naming a symbolic link that loops or points at nothing says which, not 'no such file'."""
    first, second, dangling = tmp_path / "loop1", tmp_path / "loop2", tmp_path / "dangling"
    first.symlink_to(second)
    second.symlink_to(first)
    dangling.symlink_to(tmp_path / "nowhere")
    out, cache = tmp_path / "run", tmp_path / "cache"
    error = _one_line_error(capsys, _train(out, cache, "--data", str(first)))
    assert f"--data {first}: a symbolic link that loops (it leads back to itself)" in error
    error = _one_line_error(capsys, _train(out, cache, "--data", str(dangling)))
    assert (
        f"--data {dangling}: a broken symbolic link (to {tmp_path / 'nowhere'}, which does not exist)"
        in error
    )
    error = _one_line_error(capsys, _train(out, cache, "--data", str(tmp_path / "missing")))
    assert f"--data {tmp_path / 'missing'}: no such file or folder" in error
    assert not out.exists()


def test_nproc_processes_get_only_the_copy_of_a_config_stream(tmp_path, monkeypatch):
    """--config naming a named pipe with --nproc: the launcher reads it once and hands the processes its
    copy alone (a process reading the pipe again would wait for a writer forever)."""
    import threading

    import comera.cli.commands.train as train_command

    fifo = tmp_path / "settings.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"[train]\nearly = 3\n"))
    writer.start()
    launched = []
    monkeypatch.setattr(train_command, "launch", lambda nproc, command: launched.append(command) or 0)
    assert main([*_train(tmp_path / "run", tmp_path / "cache"), "--config", str(fifo), "--nproc", "2"]) == 0
    writer.join(timeout=10)
    (command,) = launched
    assert command.count("--config") == 1 and str(fifo) not in command
    copy = Path(command[command.index("--config") + 1])
    assert copy.read_bytes() == b"[train]\nearly = 3\n"


@pytest.mark.parametrize("option", ["--out", "--cache", "--data", "--config"])
def test_an_empty_path_is_refused_not_read_as_the_default_or_the_current_folder(
    tmp_path, capsys, no_data, option, monkeypatch
):
    """``--out ''`` (an unset shell variable) would write the run to the default folder or to ``.``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["toy", "--preset", "smoke", option, ""])
    assert stopped.value.code == 2
    assert f"argument {option}: an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("assignment", "opening"),
    [
        ("tensorize.rank=0", "comera train: tensorize.rank must be"),
        ("method.gamma=-1", "comera train: method.gamma must be"),
        ("train.lr_other=-1", "comera train: train.lr_other must be"),
    ],
)
def test_a_bad_value_is_named_with_its_section(tmp_path, capsys, no_data, assignment, opening):
    error = _one_line_error(capsys, _train(tmp_path / "run", tmp_path / "cache", "--set", assignment))
    assert error.startswith(opening), error


def test_a_bad_data_value_is_named_with_its_section_before_any_file_is_read(tmp_path, capsys):
    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    arguments = ["llm", "--preset", "smoke", "--out", out, "--cache", cache, "--no-progress"]
    error = _one_line_error(capsys, [*arguments, "--set", "data.validation_fraction=2"])
    assert error.startswith("comera train: data.validation_fraction must be a float in (0, 1)"), error
    assert not any((tmp_path / "cache").iterdir())


LONG_NAME = "y" * 300
DEEP_PATH = "/".join(["zz"] * 1500)


@pytest.mark.parametrize(
    ("arguments", "argument", "problem"),
    [
        (["train", "toy", "--out", f"runs/{LONG_NAME}"], "--out", "a name of 300 bytes"),
        (["train", "toy", "--data", f"d/{LONG_NAME}"], "--data", "a name of 300 bytes"),
        (["train", "toy", "--config", f"{LONG_NAME}.toml"], "--config", "a name of 305 bytes"),
        (["train", "toy", "--cache", DEEP_PATH], "--cache", "a path of 4,499 bytes"),
        (["compare", "toy", "--out", f"runs/{LONG_NAME}"], "--out", "a name of 300 bytes"),
        (["report", LONG_NAME], "directory", "a name of 300 bytes"),
        (["plot", f"runs/{LONG_NAME}"], "run_dir", "a name of 300 bytes"),
        (["plot", "runs/a", "--compare", DEEP_PATH], "--compare", "a path of 4,499 bytes"),
        (["generate", f"runs/{LONG_NAME}", "--prompt", "x"], "run_dir", "a name of 300 bytes"),
    ],
)
def test_a_path_the_file_system_cannot_hold_is_refused_in_one_line(
    tmp_path, capsys, no_data, monkeypatch, arguments, argument, problem
):
    """A name over 255 bytes or a path over 4095 is refused as argparse reads it, not by a traceback of
    the first system call that touches it (``OSError: File name too long``)."""
    from comera.cli import main as comera_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        comera_main(arguments)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {argument}: {problem}" in error, error
    assert list(tmp_path.iterdir()) == []


def test_a_gzip_config_is_named_as_gzip(tmp_path, capsys, no_data):
    import gzip

    config = tmp_path / "settings.toml"
    config.write_bytes(gzip.compress(b"[train]\nearly = 3\n"))
    error = _one_line_error(capsys, _train(tmp_path / "run", tmp_path / "cache", "--config", str(config)))
    assert f"--config {config}: a gzip file; give the TOML text (gunzip it first)" in error


def test_a_set_value_python_cannot_hold_is_named_by_its_key(tmp_path, capsys, no_data):
    huge = "train.early=" + "9" * 5000
    error = _one_line_error(capsys, _train(tmp_path / "run", tmp_path / "cache", "--set", huge))
    assert error.startswith("comera train: --set train.early=...: the value cannot be read (")
    assert len(error) < 400


def test_a_run_refused_before_it_started_leaves_no_folder_behind(tmp_path, capsys, monkeypatch):
    """A command stopped by its data (here: the data build fails) after it took the new run folder leaves
    neither the folder nor its lock file; a folder that existed before stays, with what it held."""

    def no_documents(*args, **kwargs):
        raise ValueError("--data: no document found")

    monkeypatch.setattr(toy.ToyRecipe, "build_data", no_documents)
    out = tmp_path / "new-run"
    assert "no document found" in _one_line_error(capsys, _train(out, tmp_path / "cache"))
    assert not out.exists()
    deep = tmp_path / "made" / "for" / "it"
    assert "no document found" in _one_line_error(capsys, _train(deep, tmp_path / "cache"))
    assert not (tmp_path / "made").exists()  # nor the parents the command made
    kept = tmp_path / "kept"
    kept.mkdir()
    _one_line_error(capsys, _train(kept, tmp_path / "cache"))
    assert kept.is_dir()


@pytest.mark.parametrize(
    ("workload", "assignment", "message"),
    [
        ("llm", "data.vocab_size=1000000000", "data.vocab_size must be an int in [262, 1048576]"),
        ("nli", "data.vocab_size=1000000000", "data.vocab_size must be an int in [6, 1048576]"),
        (
            "llm",
            "data.max_validation_blocks=0",
            "data.max_validation_blocks must be an int >= 1 or None, got 0",
        ),
        ("dlrm", "data.hash_size=0", "data.hash_size must be None or an int in [2, 2**31 - 1], got 0"),
        ("dlrm", "data.min_frequency=-1", "data.min_frequency must be an int >= 1, got -1"),
        ("llm", "data.tokenizer_file='/no/t.json'", "data.tokenizer_file /no/t.json does not exist"),
        ("mlm", "data.tokenizer_file='/no/t.json'", "data.tokenizer_file /no/t.json does not exist"),
        (
            "llm",
            "data.tokenizer_file=123",
            "data.tokenizer_file must be the path of a tokenizer.json file (a string) or unset, got 123",
        ),
        ("mlm", "data.tokenizer_file=''", "data.tokenizer_file must be the path of a tokenizer.json file"),
        ("llm", "data.tokenizer_file='/'", "data.tokenizer_file / is a folder without a tokenizer.json"),
        ("mlm", "data.tokenizer_file='/'", "data.tokenizer_file / is a folder without a tokenizer.json"),
        ("nli", "data.tokenizer='/no/v.txt'", "data.tokenizer '/no/v.txt' is read with --data (MNLI) only"),
    ],
)
def test_a_data_value_out_of_range_is_named_whatever_the_source(
    tmp_path, capsys, workload, assignment, message
):
    """Refused by name before any data is read, with the embedded data too (where dlrm's Criteo options are
    not used), and before a tokenizer trainer is asked for a vocabulary of 10**9 (an out-of-memory abort)."""
    _assert_refused_by_name(tmp_path, capsys, workload, assignment, message)


@pytest.mark.parametrize(
    ("workload", "assignment", "message"),
    [
        ("nli", "train.seed=99999999999999999999", "train.seed must be an int in [0, 9223372036854775806]"),
        ("nli", "model.d_model=15", "model.d_model (15) must be a multiple of n_heads"),
        ("nli", "model.n_layers=0", "model.n_layers must be"),
        ("mlm", "model.dropout=1.5", "model.dropout must be"),
        (
            "nli",
            "tensorize.rank=[2,2,2,2,2,2,2,2,2,2]",
            "the [tensorize] settings do not fit the model: module 'blocks.0.attention.query': rank must",
        ),
        (
            "nli",
            "tensorize.target_modules=['nosuch']",
            "the [tensorize] settings do not fit the model: target_modules entry 'nosuch' matched no",
        ),
    ],
)
def test_a_model_or_train_value_out_of_range_is_named_with_its_section(
    tmp_path, capsys, workload, assignment, message
):
    """A seed that would overflow the generators, a model size its builder refuses, ranks that do not fit
    a module: one line naming the section (the builders name the key alone), no run folder left."""
    _assert_refused_by_name(tmp_path, capsys, workload, assignment, message)


def _assert_refused_by_name(tmp_path, capsys, workload, assignment, message):
    out = tmp_path / "run"
    arguments = [workload, "--preset", "smoke", "--out", str(out), "--cache", str(tmp_path / "cache")]
    error = _one_line_error(capsys, [*arguments, "--no-progress", "--set", assignment])
    assert error.startswith(f"comera train: {message}"), error
    assert not out.exists()


def test_a_restart_that_cannot_name_the_aside_folder_says_so(tmp_path, capsys):
    out = tmp_path / ("g" * 252)
    assert main(_train(out, tmp_path / "cache")) == 0
    capsys.readouterr()
    error = _one_line_error(capsys, _train(out, tmp_path / "cache", "--restart"))
    assert "--restart: cannot make ggg" in error and "(File name too long)" in error, error
    assert (out / "config.json").is_file()


def test_a_restart_refused_by_its_data_leaves_the_old_run_in_place(tmp_path, capsys, monkeypatch):
    """``--restart`` moves the old run aside only once the data and the model are built: a start refused
    before that leaves the folder as it was (a later --resume still finds the run)."""
    out = tmp_path / "run"
    assert main(_train(out, tmp_path / "cache")) == 0
    capsys.readouterr()
    before = sorted(path.name for path in out.iterdir())
    real = toy.ToyRecipe.build_data

    def no_documents(*args, **kwargs):
        raise ValueError("--data: no document found")

    monkeypatch.setattr(toy.ToyRecipe, "build_data", no_documents)
    assert "no document found" in _one_line_error(capsys, _train(out, tmp_path / "cache", "--restart"))
    assert sorted(path.name for path in out.iterdir()) == before
    assert not list(tmp_path.glob("run.old-*"))
    monkeypatch.setattr(toy.ToyRecipe, "build_data", real)
    assert main(_train(out, tmp_path / "cache", "--restart")) == 0
    assert (tmp_path / "run.old-1" / "config.json").is_file() and (out / "results.json").is_file()


@pytest.mark.parametrize("command", [["train", "toy", "--out"], ["report"], ["compare", "toy", "--out"]])
def test_a_run_folder_path_without_room_for_its_files_is_refused_in_one_line(
    tmp_path, capsys, no_data, monkeypatch, command
):
    """A run folder's path under 4095 bytes, every name under 256, but with no room left for the files
    comera writes inside (``.config.json.<uuid>.tmp``): refused before anything runs, not a traceback after
    training."""
    from comera.cli import main as comera_main

    monkeypatch.chdir(tmp_path)
    deep = "/".join(["e" * 249] * 16)  # 3,999 bytes relative; more with the current folder in front
    with pytest.raises(SystemExit) as stopped:
        comera_main([*command, deep])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "less 128 for the files a run folder holds" in error, error
    assert list(tmp_path.iterdir()) == []


def _parse_only(command):
    """Parse ``command`` with the parser its ``comera`` command uses, without running anything (so that a
    missing check cannot start a run in ``/``)."""
    from comera.cli.commands import compare, demo, train

    name, *arguments = command
    if name == "train":
        return train.build_parser().parse_args(arguments)
    if name == "compare":
        return compare.build_parser().parse_args(arguments)
    return demo.parse_arguments(arguments)


@pytest.mark.parametrize("root", ["/", "//", "/.", "/tmp/.."])
@pytest.mark.parametrize(
    "command", [["train", "toy", "--out"], ["compare", "toy", "--out"], ["demo", "--out"]], ids=lambda c: c[0]
)
def test_the_file_systems_root_is_refused_as_a_run_folder(capsys, command, root):
    """A run written into ``/`` would spread its files over the root, and ``--restart`` could not name a
    folder beside it: the option is refused in one line as it is read."""
    with pytest.raises(SystemExit) as stopped:
        _parse_only([*command, root])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{root!r} is the file system's root; name a folder for the run" in error, error
