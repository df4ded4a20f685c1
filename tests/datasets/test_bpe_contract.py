"""The byte-level BPE tokenizer's contract (comera.data.bpe): the smallest vocabulary at its boundary, exactly
which merges a tiny corpus gives, the vocabulary cap, the unknown token, the cache file's name (hashlib) and
the errors that name what is wrong."""

import hashlib
import json
import re

import pytest
import torch

from comera.data.bpe import load_or_train_tokenizer, special_ids, train_tokenizer
from comera.data.sources import CodeDocument

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
# 256 byte symbols + 5 special tokens + 1 merge
SMALLEST = 262
# a corpus that supports many more merges than the vocabularies asked for below
PROSE = "the cat sat on the mat " * 20 + "dogs run fast and far " * 20


def _byte_symbols() -> set[str]:
    """GPT-2's byte-to-symbol table: printable Latin-1 bytes stand for themselves, the 68 others for the
    characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte) for byte in printable} | {chr(256 + index) for index in range(len(others))}


@pytest.mark.parametrize(
    ("vocab_size", "shown"),
    [(SMALLEST - 1, "261"), (2**20 + 1, "1048577"), (True, "True"), (300.0, "300.0"), ("300", "'300'")],
)
def test_vocab_size_below_the_smallest_or_not_an_int_is_refused(tmp_path, vocab_size, shown):
    """One below 262 (the boundary), a bool, a float and a string are refused by training and by the cache,
    with the smallest size and its parts in the message."""
    message = re.escape(
        "vocab_size must be an int in [262, 1048576] (256 bytes + 5 special tokens + 1 merge at least), "
        f"got {shown}"
    )
    with pytest.raises(ValueError, match=message):
        train_tokenizer(["ab ab"], vocab_size)
    with pytest.raises(ValueError, match=message):
        load_or_train_tokenizer([CodeDocument("a.py", "ab ab")], vocab_size, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_smallest_vocabulary_is_accepted_and_filled():
    """262 is accepted and gives exactly 262 tokens: the specials (ids 0..4), every byte symbol, one merge."""
    tokenizer = train_tokenizer([PROSE], SMALLEST)
    vocab = tokenizer.get_vocab()
    assert len(vocab) == tokenizer.get_vocab_size() == SMALLEST
    assert [vocab[token] for token in SPECIALS] == [0, 1, 2, 3, 4]
    assert _byte_symbols() <= set(vocab)


def test_a_tiny_corpus_gives_exactly_the_merges_seen_twice():
    """In "ab ab" + "cd" the pair (a, b) occurs twice and is merged; (c, d) and (Ġ, ab) occur once and are
    not. Every byte symbol is in the vocabulary even though the corpus uses four."""
    tokenizer = train_tokenizer(["ab ab", "cd"], 300)
    model = json.loads(tokenizer.to_str())["model"]
    assert model["merges"] == [["a", "b"]]
    assert set(tokenizer.get_vocab()) == set(SPECIALS) | _byte_symbols() | {"ab"}
    assert tokenizer.get_vocab_size() == 256 + 5 + 1
    text = "é€ cd\n"  # bytes never seen in training still encode, and decode back
    encoding = tokenizer.encode(text, add_special_tokens=False)
    assert 3 not in encoding.ids
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("vocab_size", [270, 280])
def test_the_vocabulary_has_exactly_vocab_size_tokens_when_the_corpus_has_more_merges(vocab_size):
    """The cap binds: the corpus supports more than 280 tokens."""
    assert train_tokenizer([PROSE], 300).get_vocab_size() > 280
    assert train_tokenizer([PROSE], vocab_size).get_vocab_size() == vocab_size


def test_an_unknown_symbol_maps_to_the_unk_special_token():
    """The model's unknown token is <unk> (id 3): a symbol outside the byte alphabet (which the byte-level
    pre-tokeniser never produces, but a pre-tokenised input can) becomes it."""
    tokenizer = train_tokenizer(["ab ab"], 300)
    assert [(token.value, token.id) for token in tokenizer.model.tokenize("€")] == [("<unk>", 3)]
    assert special_ids(tokenizer).unk == 3


def test_the_cache_file_is_named_by_a_sha256_of_settings_and_sorted_documents(tmp_path):
    """``code-bpe-{vocab}-{digest}.json``, the digest being SHA-256 of "code-bpe/2/{vocab}/2" (name, format,
    vocabulary size, minimum frequency) and of each document in key order, computed here with hashlib."""
    documents = [CodeDocument("b.py", "ab ab ab\n"), CodeDocument("a.py", "abc abc\n")]
    for vocab_size in (SMALLEST, 300):
        reference = hashlib.sha256(f"code-bpe/2/{vocab_size}/2".encode())
        for key, text in (("a.py", "abc abc\n"), ("b.py", "ab ab ab\n")):
            reference.update(key.encode() + b"\x00")
            reference.update(hashlib.sha256(text.encode()).digest())
        tokenizer, path, cached = load_or_train_tokenizer(documents, vocab_size, tmp_path)
        assert path == tmp_path / f"code-bpe-{vocab_size}-{reference.hexdigest()[:16]}.json"
        assert not cached and json.loads(path.read_text()) == json.loads(tokenizer.to_str())


def test_special_ids_carry_the_vocabulary_size():
    """``vocab_size`` is the tokenizer's, and the ordinary ids are all the others: 5..261."""
    ids = special_ids(train_tokenizer([PROSE], SMALLEST))
    assert ids.vocab_size == SMALLEST
    assert ids.all == (0, 1, 2, 3, 4)
    assert torch.equal(ids.ordinary, torch.arange(5, SMALLEST))


def test_a_missing_tokenizer_file_is_named(tmp_path):
    """FileNotFoundError naming the argument and the path."""
    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError, match=re.escape(f"tokenizer_file {missing} does not exist")):
        load_or_train_tokenizer([], 300, tmp_path, tokenizer_file=missing)


def test_no_training_documents_is_refused(tmp_path):
    """An empty training split cannot train a tokenizer, and nothing is written."""
    with pytest.raises(ValueError, match="^cannot train a tokenizer: the training split has no documents$"):
        load_or_train_tokenizer([], 300, tmp_path)
    assert list(tmp_path.iterdir()) == []
