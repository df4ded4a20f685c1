"""comera: train models directly in compressed tensor-train form, with ranks learned during training.
Importing the package is cheap and changes nothing in the process (no signal handler, no torch import): each
public name is imported from its module on first use (``comera.from_pretrained`` imports ``transformers``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from comera.version import __version__

if TYPE_CHECKING:  # for type checkers and the API reference; at run time __getattr__ imports them
    from comera import methods
    from comera.integrations.hf_pretrained import from_pretrained
    from comera.io import load_pretrained, register_model, save_pretrained
    from comera.nn import GatedTrain, TTLinear, TTMEmbedding, TTMEmbeddingBag, TTMLinear, TTMTiedHead
    from comera.rank import PruneResult, RankAdaptation, param_groups, prune_
    from comera.report import CompressionReport, compression_report
    from comera.tensorize import TensorizeError, TensorizeWarning, materialize_, tensorize_, untensorize_
    from comera.tensorize_config import TensorizeConfig, register_preset, tensorize_preset
    from comera.train import TrainConfig, Trainer, plot_run
    from comera.tt.shapes import auto_modes, factorize, suggest_padding

_PUBLIC: dict[str, tuple[str, ...]] = {
    "comera.integrations.hf_pretrained": ("from_pretrained",),
    "comera.io": ("load_pretrained", "register_model", "save_pretrained"),
    "comera.nn": ("GatedTrain", "TTLinear", "TTMEmbedding", "TTMEmbeddingBag", "TTMLinear", "TTMTiedHead"),
    "comera.rank": ("PruneResult", "RankAdaptation", "param_groups", "prune_"),
    "comera.report": ("CompressionReport", "compression_report"),
    "comera.tensorize": ("TensorizeError", "TensorizeWarning", "materialize_", "tensorize_", "untensorize_"),
    "comera.tensorize_config": ("TensorizeConfig", "register_preset", "tensorize_preset"),
    "comera.train": ("TrainConfig", "Trainer", "plot_run"),
    "comera.tt.shapes": ("auto_modes", "factorize", "suggest_padding"),
}
"""Module -> the public names imported from it on first use (``methods`` is the subpackage itself)."""
_HOMES = {name: module for module, names in _PUBLIC.items() for name in names} | {"methods": "comera.methods"}

__all__ = sorted(["__version__", *_HOMES], key=str.lower)


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
