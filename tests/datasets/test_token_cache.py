"""The token-id cache: a damaged file is encoded again and replaced; a folder in its place is named. The
encoding: each document's ids as the tokenizer gives them for that document alone, as int32 arrays, the
tokenizer handed a bounded amount of text at a time."""

import io
import re

import numpy as np
import pytest

from comera.data import token_cache
from comera.data.bpe import train_tokenizer
from comera.data.sources import CodeDocument
from comera.data.token_cache import encode_cached, encode_documents, join_documents

DOCUMENTS = [CodeDocument(f"m{i}.py", f"def f{i}(x):\n    return x + {i}\n" * (i + 1)) for i in range(4)]


def _lists(encoded):
    return [ids.tolist() for ids in encoded]


def _fail(*args, **kwargs):
    raise AssertionError("encoded again")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([document.text for document in DOCUMENTS], 300)


def test_a_damaged_token_cache_is_encoded_again_and_replaced(tmp_path, tokenizer, cache_damage, monkeypatch):
    clean = _lists(encode_cached(tokenizer, DOCUMENTS, tmp_path, prefix="lm"))
    (path,) = tmp_path.glob("lm-tokens-*.npz")
    cache_damage(path)
    with cache_damage.rebuilt(path):
        assert _lists(encode_cached(tokenizer, DOCUMENTS, tmp_path, prefix="lm")) == clean
    monkeypatch.setattr(token_cache, "encode_documents", _fail)
    assert _lists(encode_cached(tokenizer, DOCUMENTS, tmp_path, prefix="lm")) == clean


def test_arrays_of_another_number_of_documents_are_encoded_again(tmp_path, tokenizer):
    clean = _lists(encode_cached(tokenizer, DOCUMENTS, tmp_path))
    (path,) = tmp_path.glob("code-tokens-*.npz")
    buffer = io.BytesIO()
    np.savez(buffer, ids=np.arange(3, dtype=np.int32), offsets=np.array([0, 3], dtype=np.int64))
    path.write_bytes(buffer.getvalue())
    with pytest.warns(RuntimeWarning, match=r"is rebuilt .*do not describe the token ids of 4 documents"):
        assert _lists(encode_cached(tokenizer, DOCUMENTS, tmp_path)) == clean


def test_a_folder_in_place_of_the_cache_file_is_named(tmp_path, tokenizer):
    encode_cached(tokenizer, DOCUMENTS, tmp_path)
    (path,) = tmp_path.glob("code-tokens-*.npz")
    path.unlink()
    path.mkdir()
    with pytest.raises(ValueError, match=rf"cache entry {re.escape(str(path))} is not a file.*; delete it$"):
        encode_cached(tokenizer, DOCUMENTS, tmp_path)


class _RecordingTokenizer:
    """Hands every ``encode_batch_fast`` call to ``tokenizer`` and records the UTF-8 bytes of its texts."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[int] = []

    def encode_batch_fast(self, texts, add_special_tokens):
        self.calls.append(sum(len(text.encode("utf-8")) for text in texts))
        return self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


def test_documents_are_encoded_a_bounded_amount_of_text_at_a_time(tokenizer):
    """The tokenizer's per-token records exist for one batch at a time: with a limit of 100 bytes no call
    holds more than 100 bytes of text but for a single longer document, every document is in one call, and
    each document's ids are those of the tokenizer on that document alone, as int32 arrays."""
    documents = [CodeDocument(f"d{i}.py", "é" * (i % 7) + f"x{i} = {i}\n" * (1 + i % 5)) for i in range(40)]
    documents.append(CodeDocument("long.py", "y = 1\n" * 50))
    recorder = _RecordingTokenizer(tokenizer)
    encoded = encode_documents(recorder, documents, batch_bytes=100)
    sizes = [len(document.text.encode("utf-8")) for document in documents]
    assert sum(recorder.calls) == sum(sizes)
    assert len(recorder.calls) > 1
    assert all(call <= 100 or call in sizes for call in recorder.calls)
    assert all(ids.dtype == np.int32 for ids in encoded)
    alone = [tokenizer.encode(document.text, add_special_tokens=False).ids for document in documents]
    assert _lists(encoded) == alone


def test_the_default_batch_holds_a_mebibyte_of_text(tokenizer, monkeypatch):
    documents = [CodeDocument(f"d{i}.txt", "abc " * 100_000) for i in range(6)]
    recorder = _RecordingTokenizer(tokenizer)
    encode_documents(recorder, documents)
    assert recorder.calls == [800_000, 800_000, 800_000]


def test_join_documents_is_each_documents_ids_then_eos_skipping_empty_ones():
    documents = [np.array([5, 6], dtype=np.int32), [], [7], np.zeros(0, dtype=np.int32), (8, 9, 10)]
    stream = join_documents(documents, eos=2)
    assert stream.dtype == np.int32
    assert stream.tolist() == [5, 6, 2, 7, 2, 8, 9, 10, 2]
    assert join_documents([], eos=2).shape == (0,)
