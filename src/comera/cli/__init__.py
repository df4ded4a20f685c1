"""The ``comera`` command and the handling of its processes (Ctrl-C, ``--nproc`` launches, output whose
reader left); only the entry points use it, and nothing below :mod:`comera.commands` imports it."""

from comera.cli.main import entry, main

__all__ = ["entry", "main"]
