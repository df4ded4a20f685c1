"""Sentence pairs (:class:`PairExamples`, the tokenised :class:`PairDataset` with exact-match flags,
:class:`PadCollate`) and the embedded task built from the standard library, the default when no data is
given: does this docstring describe this function's code? Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from comera.checks import check_int, check_number
from comera.data.cache import building_folder, read_entry, read_json
from comera.data.tokenize import (
    MAX_VOCAB_SIZE,
    MIN_PAIR_LENGTH,
    SPECIAL_TOKENS,
    PairTokenizer,
    load_tokenizer,
    train_wordpiece,
)

__all__ = [
    "PAIR_LABELS",
    "PairExamples",
    "PairDataset",
    "PadCollate",
    "exact_match_flags",
    "DocumentedFunction",
    "documented_functions",
    "stdlib_modules",
    "build_docstring_pairs",
]

PAIR_LABELS = ("doesn't match", "matches")
_FORMAT = 1
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
_MAX_DOC_CHARS = 600
_MAX_CODE_CHARS = 1500


@dataclass
class PairExamples:
    """Sentence pairs with integer labels, and how many source lines were read and skipped
    (``skipped_reasons``: "no gold label", "empty sentence", "malformed").
    """

    first: list[str] = field(default_factory=list)
    second: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    read: int = 0
    skipped: int = 0
    skipped_reasons: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)

    def add(self, first: str, second: str, label: int) -> None:
        self.first.append(first)
        self.second.append(second)
        self.labels.append(label)

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + 1

    def counts(self) -> dict[str, int]:
        """``{"read": lines read, "skipped": lines skipped}``."""
        return {"read": self.read, "skipped": self.skipped}


def exact_match_flags(ids: Sequence[int], types: Sequence[int], ignore: Collection[int] = ()) -> list[int]:
    """1 for each token whose id also occurs in the other segment of its pair (by token type), else 0; ids in
    ``ignore`` (the special tokens) are never flagged. ``ids``, ``types`` and the result have length L.
    """
    if len(ids) != len(types):
        raise ValueError(f"ids and types must have the same length, got {len(ids)} and {len(types)}")
    first = {t for t, kind in zip(ids, types) if kind == 0}
    second = {t for t, kind in zip(ids, types) if kind == 1}
    shared = (first & second).difference(ignore)
    return [int(t in shared) for t in ids]


class PairDataset(Dataset):
    """Tokenised sentence pairs (stored flat as int32) with labels and exact-match flags: ``dataset[i]`` is
    ``{"input_ids", "token_type_ids", "exact_match_ids": (L,) int64, "labels": () int64}`` with ``L <=
    tokenizer.max_length``.
    """

    def __init__(self, examples: PairExamples, tokenizer: PairTokenizer) -> None:
        encoded = tokenizer.encode_pairs(examples.first, examples.second)
        special = tokenizer.special_ids()
        lengths = torch.tensor([len(ids) for ids, _ in encoded], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.ids = torch.tensor([token for ids, _ in encoded for token in ids], dtype=torch.int32)
        self.types = torch.tensor([kind for _, types in encoded for kind in types], dtype=torch.int8)
        flags = [flag for ids, types in encoded for flag in exact_match_flags(ids, types, special)]
        self.matches = torch.tensor(flags, dtype=torch.int8)
        self.labels = torch.tensor(examples.labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return {
            "input_ids": self.ids[start:end].long(),
            "token_type_ids": self.types[start:end].long(),
            "exact_match_ids": self.matches[start:end].long(),
            "labels": self.labels[index],
        }

    def lengths(self) -> torch.Tensor:
        """Tokens of every pair, ``(N,)`` int64."""
        return self.offsets.diff()


@dataclass(frozen=True)
class PadCollate:
    """Batches :class:`PairDataset` samples, padding to the batch's longest sequence: ``{"input_ids",
    "token_type_ids", "exact_match_ids", "attention_mask": (B, T), "labels": (B,)}``, all int64 (padding:
    id ``pad_id``, type 0, flag 0, mask 0; no ``exact_match_ids`` when the samples have none).
    """

    pad_id: int

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(sample["input_ids"]) for sample in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.int64)
        types = torch.zeros((len(samples), longest), dtype=torch.int64)
        mask = torch.zeros((len(samples), longest), dtype=torch.int64)
        with_matches = all("exact_match_ids" in sample for sample in samples)
        matches = torch.zeros((len(samples), longest), dtype=torch.int64)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n] = sample["input_ids"]
            types[row, :n] = sample["token_type_ids"]
            mask[row, :n] = 1
            if with_matches:
                matches[row, :n] = sample["exact_match_ids"]
        labels = torch.stack([sample["labels"] for sample in samples])
        batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels}
        if with_matches:
            batch["exact_match_ids"] = matches
        return batch


@dataclass(frozen=True)
class DocumentedFunction:
    """A function's name, cleaned docstring and code (its source without the docstring)."""

    name: str
    doc: str
    code: str


def stdlib_modules(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of the ``.py`` files under ``root``, without tests and site-packages."""
    modules = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _EXCLUDED_DIRS]
        for file in files:
            if file.endswith(".py") and not file.startswith("test_"):
                parts = (Path(folder) / file).relative_to(root).parts
                modules[".".join(parts).removesuffix(".py").removesuffix(".__init__")] = Path(folder) / file
    return dict(sorted(modules.items()))


def _functions(body: list[ast.stmt]):
    """The function definitions among ``body`` and the statements nested in it, in source order."""
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield statement
        for name in ("body", "orelse", "finalbody", "handlers"):
            nested = getattr(statement, name, None)
            if isinstance(nested, list):
                yield from _functions(nested)


def _code_without_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    docstring = node.body[0]
    rest = node.body[1:]
    if docstring.lineno == node.lineno or not rest:
        return None
    if all(
        isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        for s in rest
    ):
        return None
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    kept = lines[start - 1 : docstring.lineno - 1] + lines[docstring.end_lineno : node.end_lineno]
    code = textwrap.dedent("\n".join(line for line in kept if line.strip()))
    return code[:_MAX_CODE_CHARS]


def documented_functions(source: str, min_doc_words: int = 3) -> list[DocumentedFunction]:
    """The functions and methods of ``source`` whose docstring has at least ``min_doc_words`` words, but for
    bodies that are only the docstring (or ``pass`` / ``...``) and repeats; ``[]`` when ``source`` does not
    parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found, seen = [], set()
    for node in _functions(tree.body):
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(doc.split()) < min_doc_words:
            continue
        code = _code_without_docstring(lines, node)
        doc = re.sub(r"\s+", " ", doc).strip()[:_MAX_DOC_CHARS]
        if code is None or doc in seen or code in seen:
            continue
        seen.update((doc, code))
        found.append(DocumentedFunction(node.name, doc, code))
    return found


def _module_hash(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def _pairs(
    modules: list[tuple[str, list[DocumentedFunction]]], seed: int, same_module: float
) -> PairExamples:
    """A positive and a negative pair for every function. The negative's code comes from another function
    of the same module with probability ``same_module``, else from a function of another of ``modules``;
    each module's draws come from an RNG seeded by the seed and the module's name."""
    examples = PairExamples()
    for position, (name, functions) in enumerate(modules):
        rng = random.Random(f"{seed}:{name}")
        for index, function in enumerate(functions):
            if len(modules) == 1 or rng.random() < same_module:
                other = functions[rng.choice([j for j in range(len(functions)) if j != index])]
            else:
                elsewhere = rng.choice([j for j in range(len(modules)) if j != position])
                other = rng.choice(modules[elsewhere][1])
            examples.add(function.doc, function.code, 1)
            examples.add(function.doc, other.code, 0)
    return examples


def _collect(
    modules: list[tuple[str, Path]], pairs: int, seed: int, min_doc_words: int, same_module: float
) -> tuple[PairExamples, list[str]]:
    """Pairs from ``modules`` in order until there are ``pairs`` (even: a positive and its negative)."""
    found, count = [], 0
    for name, file in modules:
        if count >= pairs:
            break
        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        functions = documented_functions(source, min_doc_words)
        if len(functions) >= 2:
            found.append((name, functions))
            count += 2 * len(functions)
    examples = _pairs(found, seed, same_module)
    keep = min(len(examples), pairs - pairs % 2)
    examples = PairExamples(examples.first[:keep], examples.second[:keep], examples.labels[:keep], read=keep)
    return examples, [name for name, _ in found]


def build_docstring_pairs(
    cache_dir: str | os.PathLike,
    *,
    train_pairs: int = 4000,
    validation_pairs: int = 2000,
    validation_fraction: float = 0.25,
    vocab_size: int = 8192,
    max_length: int = 128,
    min_doc_words: int = 3,
    same_module_negatives: float = 1.0,
    seed: int = 0,
    stdlib: str | os.PathLike | None = None,
) -> tuple[dict[str, PairExamples], PairTokenizer, dict]:
    """The embedded task's splits, its tokenizer and a description, built once and cached in ``cache_dir``.

    Args:
        cache_dir: folder for the cached pairs and vocabulary (created if needed).
        train_pairs / validation_pairs: pairs wanted per split (even; fewer when the library runs out).
        validation_fraction: share of modules assigned to validation, in (0, 1).
        vocab_size: WordPiece vocabulary size to train (at most; special tokens included).
        max_length: the tokenizer's longest encoding.
        min_doc_words: shortest docstring kept, in words.
        same_module_negatives: share of negatives whose code comes from the docstring's own module (hard);
            the rest come from other modules of the same split. In [0, 1].
        seed: changes the module split and the negatives.
        stdlib: the library to read (default: the running Python's standard library).

    Returns:
        ``({"train": ..., "validation": ...}, tokenizer, info)``; ``info`` has the Python version, the
        modules per split and the cache folder.
    """
    check_int(train_pairs, "train_pairs", 2)
    check_int(validation_pairs, "validation_pairs", 2)
    check_int(vocab_size, "vocab_size", len(SPECIAL_TOKENS) + 1, MAX_VOCAB_SIZE)
    check_int(max_length, "max_length", MIN_PAIR_LENGTH)
    check_number(validation_fraction, "validation_fraction", 0.0, 1.0, open_low=True, open_high=True)
    check_number(same_module_negatives, "same_module_negatives", 0.0, 1.0)
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib folder {root} does not exist")
    settings = {
        "format": _FORMAT,
        "python": sys.version,
        "stdlib": str(root.resolve()),
        "train_pairs": train_pairs,
        "validation_pairs": validation_pairs,
        "validation_fraction": validation_fraction,
        "vocab_size": vocab_size,
        "min_doc_words": min_doc_words,
        "same_module_negatives": same_module_negatives,
        "seed": seed,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / f"docstring-pairs-{key}"
    cached = read_entry(folder, _read_cached, folder=True)
    if cached is not None:
        splits, tokenizer, info = cached
        return splits, PairTokenizer(tokenizer, max_length), info
    ranked = sorted(stdlib_modules(root).items(), key=lambda item: _module_hash(seed, item[0]))
    limit = int(validation_fraction * 2**64)
    sides = {
        "train": [item for item in ranked if _module_hash(seed + 1, item[0]) >= limit],
        "validation": [item for item in ranked if _module_hash(seed + 1, item[0]) < limit],
    }
    wanted = {"train": train_pairs, "validation": validation_pairs}
    splits, modules = {}, {}
    for split, candidates in sides.items():
        splits[split], modules[split] = _collect(
            candidates, wanted[split], seed, min_doc_words, same_module_negatives
        )
    tokenizer = _kept_tokenizer(folder / "tokenizer.json") or train_wordpiece(
        splits["train"].first + splits["train"].second[::2], vocab_size
    )
    info = {"source": str(root), "python": sys.version.split()[0], "modules": modules, "cache": str(folder)}
    record = {"splits": {name: vars(examples) for name, examples in splits.items()}, "info": info}
    with building_folder(folder) as work:
        tokenizer.save(str(work / "tokenizer.json"))
        (work / "pairs.json").write_bytes(json.dumps(record).encode())
    return splits, PairTokenizer(tokenizer, max_length), info


def _kept_tokenizer(file: Path) -> Tokenizer | None:
    """The vocabulary in ``file`` of a damaged cache folder where it can still be read, else None: trained
    again, it may number (or choose) its pieces differently, so a run on the rebuilt folder gets the ids of
    one on the intact folder."""
    if not file.is_file():  # missing, or a pipe (reading it would wait forever)
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception:  # the tokenizers package raises a bare Exception
        return None


def _read_cached(folder: Path) -> tuple[dict[str, PairExamples], Tokenizer, dict]:
    """The splits, tokenizer and description of the embedded task cached in ``folder``; ``ValueError``
    naming the file that is damaged. It reads only: the run's settings (``max_length``) are applied after,
    so that a bad setting is never taken for a damaged entry."""
    file = folder / "pairs.json"
    record = read_json(file)
    try:
        splits = {name: PairExamples(**record["splits"][name]) for name in ("train", "validation")}
        info = {**record["info"]}
    except (TypeError, KeyError) as error:
        raise ValueError(f"{file} does not hold the pairs of the embedded task ({error!r})") from None
    return splits, load_tokenizer(folder / "tokenizer.json").tokenizer, info
