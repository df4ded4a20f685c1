"""``torchrun --nproc-per-node 2 -m comera train ...`` and ``comera train --nproc 2`` on CPU (gloo).

Two processes on half the global batch each train the same model as one process (the nli and dlrm smoke
presets draw no random numbers while training), so their ``results.json`` agree with a one-process run's to
rounding, with DDP and with FSDP (whose ``model/`` is written from the gathered state); rank 0 alone writes
the run folder; a setup error is reported once and stops every process.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from comera.cli.child import LAUNCH_INTERRUPTED
from comera.cli.launch import split_nproc, torchrun_command
from comera.train.metrics import read_metrics

TIMEOUT = 180


def comera(*args, nproc=None, cwd=None):
    """``python -m comera ARGS`` (under ``torchrun`` with ``nproc``), single-threaded, one line per error."""
    command = [sys.executable, "-m", "comera", *args]
    if nproc is not None:
        command = torchrun_command(nproc, list(args))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd)


def results(folder):
    return json.loads((folder / "results.json").read_text())


def assert_same_results(many, one):
    assert many["processes"] == 2 and one["processes"] == 1
    assert len(many["step_time_s_per_rank"]) == 2 and len(many["peak_memory_mib_per_rank"]) == 2
    assert "step_time_s_per_rank" not in one
    assert many["steps"] == one["steps"] and many["size_ratio"] == pytest.approx(one["size_ratio"], abs=0)
    assert many["evaluation"].keys() == one["evaluation"].keys()
    for split, metrics in one["evaluation"].items():
        for name, value in metrics.items():
            assert many["evaluation"][split][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (split, name)


@pytest.mark.parametrize(
    ("workload", "launcher", "parallel"),
    [("nli", "torchrun", "ddp"), ("dlrm", "--nproc", "ddp"), ("dlrm", "--nproc", "fsdp")],
)
def test_two_processes_match_one(tmp_path, workload, launcher, parallel):
    common = ["train", workload, "--preset", "smoke", "--cache", str(tmp_path / "cache")]
    common += ["--set", f"train.parallel={parallel}"]
    one = comera(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    if launcher == "torchrun":
        many = comera(*common, "--out", str(tmp_path / "two"), nproc=2)
    else:
        many = comera(*common, "--out", str(tmp_path / "two"), "--nproc", "2")
    assert many.returncode == 0, many.stderr
    assert many.stdout.count("run folder:") == 1, many.stdout
    assert "warning" not in many.stderr.lower(), many.stderr  # none printed per rank, none about strides
    assert_same_results(results(tmp_path / "two"), results(tmp_path / "one"))
    records = read_metrics(tmp_path / "two")
    steps = [record["step"] for record in records if record["kind"] == "train"]
    assert len(steps) == len(set(steps)), "a record written by more than one process"
    assert all(len(record["step_time_per_rank"]) == 2 for record in records if record["kind"] == "train")
    if workload == "dlrm":  # the smoke nli's gates tie, so rounding may pick other ranks to trim
        config = (tmp_path / "two" / "model" / "comera_config.json").read_text()
        assert config == (tmp_path / "one" / "model" / "comera_config.json").read_text()


def test_a_setup_error_is_reported_once_and_stops_every_process(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text("{}")
    common = ["train", "nli", "--preset", "smoke", "--cache", str(tmp_path / "cache")]
    taken = comera(*common, "--out", str(tmp_path / "run"), nproc=2)
    assert taken.returncode != 0
    assert taken.stderr.count("already holds a run; continue it with --resume") == 1, taken.stderr
    odd = comera(*common, "--out", str(tmp_path / "odd"), "--set", "train.batch_size=7", "--nproc", "2")
    assert odd.stderr.count("train.batch_size=7 is the global batch and must be a multiple") == 1, odd.stderr
    # under the --nproc shortcut: exit status 2 and that line alone, without torchrun's failure report
    assert odd.returncode == 2 and "Traceback" not in odd.stderr and "ChildFailedError" not in odd.stderr
    assert odd.stderr.strip().count("\n") == 0, odd.stderr


def test_nproc_is_split_from_the_other_arguments():
    assert split_nproc(["nli", "--nproc", "4", "--preset", "smoke"]) == (4, ["nli", "--preset", "smoke"])
    assert split_nproc(["nli", "--nproc=2"]) == (2, ["nli"])
    assert split_nproc(["nli"]) == (None, ["nli"])
    for bad in (["--nproc"], ["--nproc", "0"], ["--nproc=two"], ["--nproc", "\uff12"], ["--nproc=\u0663"]):
        with pytest.raises(ValueError, match="--nproc"):
            split_nproc(bad)


def test_a_process_count_far_beyond_the_cores_is_refused_naming_the_range(monkeypatch):
    import comera.cli.launch

    monkeypatch.setattr(comera.cli.launch, "usable_cores", lambda: 2)
    assert split_nproc(["--nproc", "8"]) == (8, [])
    for bad in ("9", "100000"):
        with pytest.raises(ValueError, match=rf"--nproc must be an integer in \[1, 8\] .*got '{bad}'"):
            split_nproc(["--nproc", bad])


def test_the_torchrun_command_runs_comera_in_n_processes():
    command = torchrun_command(3, ["train", "nli"])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=3" in command and command[-4:] == ["-m", "comera", "train", "nli"]


def test_without_option_drops_every_occurrence_in_both_spellings():
    from comera.cli.launch import without_option

    argv = ["nli", "--config", "a.toml", "--preset", "smoke", "--config=b.toml", "--configs", "x"]
    assert without_option(argv, "--config") == ["nli", "--preset", "smoke", "--configs", "x"]
    assert without_option(["--config"], "--config") == []


def test_a_ctrl_c_before_the_processes_registered_kills_torchrun_and_says_nothing_was_written(
    monkeypatch, capsys
):
    """Ctrl-C while torchrun starts and no process has registered yet: the launcher marks the launch as
    stopping before it kills torchrun's group (a process that starts later reads the mark), waits for it,
    prints the start-up line and returns 130; torchrun is sent no SIGINT (it would print a traceback)."""
    import comera.cli.launch as launcher

    killed = []

    class Torchrun:
        pid = 4242

        def __init__(self, command, env, **options):
            assert options[
                "start_new_session"
            ]  # torchrun leads a group of its own: the kill reaches it alone
            self.folder = Path(env[launcher.STATUS_ENV])
            self.waits = 0

        def wait(self):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            return -signal.SIGKILL

        def send_signal(self, number):
            raise AssertionError(f"torchrun was sent signal {number}")

    def killpg(group, number):
        killed.append((group, number, (started[0].folder / "stopping").exists()))

    started = []
    monkeypatch.setattr(
        launcher.subprocess, "Popen", lambda *a, **k: started.append(Torchrun(*a, **k)) or started[-1]
    )
    monkeypatch.setattr(launcher.os, "killpg", killpg)
    assert launcher.launch(2, ["train", "nli"]) == launcher.INTERRUPTED == 130
    assert killed == [(Torchrun.pid, signal.SIGKILL, True)]
    assert capsys.readouterr().err == "comera: interrupted while starting; nothing was written\n"


def test_a_ctrl_c_while_torchrun_is_being_started_says_nothing_was_written(monkeypatch, capsys):
    """The Ctrl-C may land while the launcher starts torchrun (inside ``subprocess.Popen``), before it waits
    for it: the same one line and 130 (a torchrun that started dies with the launcher)."""
    import comera.cli.launch as launcher

    def starting(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher.subprocess, "Popen", starting)
    assert launcher.launch(2, ["train", "nli"]) == 130
    assert capsys.readouterr().err == "comera: interrupted while starting; nothing was written\n"


@pytest.mark.parametrize("marked", ["stopping", "folder-gone"])
def test_a_process_of_a_stopping_launch_ends_at_once_and_quietly(tmp_path, marked):
    """A process that torchrun starts after the launch was marked as stopping (or after the launcher removed
    its folder) ends at its first import of comera, with status 0 and no output, before it reads anything."""
    folder = tmp_path / "status"
    if marked == "stopping":
        folder.mkdir()
        (folder / "stopping").write_text("")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "comera", "train", "nli", "--preset", "smoke", "--out", str(out)]
    env = {**os.environ, "COMERA_STATUS_DIR": str(folder), "RANK": "1", "WORLD_SIZE": "2"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert (finished.returncode, finished.stdout, finished.stderr) == (0, "", "")
    assert not out.exists()


def _launch_processes(out):
    """The pids of the processes whose command line names ``out`` (launcher, torchrun, its processes)."""
    table = subprocess.run(
        ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True
    ).stdout.splitlines()
    return [int(line.split()[0]) for line in table[1:] if f"--out {out}" in line]


@pytest.mark.parametrize("moment", ["torchrun-starts", "processes-start"])
def test_a_ctrl_c_while_the_launch_starts_ends_it_in_one_line(tmp_path, moment):
    """SIGINT to ``comera train --nproc 2`` while torchrun imports torch (the launch's folder exists), or
    once torchrun's two processes exist but before they registered: one line, status 130, no traceback,
    no process left, no run folder."""
    import time

    out = tmp_path / "run"
    command = [sys.executable, "-m", "comera", "train", "nli", "--preset", "smoke", "--nproc", "2"]
    command += ["--cache", str(tmp_path / "cache"), "--out", str(out), "--no-progress"]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wanted = 1 if moment == "torchrun-starts" else 4  # the launcher, torchrun and its two processes
    started = time.monotonic()
    while time.monotonic() - started < TIMEOUT:
        folders = list(scratch.glob("comera-status-*"))
        if folders and len(_launch_processes(out)) >= wanted:
            break
        time.sleep(0.02)
        if launcher.poll() is not None:
            break
    assert folders, launcher.communicate()[0]
    assert not list(folders[0].glob("pid-*")), "the processes registered before the Ctrl-C could be sent"
    launcher.send_signal(signal.SIGINT)
    output = launcher.communicate(timeout=TIMEOUT)[0]
    assert launcher.returncode == 130, output
    assert output == "comera: interrupted while starting; nothing was written\n", output
    time.sleep(0.5)
    assert not _launch_processes(out) and not out.exists()


def test_a_ctrl_c_stops_every_process_with_one_line_and_no_traceback(tmp_path):
    """SIGINT to ``comera train --nproc 2`` while it trains: each process stops as a single one does, the
    launcher exits 130 with the one line that says how to continue, torchrun adds no traceback, and no
    process is left."""
    import signal
    import time

    out = tmp_path / "run"
    command = [sys.executable, "-m", "comera", "train", "nli", "--preset", "smoke", "--nproc", "2"]
    command += ["--cache", str(tmp_path / "cache"), "--out", str(out), "--set", "train.early=100000"]
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    started = time.monotonic()
    while not (out / "metrics.jsonl").is_file() and time.monotonic() - started < TIMEOUT:
        time.sleep(0.2)
    time.sleep(1.0)
    launcher.send_signal(signal.SIGINT)
    output = launcher.communicate(timeout=TIMEOUT)[0]
    assert launcher.returncode == 130, output
    assert "Traceback" not in output and "SignalException" not in output, output
    assert "Profiler record function" not in output, output  # torch.compile's note on DDP's annotation
    assert output.count("interrupted; continue the run with --resume") == 1, output
    assert not _launch_processes(out)


def test_a_process_that_does_not_stop_on_the_ctrl_c_gets_sigterm_after_the_grace(tmp_path, monkeypatch):
    """A process left waiting (in a collective, or in the rendezvous for a process that has stopped) does
    not act on SIGINT: after ``STOP_GRACE_S`` it is sent SIGTERM, so the launch ends instead of hanging."""
    import signal

    import comera.cli.launch as launcher

    stuck = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stuck.stdout.readline().strip() == "ready"

    class Torchrun:
        def __init__(self, command, env, **options):
            (Path(env[launcher.STATUS_ENV]) / "pid-0").write_text(str(stuck.pid))
            self.calls = 0

        def wait(self, timeout=None):
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt
            if timeout is not None:
                raise subprocess.TimeoutExpired("torchrun", timeout)
            return stuck.wait(timeout=30)

    monkeypatch.setattr(launcher.subprocess, "Popen", Torchrun)
    monkeypatch.setattr(launcher, "STOP_GRACE_S", 0.1)
    try:
        assert launcher.launch(2, ["train", "nli"]) == launcher.INTERRUPTED
        assert stuck.returncode == -signal.SIGTERM
    finally:
        stuck.kill()
        stuck.wait()


@pytest.mark.parametrize(
    ("finished", "status", "signals"),
    [((0, 1), 0, []), ((0,), 130, [([10_000, 10_001], signal.SIGINT)])],
    ids=["every-process-finished", "one-still-trains"],
)
def test_a_ctrl_c_is_passed_on_only_while_a_process_runs(monkeypatch, finished, status, signals):
    """The processes of a finished run still tear down their group for a few seconds after ``run folder:``
    is printed; a Ctrl-C then must not kill them (torchrun would print its failure report for a complete
    run): the launch waits them out and returns their status. While one still trains, both get it."""
    import comera.cli.launch as launcher

    signalled = []

    def record(pids, number):
        signalled.append((sorted(pids), number))

    monkeypatch.setattr(launcher, "_signal_all", record)

    monkeypatch.setattr(launcher.subprocess, "Popen", _interrupted_torchrun((0, 1), finished, signalled))
    assert launcher.launch(2, ["train", "nli"]) == status
    assert signalled == signals


def _interrupted_torchrun(ranks, finished, signalled, folders=None):
    """A stand-in for ``subprocess.Popen`` of ``torchrun`` whose processes ``ranks`` registered (pids 10000 +
    rank; ``finished`` ones finished their run) and whose first wait meets a Ctrl-C; it records the signals
    sent to it in ``signalled`` and its status folder in ``folders``."""
    import comera.cli.launch as launcher

    class Torchrun:
        def __init__(self, command, env, **options):
            folder = Path(env[launcher.STATUS_ENV])
            if folders is not None:
                folders.append(folder)
            for rank in ranks:
                (folder / f"pid-{rank}").write_text(str(10_000 + rank))
            for rank in finished:
                (folder / f"finished-{rank}").write_text("")
            self.calls = 0

        def wait(self, timeout=None):
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt
            return 0

        def send_signal(self, number):
            signalled.append(number)

    return Torchrun


def test_the_launch_is_marked_interrupted_before_its_processes_get_the_ctrl_c(monkeypatch):
    """The processes get the Ctrl-C one after the other: the launcher marks the launch as interrupted first,
    so that a process whose collective call fails because another stopped already knows why."""
    import comera.cli.launch as launcher

    folders = []
    marked_when_signalled = []

    def record(pids, number):
        marked_when_signalled.append((folders[0] / LAUNCH_INTERRUPTED).is_file())

    monkeypatch.setattr(launcher.subprocess, "Popen", _interrupted_torchrun((0,), (), [], folders))
    monkeypatch.setattr(launcher, "_signal_all", record)
    assert launcher.launch(2, ["train", "nli"]) == launcher.INTERRUPTED
    assert marked_when_signalled == [True]


@pytest.mark.parametrize("interrupted", [True, False], ids=["launch-interrupted", "peer-crashed"])
def test_a_process_that_loses_a_peer_of_an_interrupted_launch_stops_as_interrupted(
    tmp_path, monkeypatch, capsys, interrupted
):
    """Rank 0 of a Ctrl-C'd launch whose collective call fails because rank 1 stopped first (its own SIGINT
    still on the way) prints the interrupted line and records 130, not "another process stopped"; without a
    Ctrl-C the lost peer is reported as such, status 1."""
    import comera.cli.commands.train as train_command
    import comera.cli.launch as launcher
    from comera.train.parallel import RankLostError

    folder = tmp_path / "status"
    folder.mkdir()
    if interrupted:
        (folder / LAUNCH_INTERRUPTED).write_text("")
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    monkeypatch.setenv(launcher.STATUS_ENV, str(folder))
    monkeypatch.setenv("RANK", "0")

    def lose_a_peer(args, out, speaks):
        raise RankLostError("process 0 of 2 stopped: another process of the run stopped")

    monkeypatch.setattr(train_command, "_train_here", lose_a_peer)
    status = train_command.main(["nli", "--preset", "smoke", "--out", str(out)])
    said = capsys.readouterr().err
    assert status == 0  # under a launch the status is recorded for the launcher
    assert (folder / "rank-0").read_text() == ("130" if interrupted else "1")
    assert said.count("interrupted; continue the run with --resume") == (1 if interrupted else 0), said
    assert ("another process of the run stopped" in said) is not interrupted, said


def test_a_run_whose_prune_removes_layers_trains_and_resumes_in_two_processes(tmp_path):
    """A long early stage drives whole layers' gates to zero: the prune at its end replaces those layers by
    stand-ins, and what fed only them gets no gradient. DDP, rebuilt on the pruned model, must look for such
    parameters, or the next step fails on both ranks; so must DDP built on a checkpoint taken after that
    prune (a run killed there and resumed). The launcher killed with SIGKILL takes torchrun and its
    processes with it, without a traceback."""
    import time

    out = tmp_path / "run"
    command = [sys.executable, "-m", "comera", "train", "nli", "--preset", "smoke", "--nproc", "2"]
    command += ["--cache", str(tmp_path / "cache"), "--out", str(out), "--no-progress"]
    for assignment in ("train.early=300", "train.late=150", "train.checkpoint_every=25"):
        command += ["--set", assignment]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    started = time.monotonic()
    while launcher.poll() is None and time.monotonic() - started < TIMEOUT:
        if (out / "checkpoints" / "step-00000350.pt").is_file():
            launcher.kill()
            break
        time.sleep(0.05)
    output = launcher.communicate(timeout=TIMEOUT)[0]
    assert launcher.returncode == -signal.SIGKILL, output  # killed after the prune, not failed before
    assert "Traceback" not in output and "SignalException" not in output, output  # torchrun stops quietly
    time.sleep(1.0)  # torchrun and its processes stop with the launcher
    assert not _launch_processes(out)
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    prunes = [record for record in read_metrics(out / "metrics.jsonl") if record.get("event") == "prune"]
    assert prunes and prunes[0]["removed"], "the preset no longer removes a layer: the test needs another"
    assert results(out)["processes"] == 2
