"""``comera.cli.child.run_child``: a Ctrl-C waits for the child to stop in its own way, then reaches the
caller.

Each case runs a driver process in a process group of its own (as a terminal's foreground job) that calls
``run_child`` on a child which, on SIGINT, takes a moment to finish (as a run writing its checkpoint does),
prints a line and exits 130; the test then sends SIGINT as a terminal (to the group) or with ``kill`` (to
the driver alone).
"""

import os
import signal
import subprocess
import sys
import time

CHILD = """
import signal, sys, time
def stop(signum, frame):
    time.sleep(0.5)
    print("child stopped", flush=True)
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("child ready", flush=True)
time.sleep(60)
print("child slept out", flush=True)
"""

DRIVER = """
import sys
import comera.cli.child as child
child.GRACE_S = float(sys.argv[2])
try:
    child.run_child([sys.executable, "-c", sys.argv[1]])
except KeyboardInterrupt:
    print("parent interrupted", flush=True)
    sys.exit(130)
"""


def _interrupt(whole_group: bool, grace: float) -> tuple[int, list[str], float]:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, CHILD, str(grace)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: (os.setpgrp(), signal.signal(signal.SIGINT, signal.SIG_DFL)),
    )
    assert driver.stdout.readline().strip() == "child ready"
    sent = time.monotonic()
    if whole_group:
        os.killpg(driver.pid, signal.SIGINT)
    else:
        driver.send_signal(signal.SIGINT)
    rest = driver.communicate(timeout=60)[0].splitlines()
    return driver.returncode, rest, time.monotonic() - sent


def test_a_ctrl_c_is_waited_out_until_the_child_has_stopped():
    """SIGINT to the group: the child finishes its stop (not killed at once), then the caller sees it."""
    code, lines, _ = _interrupt(whole_group=True, grace=30.0)
    assert code == 130
    assert lines == ["child stopped", "parent interrupted"]


def test_a_sigint_to_the_parent_alone_is_passed_on_after_the_grace():
    """SIGINT to the driver alone (``kill -INT``): the child is sent one after the grace period."""
    code, lines, seconds = _interrupt(whole_group=False, grace=0.5)
    assert code == 130
    assert lines == ["child stopped", "parent interrupted"]
    assert seconds < 30


def test_a_ctrl_c_while_the_module_imports_ends_it_with_130_and_one_line(tmp_path):
    """``module_command``: a Ctrl-C before the module's own handling (an import taking a while, as torch's
    does) ends it with status 130 and the one line of a command stopped while starting, no traceback; the
    module's arguments reach it as ``sys.argv``."""
    from comera.cli.child import INTERRUPTED_WHILE_STARTING, module_command

    (tmp_path / "slow_start.py").write_text(
        "import sys, time\nprint('importing', sys.argv[1:], flush=True)\ntime.sleep(60)\n"
    )
    process = subprocess.Popen(
        module_command("slow_start", ["--flag", "x"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        preexec_fn=lambda: (os.setpgrp(), signal.signal(signal.SIGINT, signal.SIG_DFL)),
    )
    assert process.stdout.readline().strip() == "importing ['--flag', 'x']"
    os.killpg(process.pid, signal.SIGINT)
    _, errors = process.communicate(timeout=30)
    assert process.returncode == 130 and errors == f"{INTERRUPTED_WHILE_STARTING}\n"


def test_a_handled_interrupt_raised_in_exec_code_leaves_the_exit_status_alone(tmp_path):
    """CPython keeps a KeyboardInterrupt raised in ``exec``'d code (a dataclass being built during an
    import) as unhandled and, in a ``python -m`` process, ends it by SIGINT at exit (a torchrun process then
    "fails" with -2) unless :func:`interrupt_handled` is called where it is caught."""
    import subprocess
    import sys

    (tmp_path / "ends_with_seven.py").write_text(
        "import sys\n"
        "from comera.cli.child import interrupt_handled\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt')\n"
        "except KeyboardInterrupt:\n"
        "    if sys.argv[1] == 'handled':\n"
        "        interrupt_handled()\n"
        "raise SystemExit(7)\n"
    )
    for how, status in (("handled", 7), ("plain", -2)):
        command = [sys.executable, "-m", "ends_with_seven", how]
        finished = subprocess.run(command, capture_output=True, timeout=120, cwd=tmp_path)
        assert finished.returncode == status, (how, finished.stderr)
