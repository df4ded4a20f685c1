"""A byte-level BPE tokenizer trained on the machine from local documents (``tokenizers``), with RoBERTa's
special tokens, cached by a digest of what it was trained on (or a given ``tokenizer.json`` with its
special tokens mapped); shared by the language-model workloads. Details: docs/llm.md, 'Bringing a corpus'.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from comera.atomic import atomic_write_bytes
from comera.data.cache import read_entry
from comera.data.sources import CodeDocument, documents_digest
from comera.data.special_tokens import CONVENTIONAL_NAMES, load_given_tokenizer, special_token_names
from comera.data.tokenize import MAX_VOCAB_SIZE

__all__ = [
    "SPECIAL_TOKENS",
    "MAX_PIECE_CHARS",
    "SpecialIds",
    "check_tokenizer_file",
    "load_or_train_tokenizer",
    "special_ids",
    "train_tokenizer",
]

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
_TOKENIZER_FORMAT = 2
MAX_PIECE_CHARS = 256
"""The longest pre-tokenised piece the BPE tokenizer sees: a longer one (a minified line, a data blob) is cut
into pieces of at most this many characters, since BPE training time grows with the square of a piece's
length (a one-megabyte token took minutes)."""
_MIN_FREQUENCY = 2


def _check_vocab_size(vocab_size: object) -> int:
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS) + 1
    bad = isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
    if bad or not smallest <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int in [{smallest}, {MAX_VOCAB_SIZE}] (256 bytes + {len(SPECIAL_TOKENS)} "
            f"special tokens + 1 merge at least), got {vocab_size!r}"
        )
    return vocab_size


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with :data:`SPECIAL_TOKENS` (ids 0..4) trained on ``texts``: GPT-2's
    byte-level pre-tokeniser with pieces cut to at most :data:`MAX_PIECE_CHARS` characters, at most
    ``vocab_size`` tokens.
    """
    vocab_size = _check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            pre_tokenizers.Split(Regex(f"[\\s\\S]{{1,{MAX_PIECE_CHARS}}}"), behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=_MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def check_tokenizer_file(tokenizer_file: object) -> Path | None:
    """``tokenizer_file`` as a path to an existing file (or a ``save_pretrained`` folder holding a
    ``tokenizer.json``), or None.

    Raises:
        ValueError: it is not a path (a string or ``os.PathLike``) or None, it is empty, or it names a folder
            without a ``tokenizer.json`` or something else than a file (a broken or looping link).
            FileNotFoundError: nothing is there.
    """
    if tokenizer_file is None:
        return None
    if not isinstance(tokenizer_file, (str, os.PathLike)) or not str(tokenizer_file).strip():
        raise ValueError(
            "tokenizer_file must be the path of a tokenizer.json file (a string) or unset, got "
            f"{tokenizer_file!r}"
        )
    path = Path(tokenizer_file)
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"tokenizer_file {path} is a folder without a tokenizer.json; name a tokenizer.json file, or a "
            "folder a transformers fast tokenizer was saved to (save_pretrained)"
        )
    if path.is_dir():
        return path
    if path.is_symlink() and not path.exists():
        raise ValueError(f"tokenizer_file {path} is a broken or looping symbolic link; name the file itself")
    if not path.exists():
        raise FileNotFoundError(f"tokenizer_file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"tokenizer_file {path} is not a regular file (a pipe or a device)")
    return path


def load_or_train_tokenizer(
    train_documents: Sequence[CodeDocument],
    vocab_size: int,
    cache_dir: str | Path,
    tokenizer_file: str | Path | None = None,
) -> tuple[Tokenizer, Path, bool]:
    """The tokenizer to use: ``tokenizer_file`` if given (its special tokens mapped, a padding token added
    when it has none: :func:`comera.data.special_tokens.load_given_tokenizer`), else the cached one trained
    on the same documents with the same ``vocab_size``, else a newly trained one written to ``cache_dir``.

    Returns:
        ``(tokenizer, path of its tokenizer.json, whether it was read rather than trained)``.
    """
    path = check_tokenizer_file(tokenizer_file)
    if path is not None:
        return load_given_tokenizer(path).tokenizer, path, True
    vocab_size = _check_vocab_size(vocab_size)
    if not train_documents:
        raise ValueError("cannot train a tokenizer: the training split has no documents")
    ordered = sorted(train_documents, key=lambda document: document.key)
    digest = documents_digest(ordered, "code-bpe", _TOKENIZER_FORMAT, vocab_size, _MIN_FREQUENCY)
    path = Path(cache_dir) / f"code-bpe-{vocab_size}-{digest}.json"
    cached = read_entry(path, lambda file: Tokenizer.from_file(str(file)))
    if cached is not None:
        return cached, path, True
    tokenizer = train_tokenizer((document.text for document in train_documents), vocab_size)
    atomic_write_bytes(path, tokenizer.to_str().encode())
    return tokenizer, path, False


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens of a tokenizer, and its vocabulary size (``mask`` None: it has no mask
    token, which only the masked LM needs)."""

    bos: int
    pad: int
    eos: int
    unk: int
    mask: int | None
    vocab_size: int

    @property
    def all(self) -> tuple[int, ...]:
        """Every special id, once each (a tokenizer may use one token for several roles)."""
        found = (self.bos, self.pad, self.eos, self.unk, self.mask)
        return tuple(dict.fromkeys(index for index in found if index is not None))

    @cached_property
    def ordinary(self) -> torch.Tensor:
        """The ids of all other tokens, ascending: ``(vocab_size - len(all),)`` int64."""
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        keep[list(self.all)] = False
        return keep.nonzero().flatten()


def special_ids(tokenizer: Tokenizer, names: Mapping[str, str | None] | None = None) -> SpecialIds:
    """The ids of ``tokenizer``'s special tokens by role: those ``names`` gives (role -> token, as a prepared
    corpus's index records them), else found by their conventional names
    (:func:`comera.data.special_tokens.special_token_names`: RoBERTa's :data:`SPECIAL_TOKENS` first).

    Raises:
        ValueError: no end-of-document or padding token, or a named token the vocabulary lacks (named).
    """
    names = special_token_names(tokenizer, names)
    if names["pad"] is None:
        raise ValueError(
            "the tokenizer lacks the special token(s) for padding: none of "
            f"{list(CONVENTIONAL_NAMES['pad'])} is in its vocabulary (a tokenizer given as "
            "data.tokenizer_file gets <pad> added)"
        )
    ids = {role: None if name is None else tokenizer.token_to_id(name) for role, name in names.items()}
    bos, pad, eos, unk = (ids[role] for role in ("bos", "pad", "eos", "unk"))
    assert bos is not None and pad is not None and eos is not None and unk is not None  # found above
    return SpecialIds(bos, pad, eos, unk, ids["mask"], vocab_size=tokenizer.get_vocab_size())
