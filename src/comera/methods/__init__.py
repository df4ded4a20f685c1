"""Training methods, one module or folder each, and their registry (:mod:`comera.methods.base`): importing
this package (``import comera`` does) registers ``dense``, ``comera``, ``galore``, ``apollo``, ``lte`` and
``cola``, CoMERA's objective as a ``Trainer``'s default and the layers' cache invalidation before every
evaluation. Details: docs/architecture.md section 5, docs/reference/training.md, "The baseline methods".

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
