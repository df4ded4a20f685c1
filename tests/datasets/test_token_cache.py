"""The token-id cache: a damaged file is encoded again and replaced; a folder in its place is named."""

import io
import re

import numpy as np
import pytest

from comera.data import token_cache
from comera.data.bpe import train_tokenizer
from comera.data.sources import CodeDocument
from comera.data.token_cache import encode_cached

DOCUMENTS = [CodeDocument(f"m{i}.py", f"def f{i}(x):\n    return x + {i}\n" * (i + 1)) for i in range(4)]


def _fail(*args, **kwargs):
    raise AssertionError("encoded again")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([document.text for document in DOCUMENTS], 300)


def test_a_damaged_token_cache_is_encoded_again_and_replaced(tmp_path, tokenizer, cache_damage, monkeypatch):
    clean = encode_cached(tokenizer, DOCUMENTS, tmp_path, prefix="lm")
    (path,) = tmp_path.glob("lm-tokens-*.npz")
    cache_damage(path)
    with cache_damage.rebuilt(path):
        assert encode_cached(tokenizer, DOCUMENTS, tmp_path, prefix="lm") == clean
    monkeypatch.setattr(token_cache, "encode_documents", _fail)
    assert encode_cached(tokenizer, DOCUMENTS, tmp_path, prefix="lm") == clean


def test_arrays_of_another_number_of_documents_are_encoded_again(tmp_path, tokenizer):
    clean = encode_cached(tokenizer, DOCUMENTS, tmp_path)
    (path,) = tmp_path.glob("code-tokens-*.npz")
    buffer = io.BytesIO()
    np.savez(buffer, ids=np.arange(3, dtype=np.int32), offsets=np.array([0, 3], dtype=np.int64))
    path.write_bytes(buffer.getvalue())
    with pytest.warns(RuntimeWarning, match=r"is rebuilt .*do not describe the token ids of 4 documents"):
        assert encode_cached(tokenizer, DOCUMENTS, tmp_path) == clean


def test_a_folder_in_place_of_the_cache_file_is_named(tmp_path, tokenizer):
    encode_cached(tokenizer, DOCUMENTS, tmp_path)
    (path,) = tmp_path.glob("code-tokens-*.npz")
    path.unlink()
    path.mkdir()
    with pytest.raises(ValueError, match=rf"cache entry {re.escape(str(path))} is not a file.*; delete it$"):
        encode_cached(tokenizer, DOCUMENTS, tmp_path)
