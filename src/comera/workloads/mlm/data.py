"""Source code for masked-LM pre-training: reading, a deterministic split, a local BPE tokenizer, packing,
and dynamic masking in the collate function.

Sources (:func:`read_code`):

- CodeSearchNet-style ``*.jsonl`` / ``*.jsonl.gz`` files, one JSON object per line whose ``code`` (else
  ``original_string``) field holds the text; a line that is not such an object raises ``ValueError`` naming
  file and line, or is skipped and counted with ``skip_bad_lines=True``; a truncated or corrupt gzip file
  raises ``ValueError`` naming it and the last line read;
- any folder of source files selected by extension (``.py`` by default), read as UTF-8; a file that is not
  valid UTF-8, or that cannot be read (a symbolic link to itself, no permission), is skipped and counted. A
  folder may also hold ``*.jsonl(.gz)`` files;
- nothing: the running Python's standard library (``sysconfig.get_paths()["stdlib"]``, ``*.py``, without
  ``site-packages``), which every machine has.

``max_files`` / ``max_bytes`` cap what is read; files are taken in the order of a hash of their relative
path, so a cap gives a fixed pseudo-random sample rather than the first packages alphabetically.

Split (:func:`split_of`): a document goes to validation when a SHA-256 hash of its key, as a fraction of
``2**64``, is below ``validation_fraction``. The key is the file's path relative to the source (for a JSON
record: ``repo/path`` when both fields are there, so one source file's functions stay together, else
``file:line``). The split depends on nothing else: not on the order of reading, the caps or the platform.

Tokenizer (:func:`load_or_train_tokenizer`): byte-level BPE trained with ``tokenizers`` on the training split
only, its pre-tokenised pieces cut to at most :data:`MAX_PIECE_CHARS` characters, with the RoBERTa special
tokens :data:`SPECIAL_TOKENS` (ids 0..4), cached as ``code-bpe-{vocab}-{digest}.json`` in a cache folder;
the digest covers the training documents (keys and contents) and the trainer settings, so changed data
trains a new one. A given ``tokenizer.json`` is used as
it is (it must know the special tokens). The token ids of each split are cached next to it
(``code-tokens-{digest}.npz``, keyed by the tokenizer and the documents).

Packing (:func:`pack_documents`): documents are joined into one stream, each followed by ``</s>``; the
stream is cut into blocks of ``seq_len - 1`` tokens and each block starts with ``<s>``. Every document token
is in exactly one block, in order. The last block, when short, is padded with ``<pad>`` (``tail="pad"``,
attention mask 0 there) or dropped (``tail="drop"``, the dropped tokens counted).

Masking (:class:`MaskingCollator`, the ``collate_fn``): as BERT/RoBERTa, each maskable token (not a special
token) is chosen with probability 0.15; of the chosen, 80% become ``<mask>``, 10% a random ordinary token,
10% stay. Labels hold the original token at chosen positions and -100 elsewhere. Every sample is masked with
its own ``torch.Generator``: for evaluation splits (``fixed_masking=True``) seeded from ``(seed, index)``, so
evaluation sees the same masks every time, whatever the batch size or sharding; for training seeded from
``(seed, epoch, the batch's sample indices, index)``, so masks change whenever batches are drawn differently
(each shuffled epoch; :meth:`MaskingCollator.set_epoch` adds the epoch), and a run, resumed or not, draws the
same masks for the same batches.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import Dataset

from comera.atomic import atomic_write_bytes
from comera.data.files import numbered_lines, open_data

__all__ = [
    "SPECIAL_TOKENS",
    "MAX_PIECE_CHARS",
    "DEFAULT_EXTENSIONS",
    "TEXT_FIELDS",
    "TAILS",
    "CodeDocument",
    "SkippedDocument",
    "SKIP_REASONS",
    "read_counts",
    "SpecialIds",
    "PackedBlocks",
    "MaskingCollator",
    "CodeData",
    "default_source_dir",
    "read_code",
    "split_of",
    "train_tokenizer",
    "load_or_train_tokenizer",
    "special_ids",
    "pack_documents",
    "mask_tokens",
    "build_code_data",
]

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
DEFAULT_EXTENSIONS = (".py",)
TEXT_FIELDS = ("code", "original_string")
TAILS = ("pad", "drop")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TOKENIZER_FORMAT = 2
MAX_PIECE_CHARS = 256
"""The longest pre-tokenised piece the BPE tokenizer sees: a longer one (a minified line, a data blob) is cut
into pieces of at most this many characters, since BPE training time grows with the square of a piece's
length (a one-megabyte token took minutes)."""
_MIN_FREQUENCY = 2
_IGNORE = -100


@dataclass(frozen=True)
class CodeDocument:
    """One text to train on; ``key`` decides its split (module docstring)."""

    key: str
    text: str


SKIP_REASONS = ("not_utf8", "unreadable", "bad_line", "empty")


@dataclass(frozen=True)
class SkippedDocument:
    """A file, JSON line or empty text left out; ``key`` is its split key, ``reason`` one of
    :data:`SKIP_REASONS`."""

    key: str
    reason: str


def read_counts(documents: Sequence[CodeDocument], skipped: Sequence[SkippedDocument]) -> dict[str, int]:
    """``{"read": n, "skipped": k}`` plus ``"skipped_<reason>"`` for each of :data:`SKIP_REASONS`."""
    counts = {"read": len(documents), "skipped": len(skipped)}
    for reason in SKIP_REASONS:
        counts[f"skipped_{reason}"] = sum(entry.reason == reason for entry in skipped)
    return counts


def _unit_hash(*parts: object) -> float:
    """A fraction in ``[0, 1)`` from SHA-256 of ``parts`` (stable across runs and platforms)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(key: str, validation_fraction: float) -> str:
    """``"validation"`` or ``"train"`` for a document key (module docstring)."""
    return "validation" if _unit_hash("split", key) < validation_fraction else "train"


def default_source_dir() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith(_JSONL_SUFFIXES)


def _check_extensions(extensions: object) -> tuple[str, ...]:
    if isinstance(extensions, str) or not isinstance(extensions, Sequence) or not extensions:
        raise ValueError(f"extensions must be a non-empty list like ['.py'], got {extensions!r}")
    for extension in extensions:
        if not isinstance(extension, str) or not extension.startswith(".") or len(extension) < 2:
            raise ValueError(f"extensions must be strings starting with '.', like '.py', got {extension!r}")
    return tuple(extensions)


def _check_cap(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None (no cap), got {value!r}")
    return value


def _source_files(root: Path, extensions: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with one of ``extensions`` or a JSON-lines suffix, in hash order of their path;
    folders named in :data:`_EXCLUDED_DIRS` and hidden folders are not entered."""
    if root.is_file():
        return [root]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in _EXCLUDED_DIRS and name[0] != ".")
        files += [Path(folder, name) for name in names if name.endswith(extensions) or _is_jsonl(Path(name))]
    return sorted(files, key=lambda path: (_unit_hash("order", path.relative_to(root).as_posix()), path))


def _record_text(record: object) -> str | None:
    if not isinstance(record, dict):
        return None
    for name in TEXT_FIELDS:
        if isinstance(record.get(name), str):
            return record[name]
    return None


def _read_file(file: Path, relative: str) -> CodeDocument | SkippedDocument:
    try:
        return CodeDocument(relative, file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return SkippedDocument(relative, "not_utf8")
    except OSError:
        return SkippedDocument(relative, "unreadable")


def _jsonl_documents(
    path: Path, relative: str, skip_bad_lines: bool, skipped: list[SkippedDocument]
) -> Iterator[CodeDocument]:
    with open_data(path) as file:
        for number, raw in numbered_lines(file, path):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                problem = f"not valid JSON ({error})"
                record = None
            else:
                problem = f"a JSON object with a string field among {list(TEXT_FIELDS)}"
                problem = None if _record_text(record) is not None else f"expected {problem}"
            if problem is not None:
                if not skip_bad_lines:
                    raise ValueError(f"{path}: line {number}: {problem}")
                skipped.append(SkippedDocument(f"{relative}:{number}", "bad_line"))
                continue
            repo, name = record.get("repo"), record.get("path")
            key = (
                f"{repo}/{name}"
                if isinstance(repo, str) and isinstance(name, str)
                else f"{relative}:{number}"
            )
            yield CodeDocument(key, _record_text(record))


def read_code(
    path: str | Path | None = None,
    *,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    skip_bad_lines: bool = False,
    max_files: int | None = None,
    max_bytes: int | None = None,
) -> tuple[list[CodeDocument], list[SkippedDocument]]:
    """Read code documents from ``path`` (module docstring); None reads the standard library.

    Args:
        path: a ``*.jsonl`` / ``*.jsonl.gz`` file, or a folder of source files and JSON-lines files.
        extensions: file name endings of source files in a folder.
        skip_bad_lines: skip (and count) bad JSON lines instead of raising.
        max_files: read at most this many files (None: all).
        max_bytes: stop once the texts read hold this many UTF-8 bytes (None: no cap).

    Returns:
        The documents read and those skipped (files not valid UTF-8 or unreadable, bad JSON lines when
        skipped, empty texts).

    Raises:
        FileNotFoundError: ``path`` does not exist. ValueError: a bad JSON line (file and line named) unless
            skipped, a truncated or corrupt gzip file (named), or bad arguments.
    """
    extensions = _check_extensions(extensions)
    max_files, max_bytes = _check_cap(max_files, "max_files"), _check_cap(max_bytes, "max_bytes")
    root = default_source_dir() if path is None else Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data path {root} does not exist")
    skipped: list[SkippedDocument] = []
    documents: list[CodeDocument] = []
    size = 0
    for file in _source_files(root, extensions)[:max_files]:
        relative = file.name if root.is_file() else file.relative_to(root).as_posix()
        if _is_jsonl(file) and os.access(file, os.R_OK):
            found = _jsonl_documents(file, relative, skip_bad_lines, skipped)
        else:
            document = _read_file(file, relative)
            if isinstance(document, SkippedDocument):
                skipped.append(document)
                continue
            found = [document]
        for document in found:
            if not document.text.strip():
                skipped.append(SkippedDocument(document.key, "empty"))
                continue
            documents.append(document)
            size += len(document.text.encode("utf-8"))
            if max_bytes is not None and size >= max_bytes:
                return documents, skipped
    return documents, skipped


def _check_vocab_size(vocab_size: object) -> int:
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS) + 1
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(
            f"vocab_size must be an int >= {smallest} (256 bytes + {len(SPECIAL_TOKENS)} special tokens + 1 "
            f"merge), got {vocab_size!r}"
        )
    return vocab_size


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with :data:`SPECIAL_TOKENS` (ids 0..4) trained on ``texts``.

    Its pre-tokeniser is GPT-2's byte-level one, with pieces longer than :data:`MAX_PIECE_CHARS` cut into
    pieces of at most that length (in training and in encoding alike). Its vocabulary has at most
    ``vocab_size`` tokens (fewer when the texts support fewer merges).
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


def load_or_train_tokenizer(
    train_documents: Sequence[CodeDocument],
    vocab_size: int,
    cache_dir: str | Path,
    tokenizer_file: str | Path | None = None,
) -> tuple[Tokenizer, Path, bool]:
    """The tokenizer to use: ``tokenizer_file`` if given, else the cached one trained on the same documents
    with the same ``vocab_size``, else a newly trained one written to ``cache_dir``.

    Returns:
        ``(tokenizer, path of its tokenizer.json, whether it was read rather than trained)``.
    """
    if tokenizer_file is not None:
        path = Path(tokenizer_file)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer_file {path} does not exist")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:
            raise ValueError(f"tokenizer_file {path}: not a tokenizers tokenizer.json ({error})") from None
        special_ids(tokenizer)
        return tokenizer, path, True
    vocab_size = _check_vocab_size(vocab_size)
    if not train_documents:
        raise ValueError("cannot train a tokenizer: the training split has no documents")
    ordered = sorted(train_documents, key=lambda document: document.key)
    digest = _documents_digest(ordered, "code-bpe", _TOKENIZER_FORMAT, vocab_size, _MIN_FREQUENCY)
    path = Path(cache_dir) / f"code-bpe-{vocab_size}-{digest}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path)), path, True
    tokenizer = train_tokenizer((document.text for document in train_documents), vocab_size)
    atomic_write_bytes(path, tokenizer.to_str().encode())
    return tokenizer, path, False


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens of a tokenizer, and its vocabulary size."""

    bos: int
    pad: int
    eos: int
    unk: int
    mask: int
    vocab_size: int

    @property
    def all(self) -> tuple[int, ...]:
        """Every special id."""
        return (self.bos, self.pad, self.eos, self.unk, self.mask)

    @cached_property
    def ordinary(self) -> torch.Tensor:
        """The ids of all other tokens, ascending: ``(vocab_size - 5,)`` int64."""
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        keep[list(self.all)] = False
        return keep.nonzero().flatten()


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """The ids of :data:`SPECIAL_TOKENS` in ``tokenizer``; ``ValueError`` naming any that is missing."""
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    missing = [token for token, index in ids.items() if index is None]
    if missing:
        raise ValueError(
            f"the tokenizer lacks the special token(s) {missing}; it needs all of {SPECIAL_TOKENS}"
        )
    return SpecialIds(*(ids[token] for token in SPECIAL_TOKENS), vocab_size=tokenizer.get_vocab_size())


@dataclass(frozen=True)
class PackedBlocks(Dataset):
    """Fixed-length token blocks of one split (a map-style dataset).

    Attributes:
        tokens: ``(N, seq_len)`` int32 token ids, ``<pad>`` after ``lengths``.
        lengths: ``(N,)`` int64 number of real tokens per block.
        fixed_masking: mask each block the same way every time (evaluation) or anew per batch (training).
        dropped_tokens: document tokens left out by ``tail="drop"``.

    Items are ``{"input_ids": (seq_len,) int64, "length": int, "index": int, "fixed_masking": bool}``.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    fixed_masking: bool = False
    dropped_tokens: int = 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} blocks")
        index %= len(self)
        return {
            "input_ids": self.tokens[index].long(),
            "length": int(self.lengths[index]),
            "index": index,
            "fixed_masking": self.fixed_masking,
        }

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens over all blocks."""
        return int(self.lengths.sum())


def pack_documents(
    documents: Sequence[Sequence[int]],
    seq_len: int,
    ids: SpecialIds,
    *,
    tail: str = "pad",
    fixed_masking: bool = False,
) -> PackedBlocks:
    """Pack token-id lists into blocks ``<s> doc_1 </s> doc_2 </s> ...`` of ``seq_len`` tokens.

    Each document's tokens, then ``</s>``, enter one stream, cut into pieces of ``seq_len - 1`` tokens, each
    behind a ``<s>``. A short last piece is padded with ``<pad>`` (``tail="pad"``) or dropped
    (``tail="drop"``); empty documents add nothing.

    Returns:
        :class:`PackedBlocks` of shape ``(N, seq_len)``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (<s> and one token), got {seq_len!r}")
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    pieces = [
        torch.tensor(list(document) + [ids.eos], dtype=torch.int32) for document in documents if document
    ]
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    body = seq_len - 1
    full, rest = divmod(stream.numel(), body)
    dropped = 0
    if rest and tail == "drop":
        dropped, stream = rest, stream[: full * body]
    elif rest:
        stream = torch.cat([stream, torch.full((body - rest,), ids.pad, dtype=torch.int32)])
        full += 1
    blocks = torch.cat([torch.full((full, 1), ids.bos, dtype=torch.int32), stream.reshape(full, body)], dim=1)
    lengths = torch.full((full,), seq_len, dtype=torch.int64)
    if rest and tail == "pad":
        lengths[-1] = 1 + rest
    return PackedBlocks(blocks, lengths, fixed_masking, dropped)


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    ids: SpecialIds,
    generator: torch.Generator,
    *,
    mask_probability: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of ``input_ids`` where ``maskable`` is True (module docstring).

    Args:
        input_ids: ``(*)`` int64 token ids.
        maskable: ``(*)`` bool, False at special and padding tokens.
        ids: the tokenizer's special ids; random replacements are drawn uniformly from the ordinary tokens.
        generator: the source of randomness.
        mask_probability: chance of choosing a maskable token, in ``(0, 1)``.

    Returns:
        ``(masked input ids, labels)``, both ``(*)`` int64; labels are -100 where nothing was chosen.
    """
    chosen = maskable & (torch.rand(input_ids.shape, generator=generator) < mask_probability)
    kind = torch.rand(input_ids.shape, generator=generator)
    random_tokens = ids.ordinary[torch.randint(len(ids.ordinary), input_ids.shape, generator=generator)]
    masked = torch.where(chosen & (kind < 0.8), ids.mask, input_ids)
    masked = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_tokens, masked)
    labels = torch.where(chosen, input_ids, _IGNORE)
    return masked, labels


def _seed(*parts: int) -> int:
    digest = hashlib.sha256(struct.pack(f">{len(parts)}q", *parts)).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class MaskingCollator:
    """``collate_fn`` turning :class:`PackedBlocks` items into a masked-LM batch (module docstring).

    Args:
        ids: the tokenizer's special ids.
        mask_probability: chance of choosing each maskable token, in ``(0, 1)``.
        seed: base seed of all masks.
        epoch: mixed into the seeds of training masks (:meth:`set_epoch`); evaluation masks ignore it.

    Returns (on call with a list of items):
        ``{"input_ids", "attention_mask", "labels"}``, each ``(B, seq_len)`` int64.
    """

    ids: SpecialIds
    mask_probability: float = 0.15
    seed: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        probability = self.mask_probability
        if (
            isinstance(probability, bool)
            or not isinstance(probability, (int, float))
            or not 0 < probability < 1
        ):
            raise ValueError(f"mask_probability must be a float in (0, 1), got {probability!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def set_epoch(self, epoch: int) -> None:
        """Make the masks of training batches depend on ``epoch`` too."""
        self.epoch = int(epoch)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        input_ids = torch.stack([sample["input_ids"] for sample in samples])
        positions = torch.arange(input_ids.shape[1])
        attention_mask = (positions < torch.tensor([sample["length"] for sample in samples])[:, None]).long()
        maskable = attention_mask.bool() & ~torch.isin(input_ids, torch.tensor(self.ids.all))
        indices = [int(sample["index"]) for sample in samples]
        batch_seed = _seed(self.seed, self.epoch, *indices)
        masked, labels = [], []
        for row, sample in enumerate(samples):
            seed = (
                _seed(self.seed, indices[row]) if sample["fixed_masking"] else _seed(batch_seed, indices[row])
            )
            generator = torch.Generator().manual_seed(seed)
            row_ids, row_labels = mask_tokens(
                input_ids[row], maskable[row], self.ids, generator, mask_probability=self.mask_probability
            )
            masked.append(row_ids)
            labels.append(row_labels)
        return {
            "input_ids": torch.stack(masked),
            "attention_mask": attention_mask,
            "labels": torch.stack(labels),
        }


@dataclass
class CodeData:
    """Everything :func:`build_code_data` prepares.

    Attributes:
        train, validation: the packed splits (validation with fixed masking).
        collator: the masking ``collate_fn`` for both.
        tokenizer, tokenizer_path: the tokenizer and its ``tokenizer.json``.
        ids: its special ids and vocabulary size.
        info: counts per split (:func:`read_counts`, skipped entries assigned to splits by their key;
            ``tokens``, ``blocks``, ``dropped_tokens``), the vocabulary size, the tokenizer path and
            whether it came from the cache.
    """

    train: PackedBlocks
    validation: PackedBlocks
    collator: MaskingCollator
    tokenizer: Tokenizer
    tokenizer_path: Path
    ids: SpecialIds
    info: dict[str, Any]


def _encode(tokenizer: Tokenizer, documents: Sequence[CodeDocument]) -> list[list[int]]:
    encodings = tokenizer.encode_batch_fast(
        [document.text for document in documents], add_special_tokens=False
    )
    return [encoding.ids for encoding in encodings]


def _documents_digest(documents: Sequence[CodeDocument], *settings: object) -> str:
    """Digest of ``settings`` and the documents' keys and contents, in order."""
    digest = hashlib.sha256("/".join(map(str, settings)).encode())
    for document in documents:
        digest.update(document.key.encode() + b"\0")
        digest.update(hashlib.sha256(document.text.encode("utf-8")).digest())
    return digest.hexdigest()[:16]


def _encode_cached(
    tokenizer: Tokenizer, documents: Sequence[CodeDocument], cache_dir: Path
) -> list[list[int]]:
    """Token ids of ``documents``, read from or written to ``cache_dir`` (``.npz`` of plain arrays, keyed by
    the tokenizer and the documents)."""
    tokenizer_digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    path = cache_dir / f"code-tokens-{_documents_digest(documents, 'tokens', tokenizer_digest)}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as stored:
            ids, offsets = stored["ids"], stored["offsets"]
        return [ids[start:end].tolist() for start, end in zip(offsets[:-1], offsets[1:])]
    encoded = _encode(tokenizer, documents)
    offsets = np.cumsum([0] + [len(ids) for ids in encoded], dtype=np.int64)
    flat = np.fromiter((token for ids in encoded for token in ids), dtype=np.int32, count=int(offsets[-1]))
    buffer = io.BytesIO()
    np.savez(buffer, ids=flat, offsets=offsets)
    atomic_write_bytes(path, buffer.getvalue())
    return encoded


def build_code_data(
    path: str | Path | None = None,
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None = None,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    validation_fraction: float = 0.05,
    max_files: int | None = None,
    max_bytes: int | None = None,
    skip_bad_lines: bool = False,
    tail: str = "pad",
    mask_probability: float = 0.15,
    seed: int = 0,
) -> CodeData:
    """Read, split, tokenize and pack code for masked-LM pre-training (module docstring).

    Args:
        path: data file or folder (None: the standard library); see :func:`read_code`.
        cache_dir: where the trained tokenizer and the token ids of each split are cached.
        seq_len: tokens per block (the model's maximum length).
        vocab_size: BPE vocabulary size to train (ignored with ``tokenizer_file``).
        tokenizer_file: a ``tokenizer.json`` to use instead of training one.
        extensions, max_files, max_bytes, skip_bad_lines: as :func:`read_code`.
        validation_fraction: share of documents (by key hash) in validation, in ``(0, 1)``.
        tail: ``"pad"`` or ``"drop"`` for the short last block of each split (:func:`pack_documents`).
        mask_probability, seed: of the :class:`MaskingCollator`.

    Raises:
        ValueError: a split has no documents (naming the counts), or a bad argument or input line.
    """
    if not isinstance(validation_fraction, (int, float)) or not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be a float in (0, 1), got {validation_fraction!r}")
    documents, skipped = read_code(
        path, extensions=extensions, skip_bad_lines=skip_bad_lines, max_files=max_files, max_bytes=max_bytes
    )
    splits: dict[str, list[CodeDocument]] = {"train": [], "validation": []}
    for document in documents:
        splits[split_of(document.key, validation_fraction)].append(document)
    counts = {
        name: read_counts(
            split, [entry for entry in skipped if split_of(entry.key, validation_fraction) == name]
        )
        for name, split in splits.items()
    }
    for name, split in splits.items():
        if not split:
            raise ValueError(
                f"the {name} split has no documents ({len(documents)} read from "
                f"{path or default_source_dir()}, validation_fraction={validation_fraction}); add data or "
                "change validation_fraction"
            )
    tokenizer, tokenizer_path, cached = load_or_train_tokenizer(
        splits["train"], vocab_size, cache_dir, tokenizer_file
    )
    ids = special_ids(tokenizer)
    packed = {
        name: pack_documents(
            _encode_cached(tokenizer, split, Path(cache_dir)),
            seq_len,
            ids,
            tail=tail,
            fixed_masking=name == "validation",
        )
        for name, split in splits.items()
    }
    info: dict[str, Any] = {
        name: {
            **counts[name],
            "tokens": blocks.num_tokens,
            "blocks": len(blocks),
            "dropped_tokens": blocks.dropped_tokens,
        }
        for name, blocks in packed.items()
    }
    info.update(vocab_size=ids.vocab_size, tokenizer=str(tokenizer_path), tokenizer_cached=cached)
    collator = MaskingCollator(ids, mask_probability=mask_probability, seed=seed)
    return CodeData(packed["train"], packed["validation"], collator, tokenizer, tokenizer_path, ids, info)
