"""Save and load tensorized models: ``comera_config.json`` plus ``model.safetensors``, never pickle.

The JSON records the library version, the tensorize configs applied, the dtype, and every tensorized layer
with its shapes and *current* stored ranks (after :func:`comera.prune_` these are the pruned ranks), so
loading rebuilds each layer with exactly the shapes of the saved tensors. Loading re-applies those layers to
``base_model`` (the untensorized model, e.g. a Hugging Face model built from its config), or builds the
comera model the config names (models register themselves with :func:`register_model` and carry their
constructor arguments in a ``comera_model`` attribute ``{"name": ..., "kwargs": {...}}``).

Both files are written atomically (temporary file, fsync, ``os.replace``); the config is written last.
Shared tensors (a tied head and its embedding) are stored once and listed under ``"aliases"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from comera.atomic import atomic_write_bytes
from comera.nn.embedding import TTMEmbedding, TTMEmbeddingBag, TTMTiedHead
from comera.nn.gated import GatedTrain
from comera.nn.linear import TTLinear, TTMLinear
from comera.nn.removed import RemovedEmbedding, RemovedEmbeddingBag, RemovedLayer, RemovedLinear
from comera.tensorize import CONFIG_ATTRIBUTE, set_submodule, tensorize_configs, unwrap_model
from comera.tensorize_config import TensorizeConfig
from comera.version import __version__

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "FORMAT_VERSION",
    "MODEL_ATTRIBUTE",
    "register_model",
    "save_pretrained",
    "load_pretrained",
]

CONFIG_NAME = "comera_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
MODEL_ATTRIBUTE = "comera_model"
_REQUIRED_KEYS = ("format_version", "library_version", "dtype", "layers", "tensorize_configs", "aliases")

_MODEL_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering a model class or factory under ``name`` for :func:`load_pretrained`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")

    def register(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _MODEL_REGISTRY[name] = builder
        return builder

    return register


def _module_names(root: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in root.named_modules()}


def _layer_spec(module: nn.Module, names: dict[int, str]) -> dict[str, Any]:
    kind = type(module).__name__
    if isinstance(module, (TTLinear, TTMLinear)):
        return {
            "type": kind,
            "in_features": module.in_features,
            "out_features": module.out_features,
            "bias": module.bias is not None,
            "in_shape": list(module.in_shape),
            "out_shape": list(module.out_shape),
            "ranks": list(module.max_ranks),
            "active_ranks": list(module.ranks),
            "tau": module.tau,
            "order": module.order,
        }
    if isinstance(module, RemovedLinear):
        return {
            "type": kind,
            "in_features": module.in_features,
            "out_features": module.out_features,
            "bias": module.bias is not None,
        }
    if isinstance(module, RemovedEmbeddingBag):
        return {
            "type": kind,
            "num_embeddings": module.num_embeddings,
            "embedding_dim": module.embedding_dim,
            "mode": module.mode,
            "include_last_offset": module.include_last_offset,
            "padding_idx": module.padding_idx,
        }
    if isinstance(module, RemovedEmbedding):
        return {"type": kind, "num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim}
    if isinstance(module, TTMTiedHead):
        return {"type": kind, "embedding": names[id(module.embedding)], "bias": module.bias is not None}
    if isinstance(module, GatedTrain) and hasattr(module, "num_embeddings"):
        return _embedding_spec(module)
    raise TypeError(f"cannot save a {kind}: no layer spec for this type")


def _embedding_spec(module: GatedTrain) -> dict[str, Any]:
    spec = {
        "type": type(module).__name__,
        "num_embeddings": module.num_embeddings,
        "embedding_dim": module.embedding_dim,
        "row_shape": list(module.row_shape),
        "col_shape": list(module.col_shape),
        "ranks": list(module.max_ranks),
        "active_ranks": list(module.ranks),
        "tau": module.tau,
    }
    for optional in ("padding_idx", "lookup", "mode", "include_last_offset"):
        if hasattr(module, optional):
            spec[optional] = getattr(module, optional)
    return spec


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor; returns the tensors to write and ``{alias: kept name}``."""
    kept: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if key in kept and tensor.numel() > 0:
            aliases[name] = kept[key]
        else:
            kept[key] = name
            tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors, aliases


def _model_dtype(root: nn.Module) -> str:
    first = next(iter(root.parameters()), None)
    return str(first.dtype if first is not None else torch.get_default_dtype()).removeprefix("torch.")


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``comera_config.json`` and ``model.safetensors`` for ``model`` into ``directory``.

    Returns the directory as a ``Path``. The model is not modified.
    """
    root = unwrap_model(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = _module_names(root)
    layers = {
        name: _layer_spec(module, names)
        for name, module in root.named_modules()
        if isinstance(module, (GatedTrain, RemovedLayer, TTMTiedHead))
    }
    tensors, aliases = _dedupe(root.state_dict())
    config = {
        "format_version": FORMAT_VERSION,
        "library": "comera",
        "library_version": __version__,
        "dtype": _model_dtype(root),
        "model": getattr(root, MODEL_ATTRIBUTE, None),
        "model_class": f"{type(root).__module__}.{type(root).__qualname__}",
        "tensorize_configs": [config.to_dict() for config in tensorize_configs(root)],
        "layers": layers,
        "aliases": aliases,
    }
    atomic_write_bytes(directory / WEIGHTS_NAME, save_safetensors(tensors, metadata={"format": "pt"}))
    atomic_write_bytes(directory / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    return directory


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: comera config file not found")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    for key in _REQUIRED_KEYS:
        if key not in config:
            raise ValueError(f"{path}: missing key {key!r}")
    if not isinstance(config["format_version"], int) or config["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{path}: key 'format_version' is {config['format_version']!r}; comera {__version__} reads "
            f"versions up to {FORMAT_VERSION}"
        )
    if not isinstance(config["layers"], dict):
        raise ValueError(f"{path}: key 'layers' must be an object {{module name: layer spec}}")
    return config


def _build_base(config: dict[str, Any], path: Path) -> nn.Module:
    spec = config.get("model")
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(
            f"{path}: key 'model' names no registered comera model (saved from {config.get('model_class')}); "
            "pass base_model= the untensorized model"
        )
    builder = _MODEL_REGISTRY.get(spec["name"])
    if builder is None:
        raise ValueError(
            f"{path}: key 'model.name' is {spec['name']!r}, not a registered model; registered: "
            f"{sorted(_MODEL_REGISTRY)}"
        )
    model = builder(**spec.get("kwargs", {}))
    setattr(model, MODEL_ATTRIBUTE, spec)
    return model


def _placement(root: nn.Module, name: str, default_dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    try:
        module = root.get_submodule(name)
    except AttributeError:
        module = None
    tensor = None if module is None else next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(root.parameters()), None)
    if tensor is None:
        return torch.device("cpu"), default_dtype
    return tensor.device, tensor.dtype if tensor.is_floating_point() else default_dtype


def _build_layer(spec: dict[str, Any], device, dtype, root: nn.Module) -> nn.Module:
    kind = spec["type"]
    if kind in ("TTLinear", "TTMLinear"):
        cls = TTLinear if kind == "TTLinear" else TTMLinear
        return cls(
            spec["in_features"],
            spec["out_features"],
            bias=spec["bias"],
            in_shape=spec["in_shape"],
            out_shape=spec["out_shape"],
            rank=tuple(spec["ranks"]),
            tau=spec["tau"],
            order=spec["order"],
            device=device,
            dtype=dtype,
        )
    if kind == "RemovedLinear":
        return RemovedLinear(
            spec["in_features"], spec["out_features"], spec["bias"], device=device, dtype=dtype
        )
    if kind == "RemovedEmbeddingBag":
        return RemovedEmbeddingBag(
            spec["num_embeddings"],
            spec["embedding_dim"],
            spec["mode"],
            include_last_offset=spec["include_last_offset"],
            padding_idx=spec["padding_idx"],
            device=device,
            dtype=dtype,
        )
    if kind == "RemovedEmbedding":
        return RemovedEmbedding(spec["num_embeddings"], spec["embedding_dim"], device=device, dtype=dtype)
    if kind == "TTMTiedHead":
        return TTMTiedHead(root.get_submodule(spec["embedding"]), bias=spec["bias"])
    if kind in ("TTMEmbedding", "TTMEmbeddingBag"):
        cls = TTMEmbedding if kind == "TTMEmbedding" else TTMEmbeddingBag
        options = {k: spec[k] for k in ("padding_idx", "lookup", "mode", "include_last_offset") if k in spec}
        return cls(
            spec["num_embeddings"],
            spec["embedding_dim"],
            row_shape=spec["row_shape"],
            col_shape=spec["col_shape"],
            rank=tuple(spec["ranks"]),
            tau=spec["tau"],
            device=device,
            dtype=dtype,
            **options,
        )
    raise ValueError(f"unknown layer type {kind!r}")


def _apply_layers(root: nn.Module, config: dict[str, Any], path: Path) -> None:
    recorded = getattr(torch, config["dtype"], None)
    if not isinstance(recorded, torch.dtype):
        raise ValueError(f"{path}: key 'dtype' is {config['dtype']!r}, not a torch dtype")
    ordered = sorted(config["layers"].items(), key=lambda item: item[1].get("type") == "TTMTiedHead")
    for name, spec in ordered:
        try:
            if not isinstance(spec, dict) or "type" not in spec:
                raise ValueError("a layer spec must be an object with a 'type'")
            device, dtype = _placement(root, name, recorded)
            layer = _build_layer(spec, device, dtype, root)
            set_submodule(root, name, layer)
        except (KeyError, ValueError, TypeError, AttributeError) as error:
            raise ValueError(f"{path}: key 'layers.{name}': cannot rebuild the layer ({error!r})") from None


def _read_weights(path: Path, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    try:
        tensors = load_safetensors(path.read_bytes())
    except (SafetensorError, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({error})") from None
    for alias, source in aliases.items():
        if source not in tensors:
            raise ValueError(f"{path}: key {source!r} (aliased by {alias!r}) is missing")
        tensors[alias] = tensors[source]
    return tensors


def _load_state(root: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = root.state_dict()
    for key, value in expected.items():
        if key not in tensors:
            raise ValueError(f"{path}: missing key {key!r} (expected shape {tuple(value.shape)})")
        if tuple(tensors[key].shape) != tuple(value.shape):
            raise ValueError(
                f"{path}: key {key!r} has shape {tuple(tensors[key].shape)}, "
                f"the model expects {tuple(value.shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{path}: unexpected key {unexpected[0]!r} (and {len(unexpected) - 1} more)")
    root.load_state_dict(tensors, strict=True)


def load_pretrained(directory: str | os.PathLike, base_model: nn.Module | None = None) -> nn.Module:
    """Rebuild a model saved by :func:`save_pretrained` and load its weights.

    Args:
        directory: the folder holding ``comera_config.json`` and ``model.safetensors``.
        base_model: the untensorized model to convert in place (its recorded layers are replaced by layers
            with the recorded shapes and ranks); None to build the registered comera model the config names.

    Returns:
        The loaded model (``base_model`` itself when given).

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is corrupt, truncated, or does not match the
            model; the message names the file and the key.
    """
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    config = _read_config(config_path)
    model = _build_base(config, config_path) if base_model is None else base_model
    root = unwrap_model(model)
    if base_model is None:
        root.to(getattr(torch, str(config["dtype"]), torch.float32))
    _apply_layers(root, config, config_path)
    try:
        configs = tuple(TensorizeConfig.from_dict(entry) for entry in config["tensorize_configs"])
    except (ValueError, TypeError) as error:
        raise ValueError(f"{config_path}: key 'tensorize_configs': {error}") from None
    if configs:
        setattr(root, CONFIG_ATTRIBUTE, configs)
    _load_state(root, _read_weights(directory / WEIGHTS_NAME, config["aliases"]), directory / WEIGHTS_NAME)
    return model
