"""A toy recipe for the run-folder tests: a learnable 3-class rule, an MLP whose linears become TT layers."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.tensorize_config import TensorizeConfig, register_preset
from comera.train.evaluation import Evaluator

register_preset("toy-mlp", TensorizeConfig(target_modules=["0", "2"], rank=3))


def _split(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 16, generator=generator)
    rule = torch.randn(16, 3, generator=torch.Generator().manual_seed(123))
    return TensorDataset(inputs, (inputs @ rule).argmax(dim=1))


class AccuracyEvaluator(Evaluator):
    """Accuracy and mean cross-entropy over every example (summed, not averaged per batch)."""

    def reset(self) -> None:
        self.correct, self.loss, self.count = 0, 0.0, 0

    def update(self, model, batch) -> None:
        inputs, labels = batch
        logits = model(inputs)
        self.correct += int((logits.argmax(1) == labels).sum())
        self.loss += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        self.count += len(labels)

    def state(self):
        return self.correct, self.loss, self.count

    def merge(self, states) -> None:
        self.correct, self.loss, self.count = (sum(values) for values in zip(*states))

    def compute(self) -> dict[str, float]:
        return {"accuracy": self.correct / self.count, "loss": self.loss / self.count}


@register_recipe
class ToyRecipe(Recipe):
    name = "toy"
    description = "a learnable 3-class rule"
    presets = {
        "smoke": {
            "model": {"hidden": 32},
            "data": {"train_samples": 96, "eval_samples": 40},
            "train": {"early": 2, "late": 1, "batch_size": 16, "log_every": 1, "lr_other": 1e-2},
            "tensorize": {"preset": "toy-mlp"},
            "method": {"dense": {"train": {"lr_other": 3e-3}}},
        }
    }

    def build_data(self, settings, data_path, cache_dir) -> RecipeData:
        train = _split(settings["train_samples"], 1)
        evals = {
            "validation": _split(settings["eval_samples"], 2),
            "test": _split(settings["eval_samples"], 3),
        }
        splits = {name: {"read": len(ds), "skipped": 0} for name, ds in {"train": train, **evals}.items()}
        return RecipeData(train=train, evals=evals, info={"splits": splits})

    def build_model(self, settings, data) -> nn.Module:
        hidden = settings["hidden"]
        return nn.Sequential(
            nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 3)
        )

    def loss_fn(self, model, batch) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs), labels)

    def evaluator(self, settings) -> Evaluator:
        return AccuracyEvaluator()
