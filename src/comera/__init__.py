"""comera: train models directly in compressed tensor-train form, with ranks learned during training."""

from comera.nn import GatedTrain, TTLinear, TTMLinear
from comera.tt.shapes import auto_modes, factorize, suggest_padding
from comera.version import __version__

__all__ = [
    "GatedTrain",
    "TTLinear",
    "TTMLinear",
    "__version__",
    "auto_modes",
    "factorize",
    "suggest_padding",
]
