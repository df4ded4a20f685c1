"""comera: train models directly in compressed tensor-train form, with ranks learned during training."""

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
