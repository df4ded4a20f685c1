"""In-place conversion of a model's dense layers (``nn.Linear``, ``transformers``' ``Conv1D``, and with
``embeddings`` ``nn.Embedding`` / ``nn.EmbeddingBag``) to gated tensor-train layers and back, the whole
plan validated first, and the materialisation of a model built on the meta device. Details: docs/guide.md,
'Converting a model and learning its ranks' and 'Conversion rules'.
"""

from __future__ import annotations

import difflib
import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from comera.modules import names_of, replace_module, unwrap_model
from comera.nn.conv1d import is_conv1d
from comera.nn.gated import GatedTrain
from comera.nn.layer import ComeraLayer, is_layer, layer_for_dense
from comera.nn.tied_head import TTMTiedHead
from comera.tensorize_config import ALL_LINEAR, TensorizeConfig, pattern_matches, selector_matches
from comera.weight_reads import disable_weight_fast_paths, read_by_attribute

__all__ = [
    "TensorizeError",
    "TensorizeWarning",
    "tensorize_",
    "untensorize_",
    "materialize_",
    "meta_init_std",
    "hf_init_weights",
    "guard_embedding_resize",
    "tensorize_configs",
    "CONFIG_ATTRIBUTE",
]

CONFIG_ATTRIBUTE = "comera_tensorize_configs"


class TensorizeError(ValueError):
    """A :class:`comera.TensorizeConfig` that does not fit the model :func:`tensorize_` is given: a target,
    exclusion or pattern key matches no module, a rank or shape does not fit a module, a selected module
    cannot be converted (shared weights, read by its parent as an attribute), or nothing is selected. The
    message names the config field or the module; the model is unchanged. A ``ValueError``, so code that
    catches those still catches it.

    Examples:
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(64, 64))
        >>> try:
        ...     comera.tensorize_(model, target_modules=["encoder"])
        ... except comera.TensorizeError as error:
        ...     print("refused:", error)  # doctest: +ELLIPSIS
        refused: target_modules entry 'encoder' matched no nn.Linear, ...
        >>> type(model[0]).__name__  # unchanged
        'Linear'
    """


class TensorizeWarning(UserWarning):
    """:func:`tensorize_` with the default selection (``target_modules="all-linear"``) left dense a part of
    the model that a reader would expect converted: linears whose parent reads their weight directly, or
    parameters of three or more dimensions that are not a convolution's (a mixture of experts' stacked
    expert weights). The message names them; the conversion itself went ahead.

    Examples:
        >>> import warnings
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> class Experts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.router = nn.Linear(64, 64)
        ...         self.experts = nn.Parameter(torch.randn(4, 64, 64))  # stacked expert weights
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = comera.tensorize_(Experts(), rank=8)
        >>> [warning.category.__name__ for warning in caught]
        ['TensorizeWarning']
    """


_CONV1D_STD = 0.02
_NAMED_AT_MOST = 4


def tensorize_configs(model: nn.Module) -> tuple[TensorizeConfig, ...]:
    """The configs :func:`tensorize_` applied to ``model``, oldest first (empty if none)."""
    return tuple(getattr(unwrap_model(model), CONFIG_ATTRIBUTE, ()))


def _distributed_wrapper(model: nn.Module) -> str | None:
    """The name of a ``DistributedDataParallel`` or FSDP wrapper in ``model``'s tree (itself included), or
    None. FSDP's classes are looked up only when ``torch.distributed.fsdp`` is imported: no module can be
    sharded before, and importing it here would slow down every ``tensorize_`` call."""
    kinds: list[type] = [DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        kinds += [fsdp.FSDPModule, fsdp.FullyShardedDataParallel]
    for module in model.modules():
        if isinstance(module, tuple(kinds)):
            return "DistributedDataParallel" if isinstance(module, DistributedDataParallel) else "FSDP"
    return None


def _refuse_distributed_wrapper(model: nn.Module, call: str) -> None:
    """``TypeError`` naming the wrapper when ``model`` is wrapped in DDP or sharded by FSDP."""
    wrapper = _distributed_wrapper(model)
    if wrapper is not None:
        raise TypeError(
            f"{call} cannot convert a model wrapped in {wrapper}: the wrapper keeps the parameters it was "
            f"built on, which the conversion replaces; call comera.{call} on the plain model before wrapping "
            "it (DistributedDataParallel, fully_shard), then wrap the converted model"
        )


def _close_names(entry: str, names: Iterable[str], limit: int = 6) -> list[str]:
    """Module names resembling ``entry``: by full name, by last component, or containing it."""
    names = sorted(set(names))
    by_short: dict[str, list[str]] = {}
    for name in names:
        by_short.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    close = difflib.get_close_matches(entry, names, n=limit, cutoff=0.6)
    for short in difflib.get_close_matches(entry, list(by_short), n=3, cutoff=0.6):
        close += by_short[short]
    close += [name for name in names if entry in name]
    return list(dict.fromkeys(close))[:limit]


def _already_tensorized(names: Iterable[str], modules: dict[str, nn.Module]) -> list[str]:
    """``'name' (LayerType)`` for each of ``names`` that is already a comera layer."""
    return [f"{name!r} ({type(modules[name]).__name__})" for name in names if is_layer(modules[name])]


def _select(
    selector: str | tuple[str, ...],
    candidates: dict[str, nn.Module],
    modules: dict[str, nn.Module],
    field: str,
) -> list[str]:
    """Names of ``candidates`` chosen by ``selector``; raise when a regex or any list entry matches none."""
    entries = [selector] if isinstance(selector, str) else list(selector)
    chosen: list[str] = []
    for entry in entries:
        single = entry if isinstance(selector, str) else (entry,)
        hits = [name for name in candidates if selector_matches(single, name)]
        if not hits:
            elsewhere = [name for name in modules if selector_matches(single, name)]
            done = _already_tensorized(elsewhere, modules)
            close = _close_names(entry, candidates) or _close_names(entry, modules)
            hint = (
                f"it matches only modules that are already tensorized: {', '.join(done[:5])}"
                if elsewhere and len(done) == len(elsewhere)
                else f"it matches only modules of unsupported types: {elsewhere[:5]}"
                if elsewhere
                else f"close names: {close}"
                if close
                else f"no module has a close name; some of the model's: {sorted(candidates)[:6]}"
            )
            raise TensorizeError(
                f"{field} entry {entry!r} matched no nn.Linear, transformers Conv1D, nn.Embedding or "
                f"nn.EmbeddingBag; {hint}"
            )
        chosen.extend(hits)
    return list(dict.fromkeys(chosen))


def _output_heads(
    root: nn.Module, linears: dict[str, nn.Module], embeddings: dict[str, nn.Module]
) -> set[str]:
    """Linears that are output heads: tied to an embedding, or the model's ``get_output_embeddings()``."""
    tables = {id(module.weight) for module in embeddings.values()}
    heads = {name for name, module in linears.items() if id(module.weight) in tables}
    getter = getattr(root, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    heads |= {name for name, module in linears.items() if module is head}
    return heads


def _why_none(config: TensorizeConfig, linears: dict[str, nn.Module], modules: dict[str, nn.Module]) -> str:
    """Why the selection is empty: no convertible linear at all (naming the types of the modules that hold
    a matrix weight), or every target excluded."""
    done = _already_tensorized(modules, modules)
    already = (
        f"the model is already tensorized ({len(done)} comera layers, e.g. {', '.join(done[:3])})"
        if done
        else ""
    )
    if config.target_modules != ALL_LINEAR or linears:
        reason = "every target is excluded, an output head, or read by its parent as an attribute"
        return f"{reason}; {already}" if already else reason
    if already:
        return f'target_modules="{ALL_LINEAR}" found no nn.Linear or transformers Conv1D left: {already}'
    unsupported = sorted(
        {
            type(module).__name__
            for module in modules.values()
            if layer_for_dense(module, config.format) is None
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 2  # type: ignore[operator]  # nn.Module.__getattr__
        }
    )
    return (
        f'target_modules="{ALL_LINEAR}" found no nn.Linear or transformers Conv1D; modules with a matrix '
        f"weight are of the unsupported types {unsupported}"
    )


def _check_not_read(picked: dict[int, str], read: dict[int, str], modules: dict[str, nn.Module]) -> None:
    """Refuse a selected module that its parent reads by attribute (``read``: ``{id(module): why}``)."""
    for name in picked.values():
        why = read.get(id(modules[name]))
        if why is not None:
            raise TensorizeError(
                f"module {name!r} cannot be tensorized: {why}; leave it out of the targets (or add it to "
                "exclude_modules)"
            )


def _warn_left_dense(
    root: nn.Module,
    candidates: list[str],
    read: dict[int, str],
    excluded: set[str],
    modules: dict[str, nn.Module],
) -> None:
    """Warn (:class:`TensorizeWarning`) about what ``"all-linear"`` leaves dense without being told to: the
    linears among ``candidates`` (the non-head linears) that their parent reads by attribute (``read``) and
    ``exclude_modules`` does not name, and the parameters of three or more dimensions outside convolutions
    and outside the comera layers an earlier call made (their cores)."""
    unread = [name for name in candidates if id(modules[name]) in read and name not in excluded]
    if unread:
        reasons = sorted({read[id(modules[name])] for name in unread})
        warnings.warn(
            f"tensorize_: {len(unread)} linear(s) stay dense because their parent reads their weight "
            f"directly ({_some(unread)}): {'; '.join(reasons[:2])}; add them to exclude_modules to say that "
            "this is meant",
            TensorizeWarning,
            stacklevel=3,
        )
    converted = {id(p) for module in root.modules() if is_layer(module) for p in module.parameters()}
    stacked = [
        (f"{name}.{key}" if name else key, parameter)
        for name, module in root.named_modules()
        if not isinstance(module, nn.modules.conv._ConvNd)
        for key, parameter in module.named_parameters(recurse=False)
        if parameter.dim() >= 3 and id(parameter) not in converted
    ]
    if stacked:
        share = sum(p.numel() for _, p in stacked) / max(sum(p.numel() for p in root.parameters()), 1)
        shapes = [f"{name} {list(parameter.shape)}" for name, parameter in stacked]
        warnings.warn(
            f"tensorize_: {len(stacked)} parameter(s) of three or more dimensions stay dense, "
            f"{share:.0%} of the model's parameters ({_some(shapes)}): only linears and embeddings are "
            "converted (stacked expert weights of a mixture of experts are neither)",
            TensorizeWarning,
            stacklevel=3,
        )


def _some(names: list[str]) -> str:
    """The first :data:`_NAMED_AT_MOST` of ``names``, and how many more there are."""
    shown = ", ".join(repr(name) for name in names[:_NAMED_AT_MOST])
    more = len(names) - _NAMED_AT_MOST
    return shown + (f" and {more} more" if more > 0 else "")


def _check_patterns_used(config: TensorizeConfig, names: list[str]) -> None:
    for field, patterns in (("rank_pattern", config.rank_pattern), ("shape_pattern", config.shape_pattern)):
        for key in patterns:
            if not any(pattern_matches(key, name) for name in names):
                close = _close_names(key, names)
                raise TensorizeError(
                    f"{field} key {key!r} matches no module being tensorized; "
                    + (f"close names: {close}" if close else f"they are: {sorted(names)[:6]}")
                )


def _shapes_for(name: str, config: TensorizeConfig, layer: type[ComeraLayer]) -> dict:
    """The ``shape_pattern`` entries for module ``name``; raises if they set keys the layer does not take."""
    shapes = dict(config.shapes_for(name))
    wrong = set(shapes) - set(layer.shape_options)
    if wrong:
        allowed = "/".join(layer.shape_options)
        raise TensorizeError(f"shape_pattern for {layer.role} {name!r} may only set {allowed}, got {wrong}")
    return shapes


def _build(name: str, module: nn.Module, layer: type[ComeraLayer], config: TensorizeConfig) -> nn.Module:
    try:
        shapes = _shapes_for(name, config, layer)
        return layer.from_dense(
            module, init=config.init, rank=config.rank_for(name), tau=config.tau, **shapes
        )
    except ValueError as error:
        raise TensorizeError(f"module {name!r}: {error}") from None


def _hf_initializer_range(root: nn.Module) -> float | None:
    """``root.config.initializer_range`` for a Hugging Face model that initialises through
    ``_init_weights``; None otherwise."""
    value = getattr(getattr(root, "config", None), "initializer_range", None)
    hf_init = callable(getattr(root, "_init_weights", None))
    if not hf_init or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return float(value)


def meta_init_std(model: nn.Module, module: nn.Module) -> float:
    """The standard deviation the initialisation of ``model`` gives the weight of its dense ``module``:
    ``config.initializer_range`` in a Hugging Face model, else the layer's PyTorch default (``1/sqrt(3 *
    in_features)`` for ``nn.Linear``, 0.02 for ``Conv1D``, 1 for embeddings).
    """
    hf_range = _hf_initializer_range(unwrap_model(model))
    if hf_range is not None:
        return hf_range
    if isinstance(module, nn.Linear):
        return 1.0 / math.sqrt(3 * module.in_features)
    if is_conv1d(module):
        return _CONV1D_STD
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return 1.0
    raise TypeError(f"no default initialisation known for {type(module).__name__}")


def _is_meta(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.is_meta


def _check_meta_init(config: TensorizeConfig, names: list[str], modules: dict[str, nn.Module]) -> None:
    meta = [name for name in names if _is_meta(modules[name])]
    if meta and config.init == "tt_svd":
        raise TensorizeError(
            f"init='tt_svd' decomposes the dense weights, but module {meta[0]!r} is on the meta device "
            "(built under torch.device('meta') or init_empty_weights): there is nothing to decompose; use "
            "init='random', whose cores follow the model's own initialisation scale"
        )


def _build_for_real(
    root: nn.Module, built: nn.Module, module: nn.Module, device: torch.device | str
) -> nn.Module:
    """The layer ``built`` (from the meta ``module``) rebuilt on ``device`` from its spec, with its cores
    scaled to :func:`meta_init_std` and, in a Hugging Face model, a zero bias (as ``_init_weights`` sets)."""
    layer = type(built).from_spec(built.spec(), device=device, dtype=module.weight.dtype)  # type: ignore[attr-defined,operator]  # built is a comera layer
    if isinstance(layer, GatedTrain):
        layer.scale_to_std_(meta_init_std(root, module))
    bias = getattr(layer, "bias", None)
    if isinstance(bias, torch.Tensor) and _hf_initializer_range(root) is not None:
        with torch.no_grad():
            bias.zero_()
    return layer.train(module.training)


def _role(module: nn.Module, layer_format: str = "tt") -> str | None:
    """``"linear"`` or ``"embedding"``: the selection a dense module belongs to (None: not convertible)."""
    layer = layer_for_dense(module, layer_format)
    return None if layer is None else layer.role


def _resolve_shared(
    chosen: list[str], excluded: set[str], modules: dict[str, nn.Module], all_names: dict[int, list[str]]
) -> dict[int, str]:
    """The modules to convert, ``{id(module): the first chosen name}``; a module reachable under several
    names is converted once, under all of them, and may not be both chosen and excluded."""
    picked: dict[int, str] = {}
    for name in chosen:
        module = modules[name]
        names = all_names[id(module)]
        blocked = [other for other in names if other in excluded]
        if name in excluded:
            continue
        if blocked:
            raise TensorizeError(
                f"module {name!r} is the same module as {blocked[0]!r}, which exclude_modules excludes; a "
                "shared module is converted under every name or none: exclude or select all of "
                f"{names}"
            )
        picked.setdefault(id(module), name)
    return picked


def _check_shared_weights(
    root: nn.Module, picked: dict[int, str], tied: dict[int, str], modules: dict[str, nn.Module], tie: bool
) -> None:
    """Refuse a converted module whose weight ``Parameter`` another module also holds (the rule in
    :func:`tensorize_`)."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in root.named_modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append((name, module))
    for name in picked.values():
        module = modules[name]
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        is_table = _role(module) == "embedding"
        for other_name, other in holders[id(weight)]:
            if other is module or id(other) in tied:
                continue
            keeps_dense_head = is_table and not tie and id(other) not in picked and _role(other) == "linear"
            if not keeps_dense_head:
                raise TensorizeError(
                    f"module {name!r} shares its weight Parameter with {other_name!r}; a TT layer cannot "
                    "share a weight with another module: share the module itself (model.b = model.a) so it "
                    "becomes one layer under both names, tie a linear head to a converted embedding "
                    "(tie_output_head=True), or exclude one of them"
                )


def tensorize_(
    model: nn.Module,
    config: TensorizeConfig | None = None,
    *,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Convert the modules of ``model`` selected by ``config`` into gated TT/TTM layers, in place: a module
    under several names becomes one layer under all of them, a linear sharing a converted embedding's table
    a :class:`TTMTiedHead`, and a module on the meta device gets random cores on ``device`` at the std of
    the model's own initialisation (the rest stays on meta: call :func:`materialize_` next). The sharing
    rules are in docs/guide.md, 'Conversion rules'.

    Args:
        model: any ``nn.Module`` (a ``torch.compile`` wrapper is looked through; not one wrapped in DDP or
            sharded by FSDP).
        config: a :class:`TensorizeConfig`; None for the defaults.
        device: where the layers replacing meta-device modules are created (None: CPU); modules with real
            weights keep their own device.
        **overrides: fields replacing those of ``config`` (e.g. ``rank=8, format="ttm"``).

    Returns:
        ``model`` itself, converted.

    Raises:
        TensorizeError: a target, exclusion or pattern key matches nothing (with close names), a setting
            does not fit a module (naming it), a sharing rule is broken, a target is read by attribute
            (naming it and its parent), no module is selected, or ``init="tt_svd"`` meets a module on the
            meta device; the model is unchanged.
        ValueError: ``device`` is the meta device.
        TypeError: ``model`` is (or holds) a ``DistributedDataParallel`` or FSDP wrapper; tensorize the plain
            model, then wrap it.

    Examples:
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 4))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=12, init="tt_svd")  # in place
        >>> [type(module).__name__ for module in model]
        ['TTLinear', 'GELU', 'Linear']
    """
    if config is None:
        config = TensorizeConfig()
    if not isinstance(config, TensorizeConfig):
        raise TypeError(f"config must be a TensorizeConfig or None, got {type(config).__name__}")
    if overrides:
        config = config.with_overrides(**overrides)
    target_device = torch.device("cpu" if device is None else device)
    if target_device.type == "meta":
        raise ValueError("device must be a device with storage (e.g. 'cpu', 'cuda'), got 'meta'")
    root = unwrap_model(model)
    _refuse_distributed_wrapper(model, "tensorize_")
    modules = {name: module for name, module in root.named_modules(remove_duplicate=False) if name}
    all_names = names_of(root)
    layer_types = {name: layer_for_dense(module, config.format) for name, module in modules.items()}
    linears = {name: m for name, m in modules.items() if getattr(layer_types[name], "role", None) == "linear"}
    tables = {
        name: m for name, m in modules.items() if getattr(layer_types[name], "role", None) == "embedding"
    }
    heads = _output_heads(root, linears, tables)
    read = {id(modules[name]): why for name, why in read_by_attribute(root).items()}
    if config.target_modules == ALL_LINEAR:
        chosen = [name for name in linears if name not in heads and id(linears[name]) not in read]
    else:
        chosen = _select(config.target_modules, {**linears, **tables}, modules, "target_modules")
    if config.embeddings is True:
        chosen += [name for name in tables if id(tables[name]) not in read]
    elif config.embeddings:
        chosen += _select(config.embeddings, tables, modules, "embeddings")
    excluded: set[str] = set()
    if config.exclude_modules is not None:
        excluded = set(_select(config.exclude_modules, {**linears, **tables}, modules, "exclude_modules"))
    picked = _resolve_shared(list(dict.fromkeys(chosen)), excluded, modules, all_names)
    if not picked:
        raise TensorizeError(
            f"the config selects no module to tensorize: {_why_none(config, linears, modules)}"
        )
    _check_not_read(picked, read, modules)
    if config.target_modules == ALL_LINEAR:
        _warn_left_dense(root, [name for name in linears if name not in heads], read, excluded, modules)
    tied: dict[int, str] = {}
    if config.tie_output_head:
        picked_tables = {id(modules[name].weight): name for name in picked.values() if name in tables}
        tied = {
            id(linear): picked_tables[id(linear.weight)]
            for linear in {id(m): m for m in linears.values()}.values()
            if id(linear.weight) in picked_tables
        }
        picked = {key: name for key, name in picked.items() if key not in tied}
    _check_shared_weights(root, picked, tied, modules, config.tie_output_head)
    _check_patterns_used(config, [name for key in picked for name in all_names[key]])
    _check_meta_init(config, list(picked.values()), modules)

    replacements: dict[int, tuple[nn.Module, nn.Module]] = {}
    for name in picked.values():
        module = modules[name]
        built = _build(name, module, layer_for_dense(module, config.format), config)  # type: ignore[arg-type]  # picked only convertible modules
        if _is_meta(module):
            built = _build_for_real(root, built, module, target_device)
        replacements[id(module)] = (module, built)
    for key, table_name in tied.items():
        linear = next(m for m in linears.values() if id(m) == key)
        table = replacements[id(modules[table_name])][1]
        if _is_meta(linear):
            head = TTMTiedHead(table, bias=linear.bias is not None).train(linear.training)  # type: ignore[arg-type]  # table is a TTM table
        else:
            head = TTMTiedHead.from_dense(linear, embedding=table)  # type: ignore[arg-type]  # table is a TTM table
        replacements[key] = (linear, head)
    for old, new in replacements.values():
        replace_module(root, old, new)
    disable_weight_fast_paths(root)
    guard_embedding_resize(root)
    setattr(root, CONFIG_ATTRIBUTE, (*tensorize_configs(root), config))
    return model


_RESIZE = "resize_token_embeddings"


def _refuse_resize(layers: str, *args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError(
        f"resize_token_embeddings cannot resize a tensorized model: its {layers} hold tensor-train cores, "
        "not a weight matrix to grow; resize before comera.tensorize_, or call comera.untensorize_(model), "
        "resize, and tensorize again"
    )


def guard_embedding_resize(model: nn.Module) -> None:
    """Make a ``transformers`` model's ``resize_token_embeddings`` raise ``NotImplementedError`` naming the
    call and what to do while its input or output embeddings are comera layers (it would fail deep inside on
    their missing ``weight``), and give it back its own method when they are dense again. Other models are
    left as they are. :func:`tensorize_`, :func:`untensorize_` and :func:`comera.load_pretrained` call it."""
    root = unwrap_model(model)
    if not callable(getattr(type(root), _RESIZE, None)):
        return
    tensorized = []
    for kind in ("input", "output"):
        try:
            module = getattr(root, f"get_{kind}_embeddings")()
        except (AttributeError, NotImplementedError):
            continue
        if module is not None and is_layer(module):
            tensorized.append(f"{kind} embeddings ({type(module).__name__})")
    if tensorized:
        root.__dict__[_RESIZE] = functools.partial(_refuse_resize, " and ".join(tensorized))
    else:
        root.__dict__.pop(_RESIZE, None)


def untensorize_(model: nn.Module) -> nn.Module:
    """Replace every comera layer of ``model`` (removed-layer stand-ins included) by the dense module it
    stands for (:meth:`~comera.nn.layer.ComeraLayer.to_dense_module`), in place, under every name it has;
    returns ``model``.

    Raises:
        TypeError: ``model`` is wrapped in ``DistributedDataParallel`` or sharded by FSDP.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> x = torch.randn(3, 64)
        >>> before = model(x)
        >>> _ = comera.untensorize_(model)
        >>> type(model[0]).__name__, torch.allclose(model(x), before, atol=1e-5)
        ('Linear', True)
    """
    root = unwrap_model(model)
    _refuse_distributed_wrapper(model, "untensorize_")
    layers = {id(m): m for name, m in root.named_modules() if name and is_layer(m)}
    ordered = sorted(layers.values(), key=lambda layer: bool(layer.references()))
    restored: dict[int, nn.Module] = {}
    with torch.no_grad():
        for layer in ordered:
            restored[id(layer)] = layer.to_dense_module(lambda module: restored.get(id(module)))
    for layer in ordered:
        replace_module(root, layer, restored[id(layer)])
    guard_embedding_resize(root)
    if hasattr(root, CONFIG_ATTRIBUTE):
        delattr(root, CONFIG_ATTRIBUTE)
    return model


def _meta_holders(root: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, bool]]]]:
    """``{id(tensor): (tensor, [(module, name, is_parameter), ...])}`` for every parameter and buffer of
    ``root`` on the meta device, with every module holding it (a tied weight has several holders)."""
    holders: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, bool]]]] = {}
    for module in root.modules():
        for slots, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in slots.items():
                if tensor is not None and tensor.is_meta:
                    holders.setdefault(id(tensor), (tensor, []))[1].append((module, name, is_parameter))
    return holders


def hf_init_weights(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """``model._init_weights`` of a Hugging Face model (one with a ``config`` and a callable
    ``_init_weights(module)``, which initialises one module as the model's own ``init_weights`` would);
    None for any other model."""
    root = unwrap_model(model)
    init = getattr(root, "_init_weights", None) if hasattr(root, "config") else None
    return init if callable(init) else None


def materialize_(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give every parameter and buffer of ``model`` still on the meta device real storage on ``device`` (one
    new tensor per meta tensor, so tied weights stay tied) and initialise the modules holding them
    (``model._init_weights`` in a Hugging Face model, else ``reset_parameters()``), in place; real tensors
    are not touched.

    Args:
        model: any ``nn.Module`` (a ``torch.compile`` wrapper is looked through; not one wrapped in DDP or
            sharded by FSDP).
        device: where the new tensors live.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: outside Hugging Face models, a module holding a non-empty meta tensor has no
            ``reset_parameters()`` (named; nothing is changed).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> with torch.device("meta"):  # shapes only: no dense weight is allocated
        ...     model = nn.Sequential(nn.Linear(256, 1024), nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 4))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=12, init="random")  # real cores
        >>> _ = comera.materialize_(model, device="cpu")  # the LayerNorm and the last linear, initialised
        >>> any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        False
        >>> model(torch.randn(8, 256)).shape
        torch.Size([8, 4])
    """
    root = unwrap_model(model)
    holders = _meta_holders(root)
    fresh = {id(module): module for _, places in holders.values() for module, _, _ in places}
    hf_init = hf_init_weights(root)
    if hf_init is None:
        needs_init = {
            id(module) for tensor, places in holders.values() if tensor.numel() for module, _, _ in places
        }
        names = {id(module): name for name, module in root.named_modules()}
        missing = [
            names[key] for key in needs_init if not callable(getattr(fresh[key], "reset_parameters", None))
        ]
        if missing:
            raise ValueError(
                f"modules {sorted(missing)} hold tensors on the meta device but have no reset_parameters() "
                "to initialise them; give them one, or materialise them yourself (to_empty + your init)"
            )
    for tensor, places in holders.values():
        real = torch.empty_like(tensor, device=device)
        if isinstance(tensor, nn.Parameter):
            real = nn.Parameter(real, requires_grad=tensor.requires_grad)
        for module, name, is_parameter in places:
            (module._parameters if is_parameter else module._buffers)[name] = real  # type: ignore[assignment]  # a Parameter where one was
    with torch.no_grad():
        for module in fresh.values():
            if hf_init is not None:
                hf_init(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()  # type: ignore[operator]  # checked callable above
    return model
