"""What the projected-gradient optimizers (GaLore, APOLLO) share: the optional package, the parameter groups,
and :func:`portable_projectors`, which makes their optimizer state hold the projector's tensors and numbers so
checkpoints load with ``torch.load(weights_only=True)``. Details: docs/architecture.md section 5."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn

from comera.checks import check_int, check_number
from comera.methods.base import Method, MethodContext
from comera.methods.targets import target_linears
from comera.modules import trainable_parameters
from comera.tensorize_config import TensorizeConfig

__all__ = [
    "BASELINES_EXTRA",
    "QUIET_LOGGERS",
    "require_package",
    "check_projection",
    "projection_rank",
    "low_rank_groups",
    "portable_projectors",
]

BASELINES_EXTRA = "pip install 'comera[baselines]'"
"""The install command of the optional baseline packages (``galore-torch``, ``apollo-torch``)."""


QUIET_LOGGERS = ("bitsandbytes",)
"""Loggers silenced below ERROR while a baseline package is imported: ``galore_torch`` imports
``bitsandbytes`` (for its 8-bit optimizer, which comera does not use), whose CPU backend warns on import
that an optional kernel download is missing; that warning says nothing about the run."""


def require_package(module: str, distribution: str, method: str) -> ModuleType:
    """Import ``module`` of the optional ``distribution``; a missing one raises ``ImportError`` naming
    :data:`BASELINES_EXTRA`. The loggers of :data:`QUIET_LOGGERS` print only errors during the import."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"the {method!r} method needs the {distribution!r} package, which is not installed: "
            f"{BASELINES_EXTRA}"
        ) from error
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def projection_rank(shape: torch.Size | tuple[int, int], rank: int, rank_fraction: float) -> int:
    """The projection rank of a ``(out, in)`` weight: ``rank`` capped at ``rank_fraction * min(out, in)``
    (rounded down, at least 1)."""
    return max(1, min(rank, int(min(shape) * rank_fraction)))


def low_rank_groups(
    model: nn.Module,
    config: TensorizeConfig,
    *,
    rank: int,
    rank_fraction: float,
    lr: float,
    weight_decay: float,
    projection: dict[str, Any],
) -> list[dict[str, Any]]:
    """Parameter groups: every trainable parameter but the targeted weights (``"other"``), then one group per
    projection rank holding the 2-D weights of the linears ``config`` targets (``"low_rank_R"``, with
    ``"rank": R`` and the ``projection`` keys the optimizer reads).

    Args:
        model: the model (shared parameters are listed once).
        config: the run's tensorization; its targets are the projected linears (:func:`target_linears`).
        rank, rank_fraction: :func:`projection_rank` of each weight.
        lr, weight_decay: of every group.
        projection: the optimizer's per-group projection keys (``update_proj_gap``, ``scale``, ...).
    """
    by_rank: dict[int, list[nn.Parameter]] = {}
    projected: set[int] = set()
    for linear in target_linears(model, config).values():
        weight = linear.weight
        if weight.requires_grad and id(weight) not in projected:
            projected.add(id(weight))
            by_rank.setdefault(projection_rank(weight.shape, rank, rank_fraction), []).append(weight)
    others = trainable_parameters(model.parameters(), seen=set(projected))
    common = {"lr": lr, "weight_decay": weight_decay}
    groups = [{"name": "other", "params": others, **common}] if others else []
    for projected_rank, weights in sorted(by_rank.items()):
        groups.append(
            {
                "name": f"low_rank_{projected_rank}",
                "params": weights,
                "rank": projected_rank,
                **common,
                **projection,
            }
        )
    return groups


def _portable(projector: Any) -> dict[str, Any]:
    """The projector's tensors and numbers (strings are left out: the optimizer's loader would mangle them;
    the group's settings restore them)."""
    kept = {}
    for key, value in vars(projector).items():
        is_number = isinstance(value, (int, float))
        is_tensors = isinstance(value, list) and all(isinstance(item, torch.Tensor) for item in value)
        if isinstance(value, torch.Tensor) or is_number or is_tensors:
            kept[key] = value
    return kept


def portable_projectors(
    optimizer: torch.optim.Optimizer, build: Callable[[dict[str, Any], dict[str, Any]], Any]
) -> torch.optim.Optimizer:
    """Make ``optimizer``'s projector objects round-trip through ``state_dict`` / ``load_state_dict`` as
    plain tensors and numbers.

    Args:
        optimizer: a GaLore or APOLLO optimizer (projectors under ``state[param]["projector"]``).
        build: ``build(group, state) -> projector``, a new projector as the package makes it for a parameter
            of ``group`` (its attributes are then set from the saved tensors and numbers).

    Returns:
        ``optimizer``, with a state-dict post-hook and a load-state-dict post-hook registered.
    """

    def save(_, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["state"] = {
            index: (
                {**state, "projector": _portable(state["projector"])}
                if "projector" in state and not isinstance(state["projector"], dict)
                else state
            )
            for index, state in state_dict["state"].items()
        }
        return state_dict

    def load(_) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                saved = state.get("projector")
                if isinstance(saved, dict):
                    projector = build(group, state)
                    for key, value in saved.items():
                        setattr(projector, key, value)
                    state["projector"] = projector

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_post_hook(load)
    return optimizer


def check_projection(settings: Any) -> None:
    """Check the settings every projected method has: ``rank`` (an int >= 1), ``rank_fraction`` (in
    (0, 1]) and ``update_proj_gap`` (an int >= 1); ``ValueError`` naming the setting."""
    check_int(settings.rank, "method.rank", low=1)
    check_number(settings.rank_fraction, "method.rank_fraction", 0.0, 1.0, open_low=True)
    check_int(settings.update_proj_gap, "method.update_proj_gap", low=1)


class ProjectedMethod(Method):
    """A dense model trained by an optimizer that projects the targeted 2-D weights' gradients (GaLore,
    APOLLO): groups from :func:`low_rank_groups` with the settings named in :attr:`projection_keys`; a
    subclass registers a settings dataclass with ``rank``, ``rank_fraction`` and ``update_proj_gap`` and
    implements :meth:`package` and ``optimizer``."""

    projection_keys: ClassVar[tuple[str, ...]] = ()

    def package(self) -> ModuleType:
        """The imported optimizer package (``ImportError`` naming the extra to install)."""
        raise NotImplementedError

    def prepare(self, model: nn.Module, context: MethodContext) -> nn.Module:
        self.settings(context)
        self.package()
        return model

    def groups(self, model: nn.Module, context: MethodContext, settings: Any) -> list[dict]:
        """:func:`low_rank_groups` of ``model`` at the run's learning rate and weight decay."""
        return low_rank_groups(
            model,
            context.tensorize,
            rank=settings.rank,
            rank_fraction=settings.rank_fraction,
            lr=context.train.lr_other,
            weight_decay=context.train.weight_decay,
            projection={key: getattr(settings, key) for key in self.projection_keys},
        )
