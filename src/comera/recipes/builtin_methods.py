"""The built-in methods outside :mod:`comera.methods`, registered by importing their modules.

A stopgap until the methods register when ``comera`` is imported (issue 30, item 1): the command layer
and the benchmarks call :func:`load_methods` before they look a method up by name.
"""

from __future__ import annotations

import importlib

__all__ = ["METHOD_MODULES", "load_methods"]

METHOD_MODULES: tuple[str, ...] = (
    "comera.baselines.galore",
    "comera.baselines.apollo",
    "comera.baselines.lte",
    "comera.baselines.cola",
)
"""Modules whose import registers a baseline method."""


def load_methods() -> None:
    """Import every baseline module so that :func:`comera.methods.get_method` finds its method."""
    for module in METHOD_MODULES:
        importlib.import_module(module)
