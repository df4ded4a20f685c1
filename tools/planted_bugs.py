"""Plant known, realistic bugs one at a time and check that the test suite catches each of them.

Usage: ``python tools/planted_bugs.py`` from the repository root (about 3 minutes on 2 cores: the tests
run once unchanged, then once per bug).

Each bug is a one-line change to a copy of ``src/`` in a temporary folder; the named tests run with that copy
first on ``PYTHONPATH`` and stop at the first failure. A bug counts as caught when pytest exits with status 1
(a test failed); any other status (the change no longer applies, an import or collection error) is reported
as an error, so a refactor that moves the planted line shows up instead of passing silently. Exits with
status 1 unless every bug is caught.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PlantedBug:
    """One behaviour, the file to change, the exact line fragment and its buggy replacement, and the tests."""

    behaviour: str
    file: str
    correct: str
    buggy: str
    tests: tuple[str, ...]


BUGS = (
    PlantedBug(
        "size accounting: a dead bond no longer zeroes its train",
        "comera/rank/size.py",
        "    return size * alive\n",
        "    return size\n",
        ("tests/rank",),
    ),
    PlantedBug(
        "late-stage switch: the raw batch loss instead of the smoothed loss",
        "comera/rank/adaptation.py",
        "        smoothed = self._ema_sum / self._ema_weight\n",
        "        smoothed = task_loss.detach().to(self._ema_sum.dtype)\n",
        ("tests/rank",),
    ),
    PlantedBug(
        "prune_: second moments scaled by g instead of g squared",
        "comera/rank/prune.py",
        "(scale.square() if _is_squared(key) else scale)",
        "(scale)",
        ("tests/rank",),
    ),
    PlantedBug(
        "prune_: optimizer state not rescaled at all",
        "comera/rank/prune.py",
        "sliced = sliced * (scale.square() if _is_squared(key) else scale).to(sliced.dtype)",
        "sliced = sliced",
        ("tests/rank",),
    ),
    PlantedBug(
        "atomic_write: temporary file outside the target folder",
        "comera/atomic.py",
        "    temporary = path.parent / ",
        "    temporary = Path(tempfile.gettempdir()) / ",
        ("tests/test_atomic_write.py",),
    ),
    PlantedBug(
        "load_pretrained: unexpected-key check skipped",
        "comera/io.py",
        "    if unexpected:\n",
        "    if False:\n",
        ("tests/test_io.py", "tests/test_io_unexpected_keys.py", "tests/test_io_contract.py"),
    ),
    PlantedBug(
        "TTM split choice: the most expensive split",
        "comera/tt/costs.py",
        "    best = min(costs, key=costs.get)",
        "    best = max(costs, key=costs.get)",
        ("tests/tt",),
    ),
    PlantedBug(
        "lookup: dedup=True never deduplicates",
        "comera/tt/lookup.py",
        "    if dedup or (dedup is None and ",
        "    if (dedup is None and ",
        ("tests/tt", "tests/nn"),
    ),
)


def _pytest(tests: tuple[str, ...], source: Path) -> int:
    env = dict(os.environ, PYTHONPATH=str(source), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True).returncode


def run_one(bug: PlantedBug, source: Path) -> str:
    """Plant ``bug`` in the ``src`` copy at ``source`` and run its tests: "caught", "missed" or an error.

    Pytest exit status 1 (a test failed) is "caught", 0 is "missed", anything else an error.
    """
    path = source / bug.file
    original = path.read_text()
    if original.count(bug.correct) != 1:
        return f"error: {bug.correct.strip()!r} occurs {original.count(bug.correct)} times in {bug.file}"
    path.write_text(original.replace(bug.correct, bug.buggy))
    try:
        status = _pytest(bug.tests, source)
    finally:
        path.write_text(original)
    return {0: "missed", 1: "caught"}.get(status, f"error: pytest exited with status {status}")


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "src"
        shutil.copytree(ROOT / "src", source)
        every_test = tuple(sorted({test for bug in BUGS for test in bug.tests}))
        if _pytest(every_test, source) != 0:
            print("error: the tests fail without any planted bug; fix them first")
            return 1
        results = []
        for bug in BUGS:
            results.append(run_one(bug, source))
            print(f"{results[-1]:8s} {bug.behaviour}", flush=True)
    return 0 if all(result == "caught" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
