"""comera: train models directly in compressed tensor-train form, with ranks learned during training.

``comera.from_pretrained`` (:func:`comera.integrations.hf_pretrained.from_pretrained`) needs ``transformers``
and is imported on first use, so that ``import comera`` does not import ``transformers``.
"""

import importlib
from typing import TYPE_CHECKING, Any

import comera.startup  # noqa: F401  (first, before torch: a Ctrl-C while comera starts ends it in one line)
from comera import methods
from comera.io import load_pretrained, register_model, save_pretrained
from comera.nn import GatedTrain, TTLinear, TTMEmbedding, TTMEmbeddingBag, TTMLinear, TTMTiedHead
from comera.rank import PruneResult, RankAdaptation, param_groups, prune_
from comera.report import CompressionReport, compression_report
from comera.tensorize import TensorizeError, TensorizeWarning, materialize_, tensorize_, untensorize_
from comera.tensorize_config import TensorizeConfig, register_preset, tensorize_preset
from comera.train import TrainConfig, Trainer, plot_run
from comera.tt.shapes import auto_modes, factorize, suggest_padding
from comera.version import __version__

if TYPE_CHECKING:
    from comera.integrations.hf_pretrained import from_pretrained

_LAZY = {"from_pretrained": "comera.integrations.hf_pretrained"}
"""Public names imported on first use (their modules import optional dependencies): name -> module."""

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
    "from_pretrained",
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
    """The names of :data:`_LAZY`, imported from their modules on first use (PEP 562)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'comera' has no attribute {name!r}")
