"""``comera.from_pretrained``: a tensorized Hugging Face model saved by ``CoMERATrainer`` (comera's files plus
``config.json``) back in one call; ``transformers``' own ``from_pretrained`` cannot load such a folder.
Details: docs/training.md, 'Loading: comera.from_pretrained(folder)'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedModel

from comera.io import CONFIG_NAME, load_pretrained

__all__ = ["HF_CONFIG_NAME", "from_pretrained", "model_class_of"]

HF_CONFIG_NAME = "config.json"
"""The Hugging Face model config beside comera's files (``transformers.CONFIG_NAME``)."""
GENERATION_CONFIG_NAME = "generation_config.json"


def model_class_of(config: PretrainedConfig, path: Path) -> type[PreTrainedModel]:
    """The ``transformers`` model class that ``config.architectures`` names (its one entry).

    Raises:
        ValueError: no single architecture is named, or ``transformers`` has no model class of that name;
            the message names ``path`` (the config file).
    """
    names = getattr(config, "architectures", None)
    if not isinstance(names, (list, tuple)) or len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(
            f"{path}: key 'architectures' is {names!r}, expected one transformers class name such as "
            "['LlamaForCausalLM']; load with comera.load_pretrained(folder, base_model=<the untensorized "
            "model>)"
        )
    found = getattr(transformers, names[0], None)
    if not (isinstance(found, type) and issubclass(found, PreTrainedModel)):
        raise ValueError(
            f"{path}: key 'architectures' names {names[0]!r}, which is not a model class of transformers "
            f"{transformers.__version__}; load with comera.load_pretrained(folder, base_model=<the "
            "untensorized model>)"
        )
    return found


def _saved_dtype(folder: Path) -> torch.dtype:
    """The dtype ``comera_config.json`` records, to build the base model in (float32 where the file does not
    name one: :func:`comera.load_pretrained` then refuses the file with its own message)."""
    try:
        name = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")).get("dtype")
    except (OSError, ValueError, AttributeError):
        name = None
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else torch.float32


def _read_hf_config(folder: Path, overrides: dict[str, Any]) -> PretrainedConfig:
    """The folder's ``config.json`` as its ``PretrainedConfig`` class, with ``overrides`` (config
    attributes) set; ``ValueError`` naming a key the config does not take or a file it cannot read."""
    path = folder / HF_CONFIG_NAME
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: from_pretrained builds the transformers class that config.json names; "
            "save with CoMERATrainer.save_model (or write model.config.save_pretrained(folder) beside "
            "comera.save_pretrained's files), or load with comera.load_pretrained(folder, base_model=...)"
        )
    try:
        config, unused = AutoConfig.from_pretrained(str(folder), return_unused_kwargs=True, **overrides)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a transformers model config ({error})") from None
    if unused:
        raise ValueError(
            f"from_pretrained got {sorted(unused)[0]!r}, which is not an attribute of "
            f"{type(config).__name__}; keyword arguments set config attributes (e.g. use_cache=False), "
            "dtype= and device= place the model"
        )
    return config


def from_pretrained(
    folder: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    **config_overrides: Any,
) -> PreTrainedModel:
    """Load a tensorized Hugging Face model saved by ``CoMERATrainer`` (or by :func:`comera.save_pretrained`
    with the model's ``config.json`` beside it): the class ``config.json``'s ``architectures`` names, built
    on the ``meta`` device with comera's layers at the saved ranks, its weights loaded strictly, ready for
    ``model.generate`` and ``transformers.pipeline``.

    Args:
        folder: the saved folder (``comera_config.json``, ``model.safetensors``, ``config.json``).
        dtype: the parameters' dtype; None keeps the saved one.
        device: where the model goes after loading; None keeps it on the CPU.
        **config_overrides: attributes of the model's config to set before the model is built (e.g.
            ``use_cache=False``).

    Returns:
        The model, in eval mode.

    Raises:
        FileNotFoundError: ``folder`` does not exist. ValueError: it is not a comera save
            (no ``comera_config.json``), has no usable ``config.json``, names an architecture that
            ``transformers`` does not have, or its weights do not fit; an override the config does not take;
            a ``dtype`` that is not a floating ``torch.dtype``. Each message names the file or argument.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import comera
        >>> config = LlamaConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=4,
        ... )
        >>> model = comera.tensorize_(LlamaForCausalLM(config), target_modules=["q_proj", "v_proj"], rank=4)
        >>> with tempfile.TemporaryDirectory() as folder:  # what CoMERATrainer.save_model writes
        ...     _ = comera.save_pretrained(model, folder)
        ...     model.config.architectures = ["LlamaForCausalLM"]
        ...     model.config.save_pretrained(folder)
        ...     loaded = comera.from_pretrained(folder)
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> type(loaded.model.layers[0].self_attn.q_proj).__name__
        'TTLinear'
        >>> torch.equal(loaded(ids).logits, model.eval()(ids).logits)
        True
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"from_pretrained: folder {str(folder)!r} does not exist")
    if not (root / CONFIG_NAME).is_file():
        raise ValueError(
            f"{root}: not a comera save (no {CONFIG_NAME}); a dense Hugging Face folder loads with "
            "transformers' own from_pretrained"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    config = _read_hf_config(root, config_overrides)
    model_class = model_class_of(config, root / HF_CONFIG_NAME)
    with torch.device("meta"):
        base = model_class(config).to(_saved_dtype(root))
    model = load_pretrained(root, base_model=base)
    if (root / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(root))
    if dtype is not None:
        model.to(dtype)
    if device is not None:
        model.to(device)
    return model.eval()
