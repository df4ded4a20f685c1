"""Sentence-pair tokenisation with the ``tokenizers`` library, from local files only: :class:`PairTokenizer`
encodes ``"[CLS] a [SEP] b [SEP]"`` with token types, truncated longest-first, from a WordPiece
``vocab.txt`` or a ``tokenizer.json`` (its padding, truncation and post-processor replaced). Details:
docs/recipes.md, 'Workloads (recipes)'.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import WordPiece
from tokenizers.processors import TemplateProcessing
from tokenizers.trainers import WordPieceTrainer

from comera.checks import check_int
from comera.data.files import utf8_problem, without_bom

__all__ = [
    "MAX_VOCAB_SIZE",
    "MIN_PAIR_LENGTH",
    "SPECIAL_TOKENS",
    "PairTokenizer",
    "bert_wordpiece",
    "load_tokenizer",
    "tokenizer_digest",
    "train_wordpiece",
]

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
MAX_VOCAB_SIZE = 2**20
"""The largest vocabulary a tokenizer is trained to (1,048,576; 30x the 32,000 of the largest preset): the
tokenizers trainers allocate for the size asked, and 10**9 ends the process in an out-of-memory abort."""
MIN_PAIR_LENGTH = 4
"""The shortest ``max_length`` of a :class:`PairTokenizer`: ``[CLS]``, two ``[SEP]`` and one piece."""
# Pairs encoded per call: a truncated encoding keeps its overflowing pieces, so encoding a whole split of long
# texts at once held ~1.4 GB for 9,000 docstring-code pairs; in chunks only one chunk's encodings are alive.
_ENCODE_CHUNK = 128
VOCAB_FILE = "vocab.txt"
TOKENIZER_FILE = "tokenizer.json"


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """SHA-256 (hex) of ``tokenizer``'s serialised form (vocabulary, merges, normaliser, pre-tokeniser): what
    a run records, since a tokenizer trained again from the same texts may number its pieces differently.
    """
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def bert_wordpiece(vocab: dict[str, int] | None = None, *, lowercase: bool = True) -> Tokenizer:
    """A BERT-style WordPiece tokenizer over ``vocab`` (an empty model, for training, when None)."""
    model = WordPiece(vocab, unk_token=UNK) if vocab is not None else WordPiece(unk_token=UNK)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def train_wordpiece(texts: Iterable[str], vocab_size: int, *, lowercase: bool = True) -> Tokenizer:
    """A BERT-style WordPiece tokenizer whose vocabulary (at most ``vocab_size``, special tokens first, so
    [PAD] is 0) is trained on ``texts``; pieces seen fewer than twice, and words longer than 100 characters
    (which encode as [UNK] and train in quadratic time), are left out.
    """
    tokenizer = bert_wordpiece(lowercase=lowercase)
    longest = tokenizer.model.max_input_chars_per_word
    splitter = tokenizer.pre_tokenizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [splitter, pre_tokenizers.Split(Regex(f"[\\s\\S]{{{longest + 1},}}"), behavior="removed")]
    )
    trainer = WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.pre_tokenizer = splitter
    return tokenizer


def _read_vocab(path: Path) -> dict[str, int]:
    vocab: dict[str, int] = {}
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                token = (without_bom(raw) if number == 1 else raw).decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: {utf8_problem(error)}") from None
            if not token:
                raise ValueError(f"{path}:{number}: empty line in a WordPiece vocabulary")
            if token in vocab:
                raise ValueError(
                    f"{path}:{number}: token {token!r} repeats line {vocab[token] + 1}; each line of a "
                    "WordPiece vocabulary is one token, its id the line number (weights trained with this "
                    "file would read every later id shifted)"
                )
            vocab[token] = number - 1
    return vocab


def _locate(path: Path) -> Path:
    if path.is_dir():
        for name in (TOKENIZER_FILE, VOCAB_FILE):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path}: holds neither {TOKENIZER_FILE} nor {VOCAB_FILE}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer file not found")
    return path


class PairTokenizer:
    """Encodes sentence pairs as ``[CLS] a [SEP] b [SEP]`` with token types, truncated longest-first.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` whose vocabulary holds [PAD], [CLS] and [SEP] (it is modified:
            post-processor, padding and truncation are set here).
        max_length: the longest encoding, special tokens included; at least 4.
    """

    def __init__(self, tokenizer: Tokenizer, max_length: int = 128) -> None:
        check_int(max_length, "max_length", MIN_PAIR_LENGTH)
        missing = [token for token in (PAD, CLS, SEP) if tokenizer.token_to_id(token) is None]
        if missing:
            raise ValueError(f"the tokenizer's vocabulary lacks the special token(s) {missing}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = tokenizer.token_to_id(PAD)
        self.cls_id = tokenizer.token_to_id(CLS)
        self.sep_id = tokenizer.token_to_id(SEP)
        tokenizer.post_processor = TemplateProcessing(
            single=f"{CLS} $A {SEP}",
            pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
            special_tokens=[(CLS, self.cls_id), (SEP, self.sep_id)],
        )
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length, strategy="longest_first")

    @property
    def vocab_size(self) -> int:
        """Rows an embedding needs: the vocabulary with added tokens."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def special_ids(self) -> set[int]:
        """The ids of the vocabulary's special tokens (:data:`SPECIAL_TOKENS` that it holds)."""
        ids = (self.tokenizer.token_to_id(token) for token in SPECIAL_TOKENS)
        return {index for index in ids if index is not None}

    def encode_pairs(self, first: Sequence[str], second: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """``(ids, token_type_ids)`` of each pair ``(first[i], second[i])``, at most ``max_length`` long."""
        if len(first) != len(second):
            raise ValueError(
                f"first and second must have the same length, got {len(first)} and {len(second)}"
            )
        pairs = list(zip(first, second))
        encoded = []
        for start in range(0, len(pairs), _ENCODE_CHUNK):
            encodings = self.tokenizer.encode_batch(pairs[start : start + _ENCODE_CHUNK])
            encoded.extend((encoding.ids, encoding.type_ids) for encoding in encodings)
        return encoded

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as a ``tokenizer.json`` at ``path``."""
        self.tokenizer.save(str(path))


def load_tokenizer(
    path: str | os.PathLike, *, max_length: int = 128, lowercase: bool = True
) -> PairTokenizer:
    """A :class:`PairTokenizer` from a local ``vocab.txt``, ``tokenizer.json``, or a folder holding one
    (``tokenizer.json`` first); ``lowercase`` applies to ``vocab.txt`` only.
    """
    file = _locate(Path(path))
    if file.suffix == ".json":
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:
            raise ValueError(f"{file}: not a tokenizers tokenizer.json ({error})") from None
    else:
        tokenizer = bert_wordpiece(_read_vocab(file), lowercase=lowercase)
    return PairTokenizer(tokenizer, max_length)
