"""The embedded corpora (the running Python's standard library, read when a run names no ``--data``) prepared
into token shards like any corpus and cached as ``{prefix}-prepared-{digest}/``, in the order and with the
tokenizer of the in-memory build: :func:`prepare_embedded`. Details: docs/llm.md, 'Bringing a corpus' ('The
embedded corpus').
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from comera.data.bpe import load_or_train_tokenizer
from comera.data.cache import building_folder
from comera.data.cached_preparation import preparation_problem
from comera.data.corpus import SkipLog
from comera.data.prepare import INDEX_FORMAT, SPLIT_RULE, PrepareSettings, prepare_documents
from comera.data.saved_dataset import held_out_rule, held_out_rule_text
from comera.data.sources import CodeDocument, documents_digest
from comera.data.tokenize import tokenizer_digest

__all__ = ["EMBEDDED_LAYOUT", "EmbeddedCorpus", "prepare_embedded"]

EMBEDDED_LAYOUT = 1
"""The version of the embedded preparation, in its cache digest: a change of layout prepares again."""


@dataclass(frozen=True)
class EmbeddedCorpus:
    """A prepared embedded corpus.

    Attributes:
        folder: the prepared corpus (``index.json``, ``tokenizer.json``, shards).
        tokenizer: the tokenizer.
        tokenizer_path: its cached ``tokenizer.json`` (or the given one).
        tokenizer_cached: whether the tokenizer was read rather than trained.
        prepared_now: whether the shards were written in this call.
    """

    folder: Path
    tokenizer: Tokenizer
    tokenizer_path: Path
    tokenizer_cached: bool
    prepared_now: bool


def prepare_embedded(
    documents: Sequence[CodeDocument],
    *,
    name: str,
    cache_dir: str | Path,
    prefix: str,
    vocab_size: int,
    validation_fraction: float,
    tokenizer_file: str | Path | None = None,
    held_out: str | None = None,
) -> EmbeddedCorpus:
    """The prepared corpus of ``documents``, from the cache or written to it.

    Args:
        documents: the documents, in the order of their split's stream.
        name: what the index names as the source (``"the standard library of Python 3.11.7"``).
        cache_dir: the cache folder.
        prefix: the cache entry's name prefix (``"lm"``, ``"code"``).
        vocab_size, tokenizer_file: of :func:`comera.data.bpe.load_or_train_tokenizer`.
        validation_fraction: the split (:func:`comera.data.sources.split_of`).
        held_out: a saved ``DatasetDict``'s split that is the validation split instead, or None.

    Raises:
        ValueError: a bad setting, or a split without documents.
    """
    cache_dir = Path(cache_dir)
    split_by = held_out_rule(held_out, validation_fraction)
    train = [document for document in documents if split_by(document.key) == "train"]
    tokenizer, tokenizer_path, cached = load_or_train_tokenizer(train, vocab_size, cache_dir, tokenizer_file)
    digest = hashlib.sha256(
        "/".join(
            map(
                str,
                (
                    documents_digest(documents, "embedded", validation_fraction),
                    tokenizer_digest(tokenizer),
                    INDEX_FORMAT,
                    EMBEDDED_LAYOUT,
                    *([] if held_out is None else [f"held_out={held_out}"]),
                ),
            )
        ).encode()
    ).hexdigest()[:16]
    folder = cache_dir / f"{prefix}-prepared-{digest}"
    if folder.is_dir():
        problem = preparation_problem(folder, cache_dir)
        if problem is None:
            return EmbeddedCorpus(folder, tokenizer, tokenizer_path, cached, False)
        warnings.warn(
            f"cache entry {folder} is damaged and is prepared again from the data ({problem})",
            RuntimeWarning,
            stacklevel=2,
        )

    def read(skipped: SkipLog, on_bytes: Callable[[int], None] | None) -> Iterator[CodeDocument]:
        return iter(documents)

    settings = PrepareSettings(
        vocab_size=vocab_size, validation_fraction=validation_fraction, tokenizer_file=tokenizer_path
    )
    inputs = [{"name": name, "bytes": sum(len(document.text.encode("utf-8")) for document in documents)}]
    with building_folder(folder) as work:
        prepare_documents(
            read,
            work,
            settings,
            source={"path": name, "files": inputs},
            workers=0,
            split_by=split_by,
            split_rule=SPLIT_RULE if held_out is None else held_out_rule_text(held_out),
        )
    return EmbeddedCorpus(folder, tokenizer, tokenizer_path, cached, True)
