"""``TensorizeConfig``: which modules of a model :func:`comera.tensorize_` converts (PEFT's target grammar),
and how; and the registry of named presets (:func:`register_preset`, :func:`tensorize_preset`), the
built-in workloads' registered on first use. Details: docs/guide.md, 'Conversion rules' and 'Named
tensorization presets'.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from comera.checks import check_int
from comera.nn.gated import DEFAULT_RANK, DEFAULT_TAU, check_tau
from comera.tt.shapes import factorize, suggest_padding

__all__ = [
    "TensorizeConfig",
    "ALL_LINEAR",
    "FORMATS",
    "INITS",
    "SHAPE_KEYS",
    "pattern_matches",
    "first_matching_key",
    "selector_matches",
    "register_preset",
    "tensorize_preset",
    "fitted_preset",
    "fold_modes",
    "preset_names",
]

ALL_LINEAR = "all-linear"
FORMATS = ("tt", "ttm")
INITS = ("random", "tt_svd")
SHAPE_KEYS = ("in_shape", "out_shape", "row_shape", "col_shape")


def _as_selector(value: object, name: str, allow_none: bool) -> str | tuple[str, ...] | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        if value != ALL_LINEAR:
            _compile(value, name)
        return value
    if isinstance(value, Sequence) and value and all(isinstance(entry, str) and entry for entry in value):
        return tuple(value)
    expected = "a regex string, 'all-linear', or a non-empty list of module names"
    raise ValueError(f"{name} must be {expected}{' or None' if allow_none else ''}, got {value!r}")


def _compile(pattern: str, name: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{name}: {pattern!r} is not a valid regular expression ({error})") from None


def _as_rank(value: object, name: str) -> int | tuple[int, ...]:
    if not isinstance(value, bool) and isinstance(value, int) and value >= 1:
        return value
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and value
        and all(not isinstance(r, bool) and isinstance(r, int) and r >= 1 for r in value)
    ):
        return tuple(value)
    raise ValueError(
        f"{name} must be an int >= 1 or a non-empty list of ints >= 1 (one per bond), got {value!r}"
    )


def _as_shape(value: object, name: str) -> tuple[int, ...]:
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and value
        and all(not isinstance(m, bool) and isinstance(m, int) and m >= 1 for m in value)
    ):
        return tuple(value)
    raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {value!r}")


@dataclass(frozen=True)
class TensorizeConfig:
    """What :func:`comera.tensorize_` converts and how (frozen; JSON via ``to_dict`` / ``from_dict``).

    Attributes:
        target_modules: linears (or embeddings) to convert: regex fullmatch, list of names / dotted suffixes,
            or ``"all-linear"``.
        exclude_modules: modules never converted, same grammar (no ``"all-linear"``); None for none.
        format: ``"tt"`` or ``"ttm"`` for linear layers (embeddings are always TTM).
        rank: max rank per bond for every converted layer (int or one int per bond).
        rank_pattern: ``{key: rank}`` overriding ``rank`` for matching modules.
        shape_pattern: ``{key: {"in_shape": [...], "out_shape": [...]}}`` for linears, ``row_shape`` /
            ``col_shape`` for embeddings; unspecified shapes are chosen automatically.
        embeddings: also convert ``nn.Embedding`` / ``nn.EmbeddingBag`` modules: True for all, False for
            none, or a target (regex / list) selecting which.
        init: ``"random"`` (fresh Gaussian cores, the paper's from-scratch setting; biases are kept) or
            ``"tt_svd"`` (truncated TT-SVD of the current weights). Random cores are scaled to the standard
            deviation of the weights they replace.
        tau: gate threshold of the new layers.
        tie_output_head: keep a linear head that shares its weight with a converted embedding tied to it (a
            ``TTMTiedHead``); when False such a head stays dense and becomes untied.

    Examples:
        >>> from torch import nn
        >>> import comera
        >>> config = comera.TensorizeConfig(target_modules=("0",), format="ttm", rank=8)
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        >>> _ = comera.tensorize_(model, config)
        >>> type(model[0]).__name__, model[0].max_ranks
        ('TTMLinear', (8,))
    """

    target_modules: str | tuple[str, ...] = ALL_LINEAR
    exclude_modules: str | tuple[str, ...] | None = None
    format: str = "tt"
    rank: int | tuple[int, ...] = DEFAULT_RANK
    rank_pattern: Mapping[str, int | tuple[int, ...]] = field(default_factory=dict)
    shape_pattern: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)
    embeddings: bool | str | tuple[str, ...] = False
    init: str = "random"
    tau: float = DEFAULT_TAU
    tie_output_head: bool = True

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("target_modules", _as_selector(self.target_modules, "target_modules", allow_none=False))
        put("exclude_modules", _as_selector(self.exclude_modules, "exclude_modules", allow_none=True))
        if self.exclude_modules == ALL_LINEAR:
            raise ValueError("exclude_modules cannot be 'all-linear'")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        put("rank", _as_rank(self.rank, "rank"))
        if not isinstance(self.rank_pattern, Mapping):
            raise ValueError(f"rank_pattern must be a mapping {{pattern: rank}}, got {self.rank_pattern!r}")
        ranks = {}
        for key, rank in self.rank_pattern.items():
            _compile(key, "rank_pattern")
            ranks[key] = _as_rank(rank, f"rank_pattern[{key!r}]")
        put("rank_pattern", ranks)
        if not isinstance(self.shape_pattern, Mapping):
            raise ValueError(
                f"shape_pattern must be a mapping {{pattern: {{key: modes}}}}, got {self.shape_pattern!r}"
            )
        shapes = {}
        for key, spec in self.shape_pattern.items():
            _compile(key, "shape_pattern")
            if not isinstance(spec, Mapping) or not spec or not set(spec) <= set(SHAPE_KEYS):
                raise ValueError(
                    f"shape_pattern[{key!r}] must be a mapping with keys among {SHAPE_KEYS}, got {spec!r}"
                )
            shapes[key] = {k: _as_shape(v, f"shape_pattern[{key!r}][{k!r}]") for k, v in spec.items()}
        put("shape_pattern", shapes)
        if not isinstance(self.embeddings, bool):
            put("embeddings", _as_selector(self.embeddings, "embeddings", allow_none=False))
            if self.embeddings == ALL_LINEAR:
                raise ValueError("embeddings must be a bool, a regex or a list of names, not 'all-linear'")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        put("tau", check_tau(self.tau))
        if not isinstance(self.tie_output_head, bool):
            raise ValueError(f"tie_output_head must be a bool, got {self.tie_output_head!r}")

    def with_overrides(self, **overrides: Any) -> TensorizeConfig:
        """A copy with some fields replaced; unknown names raise ``ValueError`` listing the valid ones."""
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise ValueError(f"unknown TensorizeConfig field(s) {unknown}; valid fields are {valid}")
        return dataclasses.replace(self, **overrides)

    def rank_for(self, name: str) -> int | tuple[int, ...]:
        """The rank of module ``name``: the first matching ``rank_pattern`` entry, else ``rank``."""
        key = first_matching_key(self.rank_pattern, name)
        return self.rank if key is None else self.rank_pattern[key]

    def shapes_for(self, name: str) -> Mapping[str, tuple[int, ...]]:
        """The explicit shapes of module ``name`` from ``shape_pattern`` (empty when none matches)."""
        key = first_matching_key(self.shape_pattern, name)
        return {} if key is None else self.shape_pattern[key]

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible fields (tuples become lists)."""

        def plain(value: Any) -> Any:
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            if isinstance(value, Mapping):
                return {k: plain(v) for k, v in value.items()}
            return value

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorizeConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a TensorizeConfig must be read from a mapping, got {type(data).__name__}")
        return cls().with_overrides(**dict(data))


def pattern_matches(key: str, name: str) -> bool:
    """Whether pattern ``key`` matches module ``name`` in full or as a dotted suffix."""
    return re.fullmatch(key, name) is not None or re.fullmatch(rf"(?:.*\.)?(?:{key})", name) is not None


def first_matching_key(patterns: Mapping[str, Any], name: str) -> str | None:
    """The first key of ``patterns`` that matches ``name``, or None."""
    return next((key for key in patterns if pattern_matches(key, name)), None)


def selector_matches(selector: str | tuple[str, ...], name: str) -> bool:
    """Whether a target selector (regex string, or list of names / dotted suffixes) selects ``name``."""
    if isinstance(selector, str):
        return re.fullmatch(selector, name) is not None
    return any(name == entry or name.endswith("." + entry) for entry in selector)


_PRESETS: dict[str, TensorizeConfig] = {}
_FITS: dict[str, Callable[[TensorizeConfig, Mapping[str, Any]], TensorizeConfig]] = {}
_BUILTIN_PRESET_MODULES = (
    "comera.workloads.nli.presets",
    "comera.workloads.mlm.presets",
    "comera.workloads.dlrm.presets",
    "comera.workloads.llm.presets",
)
"""Modules whose import registers the built-in workloads' presets (imported on first use)."""


def _register_builtin_presets() -> None:
    for module in _BUILTIN_PRESET_MODULES:
        importlib.import_module(module)


def register_preset(
    name: str,
    config: TensorizeConfig,
    *,
    replace: bool = False,
    fit: Callable[[TensorizeConfig, Mapping[str, Any]], TensorizeConfig] | None = None,
) -> TensorizeConfig:
    """Register ``config`` under ``name`` for :func:`tensorize_preset` and the CLI's ``tensorize.preset``;
    ``fit(config, model_settings)``, optional, adapts it to a model of other sizes (or raises
    ``ValueError`` naming the setting). Returns ``config``.

    Raises:
        ValueError: ``name`` is registered already and ``replace`` is False.

    Examples:
        >>> from torch import nn
        >>> import comera
        >>> config = comera.TensorizeConfig(format="ttm", rank=8)
        >>> _ = comera.register_preset("mlp-ttm-8", config, replace=True)
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        >>> _ = comera.tensorize_(model, comera.tensorize_preset("mlp-ttm-8", target_modules=("0",)))
        >>> type(model[0]).__name__
        'TTMLinear'
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"preset name must be a non-empty str, got {name!r}")
    if not isinstance(config, TensorizeConfig):
        raise TypeError(f"config must be a TensorizeConfig, got {type(config).__name__}")
    if name in _PRESETS and not replace and _PRESETS[name] != config:
        raise ValueError(f"a tensorization preset named {name!r} is already registered")
    _PRESETS[name] = config
    if fit is None:
        _FITS.pop(name, None)
    else:
        _FITS[name] = fit
    return config


def fold_modes(size: int, num_modes: int, setting: str) -> tuple[int, ...]:
    """The balanced folding of ``size`` into ``num_modes`` ascending modes of at least 2
    (:func:`comera.tt.shapes.factorize`), for a preset's ``fit``; ``ValueError`` naming ``setting`` when
    ``size`` has fewer than ``num_modes`` prime factors (no folding without a mode of 1)."""
    modes = factorize(check_int(size, setting, 1), num_modes)
    if min(modes) < 2:
        raise ValueError(
            f"{setting} {size} cannot be folded into {num_modes} modes of at least 2 (it has fewer than "
            f"{num_modes} prime factors); choose a size with at least {num_modes} prime factors, e.g. "
            f"{suggest_padding(size, num_modes)}, or give tensorize.shape_pattern"
        )
    return modes


def fitted_preset(name: str, model_settings: Mapping[str, Any], **overrides: Any) -> TensorizeConfig:
    """The registered preset ``name`` fitted to ``model_settings`` (by the ``fit`` it was registered with;
    unchanged without one), then with ``overrides`` applied (:meth:`TensorizeConfig.with_overrides`)."""
    config = tensorize_preset(name)
    fit = _FITS.get(name)
    if fit is not None:
        config = fit(config, model_settings)
    return config.with_overrides(**overrides) if overrides else config


def preset_names() -> tuple[str, ...]:
    """Names of the registered tensorization presets (the built-in workloads' included), sorted."""
    _register_builtin_presets()
    return tuple(sorted(_PRESETS))


def tensorize_preset(name: str, **overrides: Any) -> TensorizeConfig:
    """The registered preset ``name`` with ``overrides`` applied (:meth:`TensorizeConfig.with_overrides`); a
    built-in workload's preset is registered on first use.

    Raises:
        ValueError: ``name`` is unknown (naming the registered presets).

    Examples:
        >>> import comera
        >>> config = comera.tensorize_preset("nli-small", rank=8)  # a workload's preset, rank changed
        >>> config.format, config.rank
        ('tt', 8)
    """
    if name not in _PRESETS:
        _register_builtin_presets()
    if name not in _PRESETS:
        raise ValueError(f"unknown tensorization preset {name!r}; registered presets: {list(preset_names())}")
    config = _PRESETS[name]
    return config.with_overrides(**overrides) if overrides else config
