"""The special tokens of a tokenizer a user brings (``bos``, ``pad``, ``eos``, ``unk``, ``mask``), found by a
``save_pretrained`` folder's names or by conventional names, a padding token added where there is none:
:func:`special_token_names`, :func:`load_given_tokenizer`. Details: docs/llm.md, 'Bringing a corpus'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

__all__ = [
    "ADDED_PAD",
    "CONVENTIONAL_NAMES",
    "PRETRAINED_FILES",
    "ROLES",
    "GivenTokenizer",
    "given_tokenizer_files",
    "given_tokenizer_sha256",
    "load_given_tokenizer",
    "special_token_names",
]

ROLES = ("bos", "pad", "eos", "unk", "mask")
"""The special-token roles, in :class:`comera.data.bpe.SpecialIds`'s order."""
CONVENTIONAL_NAMES: dict[str, tuple[str, ...]] = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]"),
    "pad": ("<pad>", "[PAD]", "<|padding|>", "<|pad|>"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
}
"""The names each role is looked for under, in order, when nothing names it."""
ADDED_PAD = "<pad>"
"""The padding token added to a tokenizer that has none."""
PRETRAINED_FILES = ("special_tokens_map.json", "tokenizer_config.json")
"""The files of a ``save_pretrained`` folder that name its special tokens, the first naming a role used."""
_TOKENIZER_JSON = "tokenizer.json"


def _configured_name(value: object) -> str | None:
    """A ``*_token`` entry of ``special_tokens_map.json``: a string, or ``{"content": string}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _pretrained_names(folder: Path) -> tuple[dict[str, str], list[Path]]:
    """The roles a ``save_pretrained`` folder names (:data:`PRETRAINED_FILES`) and the files read."""
    names: dict[str, str] = {}
    read = []
    for file_name in PRETRAINED_FILES:
        path = folder / file_name
        if not path.is_file():
            continue
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"tokenizer_file {path}: not a readable JSON file ({error})") from None
        read.append(path)
        for role in ROLES:
            name = _configured_name(entries.get(f"{role}_token")) if isinstance(entries, dict) else None
            if name is not None:
                names.setdefault(role, name)
    return names, read


def special_token_names(
    tokenizer: Tokenizer, configured: Mapping[str, str | None] | None = None, *, what: str = "the tokenizer"
) -> dict[str, str | None]:
    """Role -> token name in ``tokenizer``: ``configured``'s names first, then the
    conventional ones; ``bos`` and ``unk`` default to the ``eos`` token; ``pad`` and ``mask`` may be None.

    Raises:
        ValueError: a configured name that the vocabulary lacks, or no end-of-document token (``what``
            names the tokenizer in the message).
    """
    configured = configured or {}
    names: dict[str, str | None] = {}
    for role in ROLES:
        name = configured.get(role)
        if name is not None and tokenizer.token_to_id(name) is None:
            raise ValueError(f"{what} names {name!r} as its {role} token, but its vocabulary lacks it")
        if name is None:
            name = next((n for n in CONVENTIONAL_NAMES[role] if tokenizer.token_to_id(n) is not None), None)
        names[role] = name
    if names["eos"] is None:
        raise ValueError(
            f"{what} lacks the special token(s) ending a document: none of {list(CONVENTIONAL_NAMES['eos'])} "
            "is in its vocabulary; add one (tokenizer.add_special_tokens) or name it as eos_token in a "
            "special_tokens_map.json beside its tokenizer.json"
        )
    for role in ("bos", "unk"):
        names[role] = names[role] or names["eos"]
    return names


@dataclass(frozen=True)
class GivenTokenizer:
    """A tokenizer read from ``data.tokenizer_file``.

    Attributes:
        tokenizer: the tokenizer, with :data:`ADDED_PAD` added when it had no padding token.
        names: role -> token name (:func:`special_token_names`).
        added: the tokens added to it (``("<pad>",)`` or none).
        files: the files read (its ``tokenizer.json``, and a folder's :data:`PRETRAINED_FILES`).
        sha256: SHA-256 over those files' names and bytes: what a preparation records of it.
    """

    tokenizer: Tokenizer
    names: dict[str, str | None]
    added: tuple[str, ...]
    files: tuple[Path, ...]
    sha256: str


def given_tokenizer_files(path: str | Path) -> tuple[Path, ...]:
    """The files :func:`load_given_tokenizer` reads for ``path``: a ``tokenizer.json``, or a folder's
    ``tokenizer.json`` and those of :data:`PRETRAINED_FILES` it holds."""
    path = Path(path)
    if not path.is_dir():
        return (path,)
    return (path / _TOKENIZER_JSON, *(path / name for name in PRETRAINED_FILES if (path / name).is_file()))


def given_tokenizer_sha256(path: str | Path) -> str:
    """SHA-256 over the names and bytes of :func:`given_tokenizer_files` (a single file: its own SHA-256,
    as comera recorded given tokenizers before folders were read)."""
    files = given_tokenizer_files(path)
    if len(files) == 1:
        return hashlib.sha256(files[0].read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def load_given_tokenizer(path: str | Path, *, what: str = "tokenizer_file") -> GivenTokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json``, or a ``save_pretrained`` folder holding one) with its
    special tokens mapped.

    Raises:
        ValueError: no ``tokenizer.json`` in the folder, a file ``tokenizers`` cannot read, a named token
            missing from the vocabulary, no end-of-document token. ``what`` opens each message.
    """
    path = Path(path)
    configured: dict[str, str] = {}
    if path.is_dir():
        if not (path / _TOKENIZER_JSON).is_file():
            raise ValueError(
                f"{what} {path} is a folder without a {_TOKENIZER_JSON}: give a tokenizers tokenizer.json, "
                "or a folder a transformers fast tokenizer was saved to (save_pretrained)"
            )
        configured, _ = _pretrained_names(path)
        file = path / _TOKENIZER_JSON
    else:
        file = path
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:
        raise ValueError(f"{what} {file}: not a tokenizers tokenizer.json ({error})") from None
    names = special_token_names(tokenizer, configured, what=f"{what} {path}")
    added: tuple[str, ...] = ()
    if names["pad"] is None:
        tokenizer.add_special_tokens([AddedToken(ADDED_PAD, special=True, normalized=False)])
        names["pad"], added = ADDED_PAD, (ADDED_PAD,)
    return GivenTokenizer(tokenizer, names, added, given_tokenizer_files(path), given_tokenizer_sha256(path))
