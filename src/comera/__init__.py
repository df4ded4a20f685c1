"""comera: train models directly in compressed tensor-train form, with ranks learned during training.

Importing the package is cheap and changes nothing in the process (no signal handler, no torch import): each
public name is imported from its module on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from comera.version import __version__

if TYPE_CHECKING:
    from comera import methods
    from comera.io import load_pretrained, register_model, save_pretrained
    from comera.nn import GatedTrain, TTLinear, TTMEmbedding, TTMEmbeddingBag, TTMLinear, TTMTiedHead
    from comera.rank import PruneResult, RankAdaptation, param_groups, prune_
    from comera.report import CompressionReport, compression_report
    from comera.tensorize import TensorizeError, TensorizeWarning, materialize_, tensorize_, untensorize_
    from comera.tensorize_config import TensorizeConfig, register_preset, tensorize_preset
    from comera.train import TrainConfig, Trainer, plot_run
    from comera.tt.shapes import auto_modes, factorize, suggest_padding

_HOMES: dict[str, str] = {
    "methods": "comera.methods",
    "load_pretrained": "comera.io",
    "register_model": "comera.io",
    "save_pretrained": "comera.io",
    "GatedTrain": "comera.nn",
    "TTLinear": "comera.nn",
    "TTMEmbedding": "comera.nn",
    "TTMEmbeddingBag": "comera.nn",
    "TTMLinear": "comera.nn",
    "TTMTiedHead": "comera.nn",
    "PruneResult": "comera.rank",
    "RankAdaptation": "comera.rank",
    "param_groups": "comera.rank",
    "prune_": "comera.rank",
    "CompressionReport": "comera.report",
    "compression_report": "comera.report",
    "TensorizeError": "comera.tensorize",
    "TensorizeWarning": "comera.tensorize",
    "materialize_": "comera.tensorize",
    "tensorize_": "comera.tensorize",
    "untensorize_": "comera.tensorize",
    "TensorizeConfig": "comera.tensorize_config",
    "register_preset": "comera.tensorize_config",
    "tensorize_preset": "comera.tensorize_config",
    "TrainConfig": "comera.train",
    "Trainer": "comera.train",
    "plot_run": "comera.train",
    "auto_modes": "comera.tt.shapes",
    "factorize": "comera.tt.shapes",
    "suggest_padding": "comera.tt.shapes",
}
"""Public name -> the module it is imported from on first use."""

__all__ = [
    "CompressionReport",
    "GatedTrain",
    "PruneResult",
    "RankAdaptation",
    "TensorizeConfig",
    "TensorizeError",
    "TensorizeWarning",
    "TrainConfig",
    "Trainer",
    "TTLinear",
    "TTMEmbedding",
    "TTMEmbeddingBag",
    "TTMLinear",
    "TTMTiedHead",
    "__version__",
    "auto_modes",
    "compression_report",
    "factorize",
    "load_pretrained",
    "materialize_",
    "methods",
    "param_groups",
    "plot_run",
    "prune_",
    "register_model",
    "register_preset",
    "save_pretrained",
    "suggest_padding",
    "tensorize_",
    "tensorize_preset",
    "untensorize_",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module the first time it is asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'comera' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if name == "methods" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
