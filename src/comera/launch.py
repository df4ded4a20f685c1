"""``comera train --nproc N ...``: N processes of ``comera train ...`` on this machine, under ``torchrun``.

The shortcut stands for ``torchrun --standalone --nproc-per-node N -m comera train ...`` (PyTorch's
``torch.distributed.run`` with a rendezvous on a free local port), run with this Python. For several machines
call ``torchrun`` itself (``--nnodes``, ``--rdzv-endpoint``; see docs/training.md, "More than one process").
"""

from __future__ import annotations

import subprocess
import sys

__all__ = ["split_nproc", "torchrun_command", "launch"]


def split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """``(N, the other arguments)`` from arguments that may hold ``--nproc N`` or ``--nproc=N``.

    Raises:
        ValueError: ``--nproc`` without a value, or a value that is not an integer >= 1.
    """
    rest: list[str] = []
    nproc: str | None = None
    arguments = iter(argv)
    for argument in arguments:
        if argument == "--nproc":
            nproc = next(arguments, None)
            if nproc is None:
                raise ValueError("--nproc needs a value: the number of processes, an integer >= 1")
        elif argument.startswith("--nproc="):
            nproc = argument.split("=", 1)[1]
        else:
            rest.append(argument)
    if nproc is None:
        return None, rest
    if not nproc.isdigit() or int(nproc) < 1:
        raise ValueError(f"--nproc must be an integer >= 1 (the number of processes), got {nproc!r}")
    return int(nproc), rest


def torchrun_command(nproc: int, command: list[str]) -> list[str]:
    """The ``torchrun`` command line that runs ``python -m comera COMMAND...`` in ``nproc`` processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "comera",
        *command,
    ]


def launch(nproc: int, command: list[str]) -> int:
    """Run :func:`torchrun_command` and return its exit status (non-zero when any process failed)."""
    return subprocess.call(torchrun_command(nproc, command))
