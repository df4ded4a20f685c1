"""``--method comera``: tensorize the recipe's model by its named preset, then train it with
:class:`comera.methods.comera.CoMERAObjective` built from the run's ``method`` section."""

from __future__ import annotations

from torch import nn

from comera.methods.base import Method, MethodContext, register_method
from comera.methods.comera.objective import CoMERAObjective
from comera.methods.comera.settings import CoMERASettings
from comera.rank.allocation import allocate_ranks
from comera.rank.spectral import spectral_init_
from comera.tensorize import tensorize_
from comera.train.objective import Objective

__all__ = ["CoMERAMethod"]


@register_method(CoMERASettings)
class CoMERAMethod(Method):
    """CoMERA: tensorize by the recipe's preset, then the rank-adaptive early and late stages with pruning;
    the ``method`` section holds the fields of :class:`CoMERASettings`."""

    name = "comera"
    staged = True

    def prepare(self, model: nn.Module, context: MethodContext) -> nn.Module:
        """Tensorize by ``context.tensorize``; under ``core_rule="spectral"``, redraw the linear layers'
        cores by that rule (:func:`comera.rank.spectral.spectral_init_`); with ``rank_shares``, the ranks are
        first reallocated at the tensorization's size (:func:`comera.rank.allocation.allocate_ranks`)."""
        settings = self.settings(context)
        config = context.tensorize
        if settings.rank_shares:
            config = allocate_ranks(model, config, settings.rank_shares)
        model = tensorize_(model, config)
        if settings.core_rule == "spectral":
            spectral_init_(model, settings.zero_last)
        return model

    def objective(self, model: nn.Module, context: MethodContext) -> Objective:
        return CoMERAObjective(model, self.settings(context))
