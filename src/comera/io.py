"""Save and load tensorized models: ``comera_config.json`` (every comera layer with its current ranks) plus
``model.safetensors``, never pickle; a save replaces the folder's old save at once, a load checks
everything before it changes the base model. Details: docs/guide.md, 'Conversion rules'.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from comera.atomic import atomic_replace_folder
from comera.modules import replace_module, state_shapes, unwrap_model
from comera.nn.layer import is_layer, layer_type
from comera.tensorize import CONFIG_ATTRIBUTE, guard_embedding_resize, hf_init_weights, tensorize_configs
from comera.tensorize_config import TensorizeConfig
from comera.version import __version__

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "FORMAT_VERSION",
    "MODEL_ATTRIBUTE",
    "SavedModel",
    "DamagedFileError",
    "register_model",
    "save_pretrained",
    "load_pretrained",
    "read_saved",
    "rebuild_layers",
    "saved_base_model",
]

CONFIG_NAME = "comera_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 2
MODEL_ATTRIBUTE = "comera_model"


class DamagedFileError(ValueError):
    """A file of a save that cannot be read at all (``comera_config.json`` that is not JSON, a truncated or
    corrupt ``model.safetensors``); the message names the file. Any other ``ValueError`` of a load means the
    files were read but do not make the model asked for."""


_REQUIRED_KEYS = ("format_version", "library_version", "dtype", "layers", "tensorize_configs", "aliases")

_MODEL_REGISTRY: dict[str, Callable[..., nn.Module]] = {}
_BUILTIN_MODEL_MODULES = (
    "comera.workloads.nli.model",
    "comera.workloads.mlm.model",
    "comera.workloads.dlrm.model",
    "comera.workloads.llm.model",
)
"""Modules whose import registers the built-in models (imported when a saved model names one)."""


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering a model class or factory under ``name`` for :func:`load_pretrained`.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> @comera.register_model("example-mlp")
        ... class MLP(nn.Sequential):
        ...     def __init__(self, width: int = 64):
        ...         super().__init__(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
        ...         self.comera_model = {"name": "example-mlp", "kwargs": {"width": width}}
        >>> model = comera.tensorize_(MLP(width=32), target_modules=["0"], rank=8)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     _ = comera.save_pretrained(model, folder)
        ...     restored = comera.load_pretrained(folder)  # no base model: built from the registry
        >>> type(restored).__name__, type(restored[0]).__name__, restored[0].in_features
        ('MLP', 'TTLinear', 32)
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")

    def register(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _MODEL_REGISTRY[name] = builder
        return builder

    return register


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


def _layer_specs(root: nn.Module) -> dict[str, dict[str, Any]]:
    """``{name: spec}`` of every comera layer under ``root`` (each once, under its first name)."""
    first_names = {id(module): name for name, module in root.named_modules()}

    def name_of(module: nn.Module) -> str:
        if id(module) not in first_names:
            raise ValueError(f"a layer refers to a {type(module).__name__} that is not part of the model")
        return first_names[id(module)]

    return {name: module.spec(name_of) for name, module in root.named_modules() if name and is_layer(module)}


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``comera_config.json`` and ``model.safetensors`` for ``model`` into ``directory``, in one
    transaction (encoded and checked first; other files in the folder kept); the model is not modified.
    Returns the directory as a ``Path``.

    Raises:
        TypeError: the config (e.g. the model's ``comera_model`` kwargs) is not JSON-serializable. ValueError:
            a layer cannot describe itself. Either way ``directory`` is unchanged.

    Examples:
        >>> import tempfile
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     sorted(path.name for path in comera.save_pretrained(model, folder).iterdir())
        ['comera_config.json', 'model.safetensors']
    """
    root = unwrap_model(model)
    directory = Path(directory)
    state = root.state_dict()
    parameter_keys = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    tensors, aliases = _dedupe(state)
    config = {
        "format_version": FORMAT_VERSION,
        "library": "comera",
        "library_version": __version__,
        "dtype": _model_dtype(root),
        "model": getattr(root, MODEL_ATTRIBUTE, None),
        "model_class": f"{type(root).__module__}.{type(root).__qualname__}",
        "tensorize_configs": [config.to_dict() for config in tensorize_configs(root)],
        "layers": _layer_specs(root),
        "aliases": aliases,
        "buffers": [key for key in state if key not in parameter_keys],
    }
    try:
        text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"cannot save to {directory}: the config is not JSON-serializable ({error}); check the model's "
            f"{MODEL_ATTRIBUTE!r} attribute; nothing was written"
        ) from None
    _check_config(json.loads(text), directory / CONFIG_NAME)
    weights = save_safetensors(tensors, metadata={"format": "pt"})
    return atomic_replace_folder(directory, {WEIGHTS_NAME: weights, CONFIG_NAME: text.encode()})


def _check_config(config: object, path: Path) -> dict[str, Any]:
    """``config`` if it is a well-formed comera config; ``ValueError`` naming ``path`` and the key if not."""
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    for key in _REQUIRED_KEYS:
        if key not in config:
            raise ValueError(f"{path}: missing key {key!r}")
    version = config["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
        raise ValueError(
            f"{path}: key 'format_version' is {version!r}; comera {__version__} reads version "
            f"{FORMAT_VERSION} only: save the model again with this comera (earlier formats are not read)"
        )
    if not isinstance(config["dtype"], str) or not isinstance(
        getattr(torch, config["dtype"], None), torch.dtype
    ):
        raise ValueError(f"{path}: key 'dtype' is {config['dtype']!r}, not a torch dtype name")
    aliases = config["aliases"]
    if not isinstance(aliases, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in aliases.items()
    ):
        raise ValueError(f"{path}: key 'aliases' must be an object {{tensor name: stored tensor name}}")
    buffers = config.get("buffers", [])
    if not isinstance(buffers, list) or not all(isinstance(key, str) for key in buffers):
        raise ValueError(f"{path}: key 'buffers' must be a list of tensor names")
    if not isinstance(config["layers"], dict):
        raise ValueError(f"{path}: key 'layers' must be an object {{module name: layer spec}}")
    for name, spec in config["layers"].items():
        if not isinstance(spec, dict) or "kind" not in spec:
            raise ValueError(f"{path}: key 'layers.{name}': a layer spec must be an object with a 'kind'")
        try:
            layer_type(spec["kind"])
        except ValueError as error:
            raise ValueError(f"{path}: key 'layers.{name}.kind': {error}") from None
    if not isinstance(config["tensorize_configs"], list):
        raise ValueError(f"{path}: key 'tensorize_configs' must be a list")
    try:
        for entry in config["tensorize_configs"]:
            TensorizeConfig.from_dict(entry)
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: key 'tensorize_configs': {error}") from None
    return config


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: comera config file not found")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{path}: not valid JSON, truncated or corrupt ({error})") from None
    return _check_config(config, path)


def _read_weights(path: Path, aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    try:
        tensors = load_safetensors(path.read_bytes())
    except (SafetensorError, ValueError) as error:
        raise DamagedFileError(
            f"{path}: not a readable safetensors file, truncated or corrupt ({error})"
        ) from None
    for alias, source in aliases.items():
        if source not in tensors:
            raise ValueError(f"{path}: key {source!r} (aliased by {alias!r}) is missing")
        tensors[alias] = tensors[source]
    return tensors


@dataclass(frozen=True)
class SavedModel:
    """What a :func:`save_pretrained` folder holds, read and checked: the config and every
    tensor by name (aliases included, sharing the stored tensor)."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        """The model's recorded dtype."""
        return getattr(torch, self.config["dtype"])

    def stored_name(self, key: str) -> str:
        """The name under which tensor ``key`` is stored (itself unless it is an alias)."""
        return self.config["aliases"].get(key, key)


def read_saved(directory: str | os.PathLike) -> SavedModel:
    """Read and check a :func:`save_pretrained` folder without building any model.

    Raises:
        FileNotFoundError: a file is missing. DamagedFileError: a file cannot be read (truncated or
            corrupt, naming it). ValueError: the config is not a comera config (naming the file and the key).
    """
    directory = Path(directory)
    config = _read_config(directory / CONFIG_NAME)
    tensors = _read_weights(directory / WEIGHTS_NAME, config["aliases"])
    return SavedModel(directory, config, tensors)


def _in_spec_order(layers: Mapping[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Layers that refer to others (a tied head) after the ones they refer to."""
    return sorted(layers.items(), key=lambda item: bool(layer_type(item[1]["kind"]).spec_references(item[1])))


def rebuild_layers(
    config: Mapping[str, Any],
    path: Path,
    placement: Callable[[str], tuple[torch.device | str, torch.dtype]],
) -> dict[str, nn.Module]:
    """Fresh layers from the specs of a checked config, ``{name: layer}``; ``placement(name)`` gives each
    layer's device and dtype. ``ValueError`` naming ``path`` and the layer's key when a spec is invalid."""
    built: dict[str, nn.Module] = {}

    def resolve(name: str) -> nn.Module:
        if name not in built:
            raise ValueError(f"it refers to {name!r}, which is not a recorded layer")
        return built[name]

    for name, spec in _in_spec_order(config["layers"]):
        try:
            device, dtype = placement(name)
            built[name] = layer_type(spec["kind"]).from_spec(
                spec, device=device, dtype=dtype, resolve=resolve
            )
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: key 'layers.{name}': cannot rebuild the layer ({error})") from None
    return built


def saved_base_model(directory: str | os.PathLike) -> nn.Module:
    """A fresh instance (new weights) of the registered comera model that a :func:`save_pretrained` folder
    names: the untensorized base :func:`load_pretrained` builds when it is given none.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_saved`; ``ValueError`` also when the save names no
            registered model (a model of another library: build it yourself).
    """
    saved = read_saved(directory)
    return _build_base(saved.config, saved.directory / CONFIG_NAME)


def _build_base(config: dict[str, Any], path: Path) -> nn.Module:
    spec = config.get("model")
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(
            f"{path}: key 'model' names no registered comera model (saved from {config.get('model_class')}); "
            "pass base_model= the untensorized model"
        )
    if spec["name"] not in _MODEL_REGISTRY:
        for module in _BUILTIN_MODEL_MODULES:
            importlib.import_module(module)
    builder = _MODEL_REGISTRY.get(spec["name"])
    if builder is None:
        raise ValueError(
            f"{path}: key 'model.name' is {spec['name']!r}, not a registered model; registered: "
            f"{sorted(_MODEL_REGISTRY)} (import the module that registers it with comera.register_model)"
        )
    kwargs = spec.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise ValueError(f"{path}: key 'model.kwargs' must be an object of keyword arguments")
    model = builder(**kwargs)
    setattr(model, MODEL_ATTRIBUTE, spec)
    return model


def _recorded_modules(root: nn.Module, config: dict[str, Any], path: Path) -> dict[str, nn.Module]:
    """The base model's module at every recorded layer name; ``ValueError`` naming a missing one."""
    found = {}
    for name, spec in config["layers"].items():
        try:
            found[name] = root.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"{path}: key 'layers.{name}': the base model has no module {name!r} (recorded: a "
                f"{spec['kind']}); pass the untensorized model this save was made from"
            ) from None
    return found


def _placement_of(module: nn.Module, default: torch.dtype) -> tuple[torch.device, torch.dtype]:
    """Where a layer replacing ``module`` is built: its device (the CPU for a meta module, which the saved
    weights materialise) and its floating dtype."""
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        return torch.device("cpu"), default
    device = torch.device("cpu") if tensor.is_meta else tensor.device
    return device, tensor.dtype if tensor.is_floating_point() else default


def _materialise_meta(
    root: nn.Module, saved_keys: set[str], path: Path
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give every meta parameter and buffer of ``root`` empty CPU storage (in place, shared tensors kept
    shared) to be filled from the saved weights, a meta buffer the save lacks computed by a Hugging Face
    model's ``_init_weights`` (``ValueError`` in any other model, before anything changes); returns the
    swapped pairs, which a second ``torch.utils.swap_tensors`` of each undoes.
    """
    named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    on_meta = [(name, tensor) for name, tensor in named if tensor.is_meta]
    missing = sorted(name for name, _ in on_meta if name not in saved_keys)
    hf_init = hf_init_weights(root)
    if missing and hf_init is None:
        raise ValueError(
            f"{path}: the base model's tensor {missing[0]!r} is on the meta device and the save does not "
            f"hold it (a buffer that is not saved; {len(missing)} in all); build those buffers on a real "
            "device (only parameters and saved buffers may be on the meta device)"
        )
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    done: set[int] = set()
    for _, tensor in on_meta:
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        empty = torch.empty_like(tensor, device="cpu")
        if isinstance(tensor, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, empty)
        swapped.append((tensor, empty))
    _compute_unsaved_buffers(root, missing, hf_init)  # type: ignore[arg-type]  # missing is empty without hf_init
    return swapped


def _compute_unsaved_buffers(root: nn.Module, names: list[str], init: Callable[[nn.Module], None]) -> None:
    """Fill the (materialised) buffers ``names`` of ``root`` with what ``init`` gives them, run on a copy of
    each module holding one, so that nothing else of the base model changes."""
    by_holder: dict[str, list[str]] = {}
    for name in names:
        holder, _, buffer = name.rpartition(".")
        by_holder.setdefault(holder, []).append(buffer)
    with torch.no_grad():
        for holder, buffers in by_holder.items():
            module = root.get_submodule(holder)
            scratch = copy.deepcopy(module)
            init(scratch)
            for buffer in buffers:
                module._buffers[buffer].copy_(scratch._buffers[buffer])  # type: ignore[union-attr,arg-type]  # named buffers exist


def _method_hint(directory: Path) -> str:
    """For the ``model/`` folder of a ``comera train`` run that ``load_pretrained`` could not rebuild, the
    call that loads it as its run built it (a method's own layers, such as CoLA's and LTE's, come from the
    run's settings); else nothing."""
    try:
        method = json.loads((directory.parent / "config.json").read_text(encoding="utf-8")).get("method")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(method, str):
        return ""
    return (
        f"; this model was trained by comera train with method {method!r}, whose run rebuilds layers "
        f"that load_pretrained may not: load it with "
        f"comera.recipes.saved.load_run_model({str(directory.parent)!r})"
    )


def _check_state(
    expected: Mapping[str, torch.Size | None], tensors: Mapping[str, torch.Tensor], path: Path
) -> None:
    for key, shape in expected.items():
        if key not in tensors:
            wanted = "any shape" if shape is None else f"expected shape {tuple(shape)}"
            raise ValueError(f"{path}: missing key {key!r} ({wanted})")
        if shape is not None and tuple(tensors[key].shape) != tuple(shape):
            raise ValueError(
                f"{path}: key {key!r} has shape {tuple(tensors[key].shape)}, the model expects {tuple(shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{path}: unexpected key {unexpected[0]!r} (and {len(unexpected) - 1} more)")


def load_pretrained(directory: str | os.PathLike, base_model: nn.Module | None = None) -> nn.Module:
    """Rebuild a model saved by :func:`save_pretrained` and load its weights, everything checked before
    ``base_model`` is changed (left as it was on any error); meta-device parameters and saved buffers are
    materialised on the CPU from the saved values.

    Args:
        directory: the folder holding ``comera_config.json`` and ``model.safetensors``.
        base_model: the untensorized model to convert in place (its recorded layers are replaced by layers
            with the recorded shapes and ranks); None to build the registered comera model the config names.

    Returns:
        The loaded model (``base_model`` itself when given).

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is corrupt, truncated, or does not match the
            model; the message names the file and the key or module.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> def build():
        ...     return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> model = comera.tensorize_(build(), target_modules=["0"], rank=8)
        >>> x = torch.randn(3, 64)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     _ = comera.save_pretrained(model, folder)
        ...     restored = comera.load_pretrained(folder, base_model=build())  # converted in place
        >>> type(restored[0]).__name__, torch.equal(restored(x), model(x))
        ('TTLinear', True)
    """
    saved = read_saved(directory)
    config_path, weights_path = saved.directory / CONFIG_NAME, saved.directory / WEIGHTS_NAME
    config = saved.config
    model = _build_base(config, config_path) if base_model is None else base_model
    root = unwrap_model(model)
    if base_model is None:
        root.to(saved.dtype)
    found = _recorded_modules(root, config, config_path)
    layers = rebuild_layers(config, config_path, lambda name: _placement_of(found[name], saved.dtype))
    for name, layer in layers.items():
        mismatch = layer.dense_mismatch(found[name])  # type: ignore[operator]  # a comera layer
        if mismatch is not None:
            raise ValueError(
                f"{config_path}: key 'layers.{name}': the base model's module {name!r}: {mismatch}"
            )
    swaps = {id(found[name]): layer for name, layer in layers.items()}
    try:
        _check_state(state_shapes(root, swaps), saved.tensors, weights_path)
    except ValueError as error:
        raise ValueError(f"{error}{_method_hint(saved.directory)}") from None
    configs = tuple(TensorizeConfig.from_dict(entry) for entry in config["tensorize_configs"])
    done: list[tuple[nn.Module, nn.Module]] = []
    materialised: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for name, layer in layers.items():
            replace_module(root, found[name], layer)
            done.append((found[name], layer))
        materialised = _materialise_meta(root, set(saved.tensors), weights_path)
        root.load_state_dict(saved.tensors, strict=True)
    except BaseException:
        for tensor, empty in reversed(materialised):
            torch.utils.swap_tensors(tensor, empty)
        for old, new in reversed(done):
            replace_module(root, new, old)
        raise
    guard_embedding_resize(root)
    if configs:
        setattr(root, CONFIG_ATTRIBUTE, configs)
    return model
