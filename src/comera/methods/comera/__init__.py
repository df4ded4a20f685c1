"""CoMERA as a method: its settings (:class:`CoMERASettings`), its objective (:class:`CoMERAObjective`: the
two stages, the prune points, the pruned structure of a checkpoint, the FP8 switch) and the ``comera`` method
(:class:`CoMERAMethod`: tensorize by the recipe's preset, then that objective)."""

from comera.methods.comera.method import CoMERAMethod
from comera.methods.comera.objective import CoMERAObjective, gated_model_objective
from comera.methods.comera.settings import PRUNE_POINTS, CoMERASettings
from comera.methods.comera.structure import apply_structure, model_structure

__all__ = [
    "PRUNE_POINTS",
    "CoMERAMethod",
    "CoMERAObjective",
    "CoMERASettings",
    "apply_structure",
    "gated_model_objective",
    "model_structure",
]
