"""What a workload recipe is: model, data, loss, evaluation, tensorization and training settings, by preset
(sections ``model``, ``data``, ``train``, ``tensorize`` and optional per-method ``method`` overrides);
:func:`register_recipe` makes it ``comera train NAME``. Details: docs/recipes.md, 'Workloads (recipes)' and
'Settings'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

from comera.train.evaluation import Evaluator

__all__ = ["Recipe", "RecipeData", "register_recipe", "get_recipe", "recipe_names"]


@dataclass
class RecipeData:
    """The datasets of a run.

    Attributes:
        train: the training dataset (map-style; the Trainer batches it with ``train.batch_size``).
        evals: evaluation datasets by split name, batched as ``train`` is; the first one is evaluated during
            training.
        collate_fn: turns a list of samples into a batch (None: ``torch.utils.data.default_collate``).
        info: facts for ``results.json``'s ``"data"`` (``{"splits": {split: {"read": n, "skipped": k}}}``
            ...); ``info["identity"]``, optional: ``{name: hex digest}`` of what the build made that its
            inputs do not fix (a trained tokenizer), which a resume must find unchanged.
    """

    train: Dataset
    evals: dict[str, Dataset]
    collate_fn: Callable[[list], Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Recipe:
    """A workload: how to build its data and model, its task loss and its evaluation.

    Attributes:
        name: the workload's name on the command line (``comera train NAME``).
        description: one line for ``--help``.
        presets: preset name -> settings (sections ``model``, ``data``, ``train``, ``tensorize``,
            optional ``method``).
        primary_metric: the evaluation metric ``comera compare`` leads with and plots; empty: the
            evaluator's first metric.
        comparison_axes: what ``comera compare`` plots the primary metric against, from
            :data:`comera.train.plots.COMPARISON_AXES`.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    primary_metric: ClassVar[str] = ""
    comparison_axes: ClassVar[tuple[str, ...]] = ("step",)
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        """The run's datasets from ``data_path`` (None: the recipe's embedded default data).

        Args:
            settings: the run's ``data`` section.
            data_path: the user's ``--data``, or None.
            cache_dir: a folder for derived files worth keeping between runs (vocabularies, binary caches).
        """
        raise NotImplementedError

    def check_model_settings(self, settings: dict[str, Any]) -> None:
        """Check the run's ``model`` section before any data is read (``ValueError`` whose message opens
        with the key, e.g. ``hidden_size (96) must be ...``); default: nothing beyond the types
        :mod:`comera.recipes.settings` checks."""

    def build_model(self, settings: dict[str, Any], data: RecipeData) -> nn.Module:
        """The dense model from the run's ``model`` section (sizes the data decides, e.g. the vocabulary,
        come from ``data.info``)."""
        raise NotImplementedError

    def loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The 0-dim task loss of ``model`` on ``batch`` (moves the batch to the model's device)."""
        raise NotImplementedError

    def evaluator(self, settings: dict[str, Any]) -> Evaluator:
        """A fresh evaluator computing the workload's metrics exactly over a whole split."""
        raise NotImplementedError

    def extra_results(self, results: dict[str, Any], data: RecipeData, trainer: Any) -> dict[str, Any]:
        """Keys the workload adds to ``results.json`` (default none), computed at the end of the run.

        Args:
            results: the keys every run reports (``evaluation``, ``steps``, ``step_time_s`` ...).
            data: the run's data.
            trainer: the :class:`comera.train.Trainer` that trained (its ``module``, ``optimizer``, ``config``
                with the per-process ``batch_size``, ``world_size``).
        """
        return {}

    def save_model_files(self, folder: Path, data: RecipeData) -> None:
        """Write what the trained model needs beside its weights into the run's ``model/`` folder (default
        nothing; a language model writes its tokenizer)."""


_RECIPES: dict[str, type[Recipe]] = {}


def register_recipe(recipe: type[Recipe]) -> type[Recipe]:
    """Class decorator: make ``recipe`` runnable as ``comera train NAME``."""
    if not (isinstance(recipe, type) and issubclass(recipe, Recipe)) or not recipe.name:
        raise TypeError(f"recipe must be a Recipe subclass with a name, got {recipe!r}")
    _RECIPES[recipe.name] = recipe
    return recipe


def recipe_names() -> tuple[str, ...]:
    """Names of the registered recipes, sorted."""
    return tuple(sorted(_RECIPES))


def get_recipe(name: str) -> Recipe:
    """A new instance of the registered recipe ``name``; ``ValueError`` naming the valid ones otherwise."""
    if name not in _RECIPES:
        raise ValueError(
            f"unknown workload {name!r}; choose one of {list(recipe_names())} (a built-in workload registers "
            "its recipe when comera.workloads.load_recipe(NAME) imports it)"
        )
    return _RECIPES[name]()
