"""In-place conversion of a model's dense layers to gated tensor-train layers, and back.

``tensorize_(model, config)`` swaps the selected ``nn.Linear`` modules for :class:`comera.TTLinear` /
:class:`comera.TTMLinear` (and, with ``embeddings``, ``nn.Embedding`` / ``nn.EmbeddingBag`` for their TTM
versions), validating the whole plan before it changes anything. ``untensorize_`` rebuilds dense modules from
the current (gated) cores. Both look through ``torch.compile`` and DDP wrappers (``_orig_mod``, ``module``);
rebuild a DDP wrapper after converting the model inside it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from comera.nn.embedding import TTMEmbedding, TTMEmbeddingBag, TTMTiedHead
from comera.nn.gated import GatedTrain
from comera.nn.linear import TTLinear, TTMLinear
from comera.nn.removed import RemovedLayer
from comera.tensorize_config import ALL_LINEAR, TensorizeConfig, pattern_matches, selector_matches

__all__ = [
    "tensorize_",
    "untensorize_",
    "unwrap_model",
    "set_submodule",
    "tensorize_configs",
    "CONFIG_ATTRIBUTE",
]

CONFIG_ATTRIBUTE = "comera_tensorize_configs"
_WRAPPER_NAMES = ("DistributedDataParallel", "DataParallel")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile`` (``_orig_mod``) and DDP / DataParallel (``module``) wrappers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    while True:
        inner = model._modules.get("_orig_mod")
        if inner is None and type(model).__name__ in _WRAPPER_NAMES:
            inner = model._modules.get("module")
        if inner is None:
            return model
        model = inner


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``name`` inside ``root`` (the root itself cannot be replaced)."""
    if not name:
        raise ValueError("cannot replace the root module in place; convert a model that contains it")
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def tensorize_configs(model: nn.Module) -> tuple[TensorizeConfig, ...]:
    """The configs :func:`tensorize_` applied to ``model``, oldest first (empty if none)."""
    return tuple(getattr(unwrap_model(model), CONFIG_ATTRIBUTE, ()))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def _is_embedding(module: nn.Module) -> bool:
    return type(module) in (nn.Embedding, nn.EmbeddingBag)


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


def _select(
    selector: str | tuple[str, ...], candidates: dict[str, nn.Module], all_names: list[str], field: str
) -> list[str]:
    """Names of ``candidates`` chosen by ``selector``; raise when a regex or any list entry matches none."""
    entries = [selector] if isinstance(selector, str) else list(selector)
    chosen: list[str] = []
    for entry in entries:
        single = entry if isinstance(selector, str) else (entry,)
        hits = [name for name in candidates if selector_matches(single, name)]
        if not hits:
            elsewhere = [name for name in all_names if selector_matches(single, name)]
            hint = (
                f"it matches only modules of unsupported types: {elsewhere[:5]}"
                if elsewhere
                else f"close names: {_close_names(entry, candidates) or _close_names(entry, all_names)}"
            )
            raise ValueError(
                f"{field} entry {entry!r} matched no nn.Linear, nn.Embedding or nn.EmbeddingBag; {hint}"
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


def _check_patterns_used(config: TensorizeConfig, names: list[str]) -> None:
    for field, patterns in (("rank_pattern", config.rank_pattern), ("shape_pattern", config.shape_pattern)):
        for key in patterns:
            if not any(pattern_matches(key, name) for name in names):
                raise ValueError(
                    f"{field} key {key!r} matches no module being tensorized; close names: "
                    f"{_close_names(key, names)}"
                )


def _with_name(name: str, build, *args, **kwargs) -> nn.Module:
    try:
        return build(*args, **kwargs)
    except ValueError as error:
        raise ValueError(f"module {name!r}: {error}") from None


@torch.no_grad()
def _match_scale(layer: GatedTrain, weight: torch.Tensor) -> None:
    """Scale fresh random cores so the layer's entries have the standard deviation of ``weight``.

    Keeps the host model's initialisation conventions (e.g. std 0.02 embeddings in BERT-style models, where
    an output head is tied to the table). A zero ``weight`` leaves the layer's own initialisation.
    """
    target = weight.detach().double().std()
    current = layer.to_dense().detach().double().std()
    if target > 0 and current > 0:
        factor = float(target / current) ** (1.0 / len(layer.cores))
        for core in layer.cores:
            core.mul_(factor)


def _shapes_for(name: str, config: TensorizeConfig, kind: str, allowed: tuple[str, str]) -> dict:
    """The ``shape_pattern`` entries for module ``name``; raises if they set keys other than ``allowed``."""
    shapes = dict(config.shapes_for(name))
    wrong = set(shapes) - set(allowed)
    if wrong:
        raise ValueError(f"shape_pattern for {kind} {name!r} may only set {'/'.join(allowed)}, got {wrong}")
    return shapes


def _build_linear(name: str, linear: nn.Linear, config: TensorizeConfig) -> GatedTrain:
    shapes = _shapes_for(name, config, "linear module", ("in_shape", "out_shape"))
    cls = TTLinear if config.format == "tt" else TTMLinear
    layer = cls._like(linear, rank=config.rank_for(name), tau=config.tau, **shapes)
    if config.init == "tt_svd":
        layer._load_svd(linear)
    else:
        _match_scale(layer, linear.weight)
    return layer.train(linear.training)


def _build_embedding(name: str, embedding: nn.Module, config: TensorizeConfig) -> GatedTrain:
    shapes = _shapes_for(name, config, "embedding", ("row_shape", "col_shape"))
    bag = isinstance(embedding, nn.EmbeddingBag)
    if embedding.max_norm is not None or embedding.scale_grad_by_freq:
        raise ValueError("an embedding with max_norm or scale_grad_by_freq has no TTM equivalent")
    cls = TTMEmbeddingBag if bag else TTMEmbedding
    layer = cls._like(embedding, rank=config.rank_for(name), tau=config.tau, **shapes)
    if config.init == "tt_svd":
        layer._load_table(embedding.weight)
    else:
        _match_scale(layer, embedding.weight)
    return layer.train(embedding.training)


def tensorize_(model: nn.Module, config: TensorizeConfig | None = None, **overrides: Any) -> nn.Module:
    """Convert the modules of ``model`` selected by ``config`` into gated TT/TTM layers, in place.

    Args:
        model: any ``nn.Module`` (``torch.compile`` and DDP wrappers are looked through).
        config: a :class:`TensorizeConfig`; None for the defaults.
        **overrides: fields replacing those of ``config`` (e.g. ``rank=8, format="ttm"``).

    Returns:
        ``model`` itself, converted.

    Raises:
        ValueError: a target, exclusion or pattern key matches nothing (with close names), a setting does
            not fit a module (naming it), or no module is selected.
    """
    if config is None:
        config = TensorizeConfig()
    if not isinstance(config, TensorizeConfig):
        raise TypeError(f"config must be a TensorizeConfig or None, got {type(config).__name__}")
    if overrides:
        config = config.with_overrides(**overrides)
    root = unwrap_model(model)
    modules = dict(root.named_modules())
    all_names = [name for name in modules if name]
    linears = {name: m for name, m in modules.items() if name and _is_linear(m)}
    tables = {name: m for name, m in modules.items() if name and _is_embedding(m)}
    heads = _output_heads(root, linears, tables)
    if config.target_modules == ALL_LINEAR:
        chosen = [name for name in linears if name not in heads]
    else:
        chosen = _select(config.target_modules, {**linears, **tables}, all_names, "target_modules")
    if config.embeddings is True:
        chosen += list(tables)
    elif config.embeddings:
        chosen += _select(config.embeddings, tables, all_names, "embeddings")
    if config.exclude_modules is not None:
        excluded = set(_select(config.exclude_modules, {**linears, **tables}, all_names, "exclude_modules"))
        chosen = [name for name in chosen if name not in excluded]
    chosen = list(dict.fromkeys(chosen))
    if not chosen:
        raise ValueError("the config selects no module to tensorize (all targets excluded?)")
    tied = {}
    if config.tie_output_head:
        chosen_tables = {id(modules[name].weight): name for name in chosen if name in tables}
        tied = {
            name: chosen_tables[id(linear.weight)]
            for name, linear in linears.items()
            if id(linear.weight) in chosen_tables
        }
        chosen = [name for name in chosen if name not in tied]
    _check_patterns_used(config, chosen)

    replacements: dict[str, nn.Module] = {}
    for name in chosen:
        module = modules[name]
        build = _build_linear if name in linears else _build_embedding
        replacements[name] = _with_name(name, build, name, module, config)
    for head_name, table_name in tied.items():
        replacements[head_name] = _tied_head(modules[head_name], replacements[table_name])
    for name, module in replacements.items():
        _repoint_shared_bias(root, name, modules[name], module)
        set_submodule(root, name, module)
    setattr(root, CONFIG_ATTRIBUTE, (*tensorize_configs(root), config))
    return model


def _repoint_shared_bias(root: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """Where the parent also holds ``old``'s bias as its own parameter (as RoBERTa's LM head does), point it
    at ``new``'s bias so both stay one parameter."""
    old_bias, new_bias = getattr(old, "bias", None), getattr(new, "bias", None)
    if old_bias is None or new_bias is None:
        return
    parent_name = name.rpartition(".")[0]
    parent = root.get_submodule(parent_name) if parent_name else root
    for key, param in list(parent._parameters.items()):
        if param is old_bias:
            parent._parameters[key] = new_bias


def _tied_head(linear: nn.Linear, embedding: GatedTrain) -> nn.Module:
    head = TTMTiedHead(embedding, bias=linear.bias is not None)
    if linear.bias is not None:
        with torch.no_grad():
            head.bias.copy_(linear.bias)
    return head.train(linear.training)


def _dense_linear(layer: nn.Module, weight: torch.Tensor | nn.Parameter) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (``(out, in)``, shared if a Parameter) and ``layer``'s bias."""
    bias = getattr(layer, "bias", None)
    out_features, in_features = weight.shape
    linear = nn.Linear(
        in_features, out_features, bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        if isinstance(weight, nn.Parameter):
            linear.weight = weight
        else:
            linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.train(layer.training)


def untensorize_(model: nn.Module) -> nn.Module:
    """Replace every gated layer (and removed-layer stand-in) of ``model`` by its dense module, in place.

    ``TTLinear`` / ``TTMLinear`` become ``nn.Linear`` with ``to_dense()`` as weight; TTM embeddings become
    ``nn.Embedding`` / ``nn.EmbeddingBag``; a tied head becomes an ``nn.Linear`` sharing the restored
    table's weight. Returns ``model``.
    """
    root = unwrap_model(model)
    restored: dict[int, nn.Module] = {}
    later: list[tuple[str, nn.Module]] = []
    for name, module in list(root.named_modules()):
        if isinstance(module, TTMTiedHead):
            later.append((name, module))
        elif isinstance(module, (GatedTrain, RemovedLayer)):
            dense = _dense_of(module)
            restored[id(module)] = dense
            if name:
                set_submodule(root, name, dense)
    for name, head in later:
        table = restored.get(id(head.embedding))
        weight = table.weight if table is not None else nn.Parameter(head.embedding.to_dense().detach())
        set_submodule(root, name, _dense_linear(head, weight))
    if hasattr(root, CONFIG_ATTRIBUTE):
        delattr(root, CONFIG_ATTRIBUTE)
    return model


def _dense_of(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        weight = module.to_dense().detach()
    if hasattr(module, "in_features"):
        return _dense_linear(module, weight)
    if type(module).__name__.endswith("Bag"):
        dense = nn.EmbeddingBag(
            module.num_embeddings,
            module.embedding_dim,
            mode=module.mode,
            device=weight.device,
            dtype=weight.dtype,
        )
    else:
        dense = nn.Embedding(
            module.num_embeddings,
            module.embedding_dim,
            padding_idx=getattr(module, "padding_idx", None),
            device=weight.device,
            dtype=weight.dtype,
        )
    with torch.no_grad():
        dense.weight.copy_(weight)
    return dense.train(module.training)
