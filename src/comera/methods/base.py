"""The method interface and its registry: a :class:`Method` is a model transform (:meth:`Method.prepare`), an
objective, an optimizer and optional callbacks, trained through the one :class:`comera.train.Trainer` loop,
registered with :func:`register_method` keyed by its settings dataclass. Details: docs/architecture.md section
5."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

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
    "method_for",
    "settings_type",
    "method_settings",
    "settings_values",
]


@dataclass
class MethodContext:
    """What a method may need from the recipe besides the model.

    Attributes:
        tensorize: the recipe's tensorization (its named preset with the run's overrides); the ``comera``
            method applies it, low-rank baselines may read its targets.
        settings: the method's settings object (the dataclass it is registered with, as a run's
            :class:`comera.recipes.spec.RunSpec` holds it), or a mapping of some of its fields (the others
            take their defaults; :meth:`Method.settings` builds the object).
        train: the run's :class:`comera.TrainConfig`.
    """

    tensorize: TensorizeConfig
    settings: Any = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)


class Method:
    """One way to train a recipe's model. Subclass, set :attr:`name`, and register the class with the
    dataclass of its settings (``@register_method(MySettings)``): a run's ``method`` section holds exactly
    that dataclass's fields, and its constructor checks them (``ValueError`` naming the field).

    Attributes:
        name: the ``--method`` name.
        staged: whether the method has CoMERA's early and late stages (otherwise a run is ``early + late``
            steps of one objective).
    """

    name: ClassVar[str] = ""
    staged: ClassVar[bool] = False

    def settings(self, context: MethodContext) -> Any:
        """The method's settings object of ``context``: ``context.settings`` itself when it is one, else
        built from it (:func:`method_settings`)."""
        wanted = settings_type(self.name)
        if isinstance(context.settings, wanted):
            return context.settings
        return method_settings(self.name, context.settings)

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


_METHODS: dict[str, Method] = {}
_SETTINGS_TYPES: dict[str, type] = {}
_BY_SETTINGS: dict[type, Method] = {}

M = TypeVar("M", bound=type[Method])


def register_method(settings: type) -> Callable[[M], M]:
    """Class decorator: ``@register_method(CoMERASettings)`` makes the decorated :class:`Method` subclass
    selectable by its name (``--method NAME``), its settings read into ``settings`` (a dataclass whose
    constructor checks them). A name, and a settings dataclass, is registered once."""
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise TypeError(f"register_method takes the method's settings dataclass, got {settings!r}")

    def register(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, Method) and cls.name):
            raise TypeError(f"register_method decorates a Method subclass with a name, got {cls!r}")
        for owner in (_METHODS.get(cls.name), _BY_SETTINGS.get(settings)):
            if owner is not None and type(owner).__qualname__ != cls.__qualname__:  # a reloaded module passes
                raise ValueError(f"a method named {owner.name!r} is already registered ({settings.__name__})")
        method = cls()
        _METHODS[cls.name], _SETTINGS_TYPES[cls.name], _BY_SETTINGS[settings] = method, settings, method
        return cls

    return register


def method_names() -> tuple[str, ...]:
    """The registered method names, sorted."""
    return tuple(sorted(_METHODS))


def get_method(name: str) -> Method:
    """The registered method ``name``; ``ValueError`` naming the valid ones otherwise."""
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {list(method_names())}")
    return _METHODS[name]


def method_for(settings: object) -> Method:
    """The registered method whose settings dataclass ``settings`` is an instance of."""
    if type(settings) not in _BY_SETTINGS:
        raise ValueError(f"no method is registered with {type(settings).__name__} settings")
    return _BY_SETTINGS[type(settings)]


def settings_type(name: str) -> type:
    """The settings dataclass of the registered method ``name``."""
    get_method(name)
    return _SETTINGS_TYPES[name]


def method_settings(name: str, values: Mapping[str, Any]) -> Any:
    """The settings object of method ``name`` from ``values`` (its fields; the others take their defaults;
    lists become tuples); ``ValueError`` naming an unknown key and the valid ones, or the field the
    dataclass's constructor refuses."""
    wanted = settings_type(name)
    known = {item.name for item in dataclasses.fields(wanted)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {wanted.__name__} keys {unknown}; valid keys: {sorted(known)}")
    return wanted(**{key: tuple(item) if isinstance(item, list) else item for key, item in values.items()})


def settings_values(settings: object) -> dict[str, Any]:
    """A settings dataclass as plain Python (lists for tuples): a run's ``method`` section, storable in JSON
    or a ``weights_only`` checkpoint; :func:`method_settings` reads it back."""
    return {
        item.name: list(value) if isinstance(value := getattr(settings, item.name), tuple) else value
        for item in dataclasses.fields(settings)  # type: ignore[arg-type]
    }
