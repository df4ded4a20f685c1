"""The protocol every comera layer type follows (:class:`ComeraLayer`: spec, ``from_spec``, ``from_dense``,
``to_dense_module``, ``pruned_stand_in``, report attributes) and the registry of layer types by kind; a new
layer type is one subclass decorated with :func:`register_layer`. Details: docs/architecture.md section 3."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = [
    "ComeraLayer",
    "register_layer",
    "layer_type",
    "layer_kinds",
    "is_layer",
    "layer_for_dense",
    "spec_arguments",
    "NameOf",
    "Resolve",
]

NameOf = Callable[[nn.Module], str]
Resolve = Callable[[str], nn.Module]

_LAYER_TYPES: dict[str, type[ComeraLayer]] = {}


def spec_arguments(cls: type[ComeraLayer], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor arguments of ``spec`` (all keys but ``"kind"``); ``ValueError`` if ``spec`` is not
    an object of kind ``cls.kind``."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"a layer spec must be an object, got {type(spec).__name__}")
    if spec.get("kind") != cls.kind:
        raise ValueError(f"spec kind {spec.get('kind')!r} is not {cls.kind!r}")
    return {key: value for key, value in spec.items() if key != "kind"}


class ComeraLayer:
    """Mixin declaring the layer protocol; subclasses are ``nn.Module`` s. Class attributes: ``kind``
    (registry key, by default the class name), ``dense_type`` (the dense class it converts from, or None),
    ``role`` (``"linear"`` or ``"embedding"``), ``format`` (``"tt"`` / ``"ttm"``), ``shape_options`` (the
    constructor's mode-shape keywords), ``report_format`` (``"tt"``, ``"ttm"``, ``"removed"``) and
    ``owns_weight`` (False for a layer borrowing another's weight, as a tied head)."""

    kind: ClassVar[str]
    dense_type: ClassVar[type[nn.Module] | None] = None
    role: ClassVar[str | None] = None
    format: ClassVar[str | None] = None
    shape_options: ClassVar[tuple[str, ...]] = ()
    report_format: ClassVar[str] = "removed"
    owns_weight: ClassVar[bool] = True

    def spec(self, name_of: NameOf | None = None) -> dict[str, Any]:
        """``{"kind": ..., constructor attribute: value, ...}``, JSON-ready; ``name_of`` gives the model's
        name of a module the layer refers to."""
        raise NotImplementedError

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        resolve: Resolve | None = None,
    ) -> nn.Module:
        """A fresh layer with the attributes recorded in ``spec`` (values are not restored); ``resolve`` maps
        a recorded name to the module it names."""
        raise NotImplementedError

    @classmethod
    def spec_references(cls, spec: Mapping[str, Any]) -> tuple[str, ...]:
        """Names of the modules a layer built from ``spec`` refers to (built first when loading)."""
        return ()

    def references(self) -> tuple[nn.Module, ...]:
        """The modules this layer refers to (restored or removed before it)."""
        return ()

    @classmethod
    def converts(cls, module: nn.Module) -> bool:
        """Whether :meth:`from_dense` accepts ``module``."""
        return cls.dense_type is not None and isinstance(module, cls.dense_type)

    @classmethod
    def from_dense(cls, module: nn.Module, *, init: str = "tt_svd", **options: Any) -> nn.Module:
        """The layer standing for ``module`` (sizes, bias, padding row, bag mode taken from it; ``options``
        are constructor keywords such as shapes and ranks)."""
        raise TypeError(f"a {cls.__name__} is not built from a dense module")

    def to_dense_module(self, dense_of: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Module:
        """The dense module with this layer's function and every attribute the dense type has; ``dense_of``
        maps a module the layer refers to onto its restored dense module, so ties survive."""
        raise NotImplementedError

    def pruned_stand_in(self) -> nn.Module:
        """The stand-in replacing this layer when a bond is dead (itself for a stand-in)."""
        return self

    def dense_attributes(self) -> dict[str, Any]:
        """The attributes a dense module must have for this layer to stand for it (``bias``: present)."""
        raise NotImplementedError

    def dense_mismatch(self, module: nn.Module) -> str | None:
        """None if ``module`` is a dense module this layer can stand for, or a layer standing for the same
        dense module (e.g. a ``TTLinear`` where a pruned ``RemovedLinear`` is recorded); else what differs."""
        expected = self.dense_attributes()
        wanted = self.dense_type.__name__ if self.dense_type is not None else type(self).__name__
        if isinstance(module, ComeraLayer) and module.dense_type is self.dense_type:
            found = module.dense_attributes()
        elif self.dense_type is not None and isinstance(module, self.dense_type):
            found = {key: _dense_attribute(module, key) for key in expected}
        else:
            found_type = type(module).__name__
            return f"expected {wanted} with {expected} (or a layer standing for it), found {found_type}"
        if found != expected:
            return f"expected {wanted} attributes {expected}, found {found}"
        return None

    def weight_parameters(self) -> list[nn.Parameter]:
        """The parameters :meth:`num_parameters` counts (cores and gates for a train, none for a stand-in)."""
        return []

    @property
    def mode_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Mode tuples for reports: ``(in_shape, out_shape)``, ``(row_shape, col_shape)`` or sizes."""
        raise NotImplementedError


def _dense_attribute(module: nn.Module, key: str) -> Any:
    if key == "bias":
        return getattr(module, "bias", None) is not None
    return getattr(module, key, None)


def register_layer(cls: type[ComeraLayer]) -> type[ComeraLayer]:
    """Class decorator adding ``cls`` to the registry under ``cls.kind`` (default: the class name)."""
    if "kind" not in cls.__dict__:
        cls.kind = cls.__name__
    if cls.kind in _LAYER_TYPES and _LAYER_TYPES[cls.kind] is not cls:
        raise ValueError(f"layer kind {cls.kind!r} is already registered by {_LAYER_TYPES[cls.kind]}")
    _LAYER_TYPES[cls.kind] = cls
    return cls


def layer_kinds() -> tuple[str, ...]:
    """The registered kinds, sorted."""
    return tuple(sorted(_LAYER_TYPES))


def layer_type(kind: object) -> type[ComeraLayer]:
    """The layer class registered under ``kind``; ``ValueError`` naming the known kinds otherwise."""
    if not isinstance(kind, str) or kind not in _LAYER_TYPES:
        raise ValueError(f"unknown layer kind {kind!r}; known kinds: {list(layer_kinds())}")
    return _LAYER_TYPES[kind]


def is_layer(module: object) -> bool:
    """Whether ``module`` follows the layer protocol."""
    return isinstance(module, ComeraLayer)


def layer_for_dense(module: nn.Module, layer_format: str) -> type[ComeraLayer] | None:
    """The layer type converting ``module``: the one of ``layer_format`` (``"tt"``, ``"ttm"``) if several
    convert it; None if none."""
    candidates = [cls for cls in _LAYER_TYPES.values() if cls.converts(module)]
    if len(candidates) > 1:
        candidates = [cls for cls in candidates if cls.format == layer_format]
    return candidates[0] if len(candidates) == 1 else None
