"""A model's configuration given either as its config dataclass or as keyword sizes (the form
``comera.load_pretrained`` rebuilds a registered model from)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["config_from"]

Config = TypeVar("Config")


def config_from(
    config_type: type[Config], config: Config | None, sizes: dict[str, Any], owner: str
) -> Config:
    """``config`` itself, or ``config_type(**sizes)``.

    Raises:
        ValueError: both were given, or ``sizes`` names a field ``config_type`` does not have (the message
            names ``owner``, the model class, and the valid fields).
    """
    if config is not None and sizes:
        raise ValueError(f"pass either config or keyword sizes, not both (got {sorted(sizes)})")
    if config is not None:
        return config
    valid = [field.name for field in dataclasses.fields(config_type)]
    unknown = sorted(set(sizes) - set(valid))
    if unknown:
        raise ValueError(f"unknown {owner} argument(s) {unknown}; valid: {valid}")
    return config_type(**sizes)
