"""Physical rank truncation: :func:`prune_` slices cores, gates and optimizer state down to the active ranks
in place (the parameter objects stay), replaces layers with a dead bond by their stand-ins, and by default
folds the surviving gates into the cores. Details: docs/method.md section 3, docs/internals.md, "Pruning in
place"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from comera.modules import replace_module, unwrap_model
from comera.nn.gated import GatedTrain
from comera.nn.layer import is_layer
from comera.rank.size import gated_trains

__all__ = ["PrunedLayer", "PruneResult", "prune_"]

_SQUARED_STATE_MARKERS = ("sq", "square", "sum")


@dataclass(frozen=True)
class PrunedLayer:
    """One layer changed by :func:`prune_`: its stored ranks before and after (``()`` after = removed)."""

    name: str
    ranks_before: tuple[int, ...]
    ranks_after: tuple[int, ...]
    removed: bool


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune_` changed, and stored core entries of all gated layers before and after.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = comera.tensorize_(nn.Sequential(nn.Linear(64, 64)), target_modules=["0"], rank=8)
        >>> with torch.no_grad():
        ...     model[0].gates[0][2:] = 0.0
        >>> result = comera.prune_(model)
        >>> result.stored_before, result.stored_after  # core entries
        (1152, 720)
        >>> result.layers
        (PrunedLayer(name='0', ranks_before=(8, 8, 8), ranks_after=(2, 8, 8), removed=False),)
    """

    layers: tuple[PrunedLayer, ...]
    stored_before: int
    stored_after: int

    @property
    def removed(self) -> tuple[str, ...]:
        """Names of the layers replaced because a bond was dead."""
        return tuple(layer.name for layer in self.layers if layer.removed)

    @property
    def changed(self) -> bool:
        """Whether anything was sliced or removed."""
        return bool(self.layers)


def _stored(train: GatedTrain) -> int:
    return sum(core.numel() for core in train.cores)


def _is_squared(state_name: str) -> bool:
    return any(marker in state_name for marker in _SQUARED_STATE_MARKERS)


def _transform_state(
    optimizer: torch.optim.Optimizer | None,
    param: nn.Parameter,
    slicer,
    scale: torch.Tensor | None,
) -> None:
    """Slice the optimizer state of ``param``; multiply it by ``scale`` (squared for second moments)."""
    if optimizer is None or param not in optimizer.state:
        return
    state = optimizer.state[param]
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue
        sliced = slicer(value)
        if scale is not None:
            sliced = sliced * (scale.square() if _is_squared(key) else scale).to(sliced.dtype)
        state[key] = sliced.contiguous()


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype != torch.float64 else torch.float32


def _replace_data(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` the (smaller) ``value`` and forget its cached gradient accumulator (passing through an
    empty tensor of another dtype, docs/internals.md, "Pruning in place"); hooks on ``param`` are kept."""
    param.data = value.new_empty(0, dtype=_other_dtype(value.dtype))
    param.data = value.contiguous()
    param.grad = None


def _shrink(train: GatedTrain, keep: list[torch.Tensor], optimizer, fold_gates: bool) -> None:
    cores, gates = list(train.cores), list(train.gates)
    kept_gates = [gate.detach()[index] for gate, index in zip(gates, keep)]
    with torch.no_grad():
        for k, core in enumerate(cores):
            left = keep[k - 1] if k > 0 else None
            right = keep[k] if k < len(gates) else None

            def slicer(tensor, left=left, right=right):
                if left is not None:
                    tensor = tensor.index_select(0, left)
                if right is not None:
                    tensor = tensor.index_select(tensor.dim() - 1, right)
                return tensor

            fold = kept_gates[k] if fold_gates and right is not None else None
            _transform_state(optimizer, core, slicer, None if fold is None else 1.0 / fold)
            new_core = slicer(core.detach())
            _replace_data(core, new_core if fold is None else new_core * fold)
        for gate, index, kept in zip(gates, keep, kept_gates):
            _transform_state(
                optimizer, gate, lambda tensor, index=index: tensor[index], kept if fold_gates else None
            )
            _replace_data(gate, torch.ones_like(kept) if fold_gates else kept)


def _remove_dependents(root: nn.Module, removed: nn.Module) -> list[PrunedLayer]:
    """Replace the layers referring to ``removed`` (a head tied to a removed table) by their stand-ins."""
    changed = []
    for name, layer in list(root.named_modules()):
        if is_layer(layer) and any(ref is removed for ref in layer.references()):
            replace_module(root, layer, layer.pruned_stand_in())
            changed.append(PrunedLayer(name, (), (), True))
    return changed


def _forget(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]) -> None:
    if optimizer is None:
        return
    dropped = {id(param) for param in params}
    for group in optimizer.param_groups:
        group["params"] = [param for param in group["params"] if id(param) not in dropped]
    for param in params:
        optimizer.state.pop(param, None)


def prune_(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, fold_gates: bool = True
) -> PruneResult:
    """Shrink every gated layer of ``model`` to its active ranks, in place; the function is unchanged.

    Args:
        model: the model (``torch.compile`` / DDP wrappers are looked through).
        optimizer: if given, its per-parameter state is sliced to match (docs/internals.md, "Pruning in
            place") and the parameters of removed layers are dropped from it; parameter objects are kept.
        fold_gates: fold the surviving gate values into the cores and reset the gates to 1 (default), or
            keep the gate values.

    Returns:
        A :class:`PruneResult` listing the layers sliced or removed.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> with torch.no_grad():
        ...     model[0].gates[1][3:] = 0.0  # what the late stage's trim does: 5 of the bond's 8 entries dead
        >>> x = torch.randn(2, 64)
        >>> before = model(x)
        >>> result = comera.prune_(model, optimizer)  # the optimizer's state is sliced too
        >>> model[0].max_ranks, torch.allclose(model(x), before, atol=1e-5)
        ((8, 3, 8), True)
    """
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    root = unwrap_model(model)
    changed: list[PrunedLayer] = []
    before = after = 0
    for name, train in gated_trains(root):
        stored = _stored(train)
        before += stored
        keep = [(gate.detach().abs() > train.tau).nonzero().flatten() for gate in train.gates]
        ranks_before = train.max_ranks
        if any(index.numel() == 0 for index in keep):
            stand_in = train.pruned_stand_in()
            kept = {id(param) for param in stand_in.parameters()}
            _forget(optimizer, [param for param in train.parameters() if id(param) not in kept])
            dependents = _remove_dependents(root, train)
            replace_module(root, train, stand_in)
            changed.append(PrunedLayer(name, ranks_before, (), True))
            changed.extend(dependents)
            continue
        if all(index.numel() == rank for index, rank in zip(keep, ranks_before)):
            after += stored
            continue
        _shrink(train, keep, optimizer, fold_gates)
        after += _stored(train)
        changed.append(PrunedLayer(name, ranks_before, train.max_ranks, False))
    return PruneResult(tuple(changed), before, after)
