"""``--method dense``: the recipe's model as built, trained with AdamW on every parameter."""

from __future__ import annotations

from dataclasses import dataclass

from comera.methods.base import Method, register_method

__all__ = ["DenseMethod", "DenseSettings"]


@dataclass(frozen=True)
class DenseSettings:
    """The dense method has no settings of its own (its ``method`` section is empty)."""


@register_method(DenseSettings)
class DenseMethod(Method):
    """The recipe's model as built, dense, trained with AdamW on every parameter at ``train.lr_other``."""

    name = "dense"
