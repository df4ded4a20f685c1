"""Training: one loop for every method (stages and pruning asked of the objective), checkpoints and resume,
the non-finite guard, metrics and plots."""

from comera.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from comera.train.config import TrainConfig
from comera.train.guard import NonFiniteError
from comera.train.metrics import read_metrics
from comera.train.plots import plot_run, rank_history
from comera.train.trainer import FitResult, Trainer

__all__ = [
    "FitResult",
    "NonFiniteError",
    "TrainConfig",
    "Trainer",
    "latest_checkpoint",
    "load_checkpoint",
    "plot_run",
    "rank_history",
    "read_metrics",
    "save_checkpoint",
]
