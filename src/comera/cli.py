"""The ``comera`` command: ``comera demo [...]``, ``comera bench NAME [...]``.

Both run their job (``comera.demo``, ``comera.bench.NAME``) in a fresh Python process with PyTorch's
transparent huge page allocation enabled (``THP_MEM_ALLOC_ENABLE=1``, read by PyTorch once at start-up;
it removes most of the page-fault cost of fresh output-sized tensors on CPU). Set the variable yourself
to override it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from comera.bench import BENCHMARKS

__all__ = ["main"]


def _run_module(module: str, rest: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return subprocess.call([sys.executable, "-m", module, *rest], env=env)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``comera`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="comera", description="comera: tensor-train training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a dense and a comera MLP on a built-in task", add_help=False)
    bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", choices=BENCHMARKS)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return _run_module("comera.demo", rest)
    return _run_module(f"comera.bench.{args.name}", rest)


if __name__ == "__main__":
    raise SystemExit(main())
