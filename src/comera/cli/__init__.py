"""The ``comera`` command: its subcommands (:mod:`comera.cli.commands`) and the handling of their processes
(Ctrl-C, ``--nproc`` launches, output whose reader left); only the entry points use it, and no library module
imports it."""

from __future__ import annotations

__all__ = ["entry", "main"]


def entry() -> int:
    """The console script ``comera`` and ``python -m comera``: the process handling of a command first
    (:func:`comera.cli.startup.quiet_start`, before anything heavy is imported), then :func:`main`."""
    from comera.cli.startup import quiet_start

    quiet_start()
    return main()


def main(argv: list[str] | None = None) -> int:
    """The ``comera`` command on ``argv`` (default ``sys.argv[1:]``), without the process handling of
    :func:`entry` (:func:`comera.cli.command.main`)."""
    from comera.cli.command import main as command

    return command(argv)
