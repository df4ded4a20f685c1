"""Which linears a baseline acts on: the ``nn.Linear`` modules the recipe's tensorization targets, never an
embedding table, and under ``"all-linear"`` neither an output head, a linear with a single output, nor one its
parent reads by attribute. Details: docs/reference/training.md, "The baseline methods"."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from comera.modules import set_submodule, unwrap_model
from comera.tensorize_config import ALL_LINEAR, TensorizeConfig, selector_matches
from comera.weight_reads import disable_weight_fast_paths, read_by_attribute

__all__ = ["target_linears", "replace_targets"]


def _output_heads(root: nn.Module, linears: dict[str, nn.Linear]) -> set[str]:
    tables = {id(m.weight) for m in root.modules() if type(m) in (nn.Embedding, nn.EmbeddingBag)}
    heads = {name for name, linear in linears.items() if id(linear.weight) in tables}
    getter = getattr(root, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return heads | {name for name, linear in linears.items() if linear is head}


def target_linears(model: nn.Module, config: TensorizeConfig) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules of ``model`` that ``config`` targets, by full dotted name, in model order.

    Raises:
        ValueError: no linear is selected (naming ``target_modules`` and the model's linears).
    """
    root = unwrap_model(model)
    linears = {name: m for name, m in root.named_modules() if name and isinstance(m, nn.Linear)}
    if config.target_modules == ALL_LINEAR:
        left_out = _output_heads(root, linears) | set(read_by_attribute(root))
        chosen = {name: m for name, m in linears.items() if name not in left_out and m.out_features > 1}
    else:
        chosen = {name: m for name, m in linears.items() if selector_matches(config.target_modules, name)}
    if config.exclude_modules is not None:
        chosen = {name: m for name, m in chosen.items() if not selector_matches(config.exclude_modules, name)}
    if not chosen:
        raise ValueError(
            f"target_modules {config.target_modules!r} (exclude_modules {config.exclude_modules!r}) selects "
            f"no nn.Linear; the model's linears are {sorted(linears)[:10]}"
        )
    return chosen


def replace_targets(
    model: nn.Module, config: TensorizeConfig, build: Callable[[nn.Linear], nn.Module]
) -> nn.Module:
    """Replace every linear ``config`` targets by ``build(linear)``, in place; returns ``model``.

    Raises:
        ValueError: nothing is targeted, or a target is a linear its parent reads by attribute (such as the
            ``out_proj`` of an ``nn.MultiheadAttention``), so a replacement would break the parent.
    """
    root = unwrap_model(model)
    targets = target_linears(root, config)
    read = read_by_attribute(root)
    for name in targets:
        if name in read:
            raise ValueError(
                f"target {name!r} cannot be replaced: {read[name]}; exclude it with tensorize.exclude_modules"
            )
    for name, linear in targets.items():
        set_submodule(root, name, build(linear))
    disable_weight_fast_paths(root)
    return model
