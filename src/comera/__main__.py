"""``python -m comera ...``: the ``comera`` command (:func:`comera.cli.entry`); also what ``torchrun`` runs in
each process of ``torchrun --nproc-per-node N -m comera train WORKLOAD ...``."""

from comera.cli import entry

if __name__ == "__main__":
    raise SystemExit(entry())
