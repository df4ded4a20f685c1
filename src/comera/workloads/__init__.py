"""The built-in workloads, one folder each (``nli``, ``dlrm``, ``mlm``, ``llm``): model, data, recipe, presets
and benchmark side by side, imported only when asked for by name (:func:`load_recipe`, which also finds
recipes registered elsewhere). Details: docs/recipes.md, 'Workloads (recipes)'.
"""

from __future__ import annotations

import importlib

from comera.recipes.base import Recipe, get_recipe, recipe_names

__all__ = ["WORKLOADS", "load_recipe", "load_workloads", "workload_names"]

WORKLOADS: dict[str, str] = {
    "nli": "comera.workloads.nli.recipe",
    "dlrm": "comera.workloads.dlrm.recipe",
    "mlm": "comera.workloads.mlm.recipe",
    "llm": "comera.workloads.llm.recipe",
}
"""Built-in workload name -> the module whose import registers its recipe."""


def workload_names() -> tuple[str, ...]:
    """The built-in workloads and every other registered recipe, sorted; imports no workload."""
    return tuple(sorted({*WORKLOADS, *recipe_names()}))


def load_recipe(name: str) -> Recipe:
    """A new instance of workload ``name``'s recipe, importing a built-in workload's module on first use.

    Raises:
        ValueError: ``name`` is neither a built-in workload nor a registered recipe (the message names
            the valid ones).
    """
    if name in WORKLOADS:
        importlib.import_module(WORKLOADS[name])
    elif name not in recipe_names():
        raise ValueError(f"unknown workload {name!r}; choose one of {list(workload_names())}")
    return get_recipe(name)


def load_workloads() -> None:
    """Import every built-in workload, so that each recipe and its presets are registered."""
    for module in WORKLOADS.values():
        importlib.import_module(module)
