"""The method interface and its registry: how a recipe's dense model is turned into what is trained, and
what trains it.

A :class:`Method` is a model transform (:meth:`Method.prepare`), an objective and an optimizer, plus
optional callbacks; every method trains through the same :class:`comera.train.Trainer` loop, so step times
are comparable by construction. :mod:`comera.methods` registers the built-in methods (``dense``, ``comera``,
``galore``, ``apollo``, ``lte``, ``cola``) when it is imported; another method registers itself with
:func:`register_method`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from comera.tensorize_config import TensorizeConfig
from comera.train.config import TrainConfig
from comera.train.objective import Objective, TaskObjective

__all__ = [
    "Method",
    "MethodContext",
    "register_method",
    "get_method",
    "method_names",
]


@dataclass
class MethodContext:
    """What a method may need from the recipe besides the model.

    Attributes:
        tensorize: the recipe's tensorization (its named preset with the run's overrides); the ``comera``
            method applies it, low-rank baselines may read its targets.
        settings: the run's ``method`` settings section (the method's own knobs, defaults from
            :attr:`Method.defaults`).
        train: the run's :class:`comera.TrainConfig`.
    """

    tensorize: TensorizeConfig
    settings: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)


class Method:
    """One way to train a recipe's model. Subclass, set :attr:`name` and :attr:`defaults`, and register.

    Attributes:
        name: the ``--method`` name.
        defaults: the method's settings and their defaults (the ``method`` section of a run's settings
            accepts exactly these keys).
        staged: whether the method has CoMERA's early and late stages (otherwise a run is ``early + late``
            steps of one objective).
        settings_type: the dataclass of the method's settings, if it has one: a run's ``method`` values must
            then have the types its fields declare (else the types of :attr:`defaults`).
    """

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    staged: ClassVar[bool] = False
    settings_type: ClassVar[type | None] = None

    def prepare(self, model: nn.Module, context: MethodContext) -> nn.Module:
        """Turn the recipe's dense ``model`` into the model this method trains (in place where possible)."""
        return model

    def objective(self, model: nn.Module, context: MethodContext) -> Objective:
        """The objective on top of the task loss (default: the task loss alone)."""
        return TaskObjective(model)

    def optimizer(self, model: nn.Module, context: MethodContext) -> torch.optim.Optimizer | None:
        """The method's optimizer, or None for the Trainer's default AdamW on the objective's groups."""
        return None

    def callbacks(self, model: nn.Module, context: MethodContext) -> list[Callable[[Any], None]]:
        """``callback(trainer)`` functions run after every step (e.g. periodic merges)."""
        return []

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Check a run's ``method`` section (its keys are :attr:`defaults`'); ``ValueError`` naming the
        setting. Called when a run's settings are resolved, before any data is read (nothing checked here)."""


_METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Make ``method`` selectable by its name (``--method NAME``); a name is registered once."""
    if not isinstance(method, Method) or not method.name:
        raise TypeError(f"method must be a Method instance with a name, got {method!r}")
    if method.name in _METHODS and type(_METHODS[method.name]) is not type(method):
        raise ValueError(f"a method named {method.name!r} is already registered")
    _METHODS[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    """The registered method names, sorted."""
    return tuple(sorted(_METHODS))


def get_method(name: str) -> Method:
    """The registered method ``name``; ``ValueError`` naming the valid ones otherwise."""
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {list(method_names())}")
    return _METHODS[name]
