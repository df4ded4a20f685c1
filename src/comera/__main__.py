"""``python -m comera ...``: the ``comera`` command (:func:`comera.cli.main`); also what ``torchrun`` runs in
each process of ``torchrun --nproc-per-node N -m comera train WORKLOAD ...``."""

from comera.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
