"""The local byte-level BPE tokenizer: its cache, its piece cut, its special tokens."""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from comera.data.bpe import MAX_PIECE_CHARS, load_or_train_tokenizer, special_ids, train_tokenizer
from comera.data.sources import CodeDocument, read_code

DATA = Path(__file__).resolve().parents[1] / "data"
# the folder fixture's sources end in .src so that linters of this repository leave them alone
SOURCE = [".src"]


def _documents() -> list[CodeDocument]:
    documents, _ = read_code(DATA / "code_folder", extensions=SOURCE)
    return documents


def test_a_corrupt_tokenizer_file_is_named(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ')
    with pytest.raises(
        ValueError, match=r"tokenizer_file .*tokenizer\.json: not a tokenizers tokenizer\.json"
    ):
        load_or_train_tokenizer([], 300, tmp_path, tokenizer_file=path)


def test_tokenizer_is_cached_and_reused(tmp_path):
    documents = _documents()
    first, path, cached = load_or_train_tokenizer(documents, 300, tmp_path)
    assert not cached and path.parent == tmp_path and path.is_file()
    second, same_path, cached = load_or_train_tokenizer(list(reversed(documents)), 300, tmp_path)
    assert cached and same_path == path
    assert second.to_str() == first.to_str()
    _, other_path, cached = load_or_train_tokenizer(documents[:-1], 300, tmp_path)
    assert not cached and other_path != path
    given_tokenizer, given_path, cached = load_or_train_tokenizer(
        [], 999, tmp_path / "unused", tokenizer_file=path
    )
    assert cached and given_path == path and given_tokenizer.to_str() == first.to_str()
    ids = special_ids(first)
    assert (ids.bos, ids.pad, ids.eos, ids.unk, ids.mask) == (0, 1, 2, 3, 4)
    for document in documents:
        encoding = first.encode(document.text, add_special_tokens=False)
        assert first.decode(encoding.ids, skip_special_tokens=False) == document.text


def test_a_damaged_cached_tokenizer_is_trained_again_and_replaced(tmp_path, cache_damage):
    documents = _documents()
    clean, path, _ = load_or_train_tokenizer(documents, 300, tmp_path)
    cache_damage(path)
    with cache_damage.rebuilt(path):
        again, same_path, cached = load_or_train_tokenizer(documents, 300, tmp_path)
    assert not cached and same_path == path and again.to_str() == clean.to_str()
    read, _, cached = load_or_train_tokenizer(documents, 300, tmp_path)
    assert cached and read.to_str() == clean.to_str()


def test_long_pieces_are_cut_and_the_rest_is_pre_tokenised_as_gpt2_does():
    documents = _documents()
    draw = random.Random(0)
    blob = "".join(draw.choice("abcdefgh") for _ in range(3 * MAX_PIECE_CHARS + 17))
    tokenizer = train_tokenizer([*(document.text for document in documents), f"x = '{blob}'\n"], 300)
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(f"y={blob} z")]
    assert max(map(len, pieces)) == MAX_PIECE_CHARS
    assert "".join(pieces) == f"y={blob}Ġz"
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for document in documents:
        assert tokenizer.pre_tokenizer.pre_tokenize_str(document.text) == gpt2.pre_tokenize_str(document.text)
    encoding = tokenizer.encode(blob, add_special_tokens=False)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == blob


def test_a_tokenizer_without_the_special_tokens_is_refused(tmp_path):
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(path))
    with pytest.raises(ValueError, match="lacks the special token"):
        load_or_train_tokenizer([], 300, tmp_path, tokenizer_file=path)
