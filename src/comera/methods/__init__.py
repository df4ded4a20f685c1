"""Training methods, one module or folder each, and their registry (PEFT-style).

:mod:`comera.methods.base` holds the interface (:class:`Method`, :class:`MethodContext`) and the registry
(:func:`register_method`, keyed by each method's settings dataclass; :func:`get_method`, :func:`method_for`,
:func:`method_names`). Importing this package (``import comera``
does) registers every built-in method, so ``get_method("galore")`` works from any entry point:

- ``dense`` (:mod:`comera.methods.dense`): the model as built, AdamW on every parameter;
- ``comera`` (:mod:`comera.methods.comera`): tensorize, then CoMERA's two-stage rank objective with pruning;
- ``galore``, ``apollo`` (:mod:`comera.methods.galore`, :mod:`comera.methods.apollo`, sharing
  :mod:`comera.methods.projected`): projected-gradient optimizers on the dense model; their optional
  packages (``pip install 'comera[baselines]'``) are imported only when the method is used;
- ``lte``, ``cola`` (:mod:`comera.methods.lte`, :mod:`comera.methods.cola`): the targeted linears
  (:mod:`comera.methods.targets`) replaced by LoRA heads merged periodically, or by a bottleneck.

It also registers CoMERA's hooks in the generic loop: :func:`comera.methods.comera.gated_model_objective` as
the default objective of a ``Trainer`` built without one, and the tensor-train layers' inference-cache
invalidation before every evaluation.

Examples:
    >>> from comera import methods
    >>> {"apollo", "cola", "comera", "dense", "galore", "lte"} <= set(methods.method_names())  # built in
    True
    >>> methods.get_method("galore").name
    'galore'
"""

from comera.methods.apollo import APOLLOMethod, APOLLOSettings
from comera.methods.base import (
    Method,
    MethodContext,
    get_method,
    method_for,
    method_names,
    method_settings,
    register_method,
    settings_type,
    settings_values,
)
from comera.methods.cola import CoLAMethod, CoLASettings
from comera.methods.comera import CoMERAMethod, CoMERAObjective, CoMERASettings, gated_model_objective
from comera.methods.dense import DenseMethod, DenseSettings
from comera.methods.galore import GaLoreMethod, GaLoreSettings
from comera.methods.lte import LTEMethod, LTESettings
from comera.nn.gated import invalidate_inference_caches
from comera.nn.layer import is_layer
from comera.train.fsdp import register_replicated_layer
from comera.train.objective import register_default_objective, register_evaluation_hook

__all__ = [
    "APOLLOMethod",
    "APOLLOSettings",
    "CoLAMethod",
    "CoLASettings",
    "CoMERAMethod",
    "CoMERAObjective",
    "CoMERASettings",
    "DenseMethod",
    "DenseSettings",
    "GaLoreMethod",
    "GaLoreSettings",
    "LTEMethod",
    "LTESettings",
    "Method",
    "MethodContext",
    "get_method",
    "method_for",
    "method_names",
    "method_settings",
    "register_method",
    "settings_type",
    "settings_values",
]

register_default_objective(gated_model_objective)
register_evaluation_hook(invalidate_inference_caches)
register_replicated_layer(is_layer)
