"""``--method dense``: the recipe's model as built, trained with AdamW on every parameter."""

from __future__ import annotations

from comera.methods.base import Method

__all__ = ["DenseMethod"]


class DenseMethod(Method):
    """The recipe's model as built, dense, trained with AdamW on every parameter at ``train.lr_other``."""

    name = "dense"
