"""The WordPiece pair tokenizer's contract (comera.data.tokenize): its defaults (lower-casing, 128 tokens),
the single-text template, the decoder, training's word-length boundary, cap and minimum frequency, vocab.txt
lines read verbatim (transformers' BertTokenizer as the reference), saving, and errors that name the file."""

import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import BertTokenizer

from comera.data.tokenize import PairTokenizer, bert_wordpiece, load_tokenizer, train_wordpiece

VOCAB = Path(__file__).parent.parent / "data" / "nli_vocab" / "vocab.txt"
WORDS = VOCAB.read_text().split()
ID = {token: index for index, token in enumerate(WORDS)}
PROSE = "the cat sat on the mat " * 20 + "dogs run fast and far " * 20


def test_bert_wordpiece_lower_cases_by_default():
    """Without ``lowercase``, "The CAT" is "the cat"; with ``lowercase=False`` it is unknown."""
    assert bert_wordpiece(dict(ID)).encode("The CAT").tokens == ["the", "cat"]
    assert bert_wordpiece(dict(ID), lowercase=False).encode("The CAT").tokens == ["[UNK]", "[UNK]"]


def test_bert_wordpiece_decodes_continuation_pieces_into_words():
    """The WordPiece decoder joins "##" pieces to the piece before: run ##ning -> "running"."""
    tokenizer = bert_wordpiece(dict(ID))
    ids = [ID["he"], ID["run"], ID["##ning"], ID["."]]
    assert tokenizer.decode(ids) == "he running."


def test_train_wordpiece_lower_cases_by_default():
    """Trained without ``lowercase``, the vocabulary holds "the" and no upper-case letter."""
    vocab = train_wordpiece(["The The cat cat"], 200).get_vocab()
    assert "the" in vocab and "cat" in vocab
    assert not [token for token in vocab if token != token.lower() and not token.startswith("[")]
    cased = train_wordpiece(["The The cat cat"], 200, lowercase=False).get_vocab()
    assert "The" in cased and "the" not in cased


def test_training_keeps_words_of_exactly_100_characters_and_leaves_out_longer_ones():
    """``max_input_chars_per_word`` is 100: a 100-character word is learnt (whole, as it is frequent), a
    101-character one leaves no trace in the vocabulary."""
    kept, dropped = "kx" * 50, "zq" * 50 + "z"
    assert (len(kept), len(dropped)) == (100, 101)
    tokenizer = train_wordpiece([f"{kept} {dropped}"] * 2, 300)
    vocab = tokenizer.get_vocab()
    assert kept in vocab
    assert not [token for token in vocab if "z" in token or "q" in token]
    assert tokenizer.encode(kept).tokens == [kept]
    assert tokenizer.encode(dropped).tokens == ["[UNK]"]


@pytest.mark.parametrize("vocab_size", [35, 40])
def test_training_fills_exactly_vocab_size_when_the_corpus_has_more_pieces(vocab_size):
    """The cap binds: the corpus supports more than 40 tokens."""
    assert train_wordpiece([PROSE], 200).get_vocab_size() > 40
    assert train_wordpiece([PROSE], vocab_size).get_vocab_size() == vocab_size


def test_training_learns_only_pieces_seen_twice():
    """In "ab ab cd", "ab" occurs twice and is learnt, "cd" once and is not."""
    vocab = train_wordpiece(["ab ab cd"], 200).get_vocab()
    assert "ab" in vocab
    assert "cd" not in vocab and "##d" in vocab


def test_vocab_lines_are_read_verbatim_as_transformers_reads_them(tmp_path):
    """Only the line ending is removed: "cat " (a trailing space) and "X" are tokens of their own, so "cat"
    and "dog" keep their line numbers as ids, as in transformers' BertTokenizer, and every line is a row."""
    path = tmp_path / "vocab.txt"
    path.write_bytes(b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncat \nX\ncat\ndog\n")
    reference = BertTokenizer(vocab=str(path), do_lower_case=False)
    ours = load_tokenizer(path, lowercase=False)
    [(ids, types)] = ours.encode_pairs(["X cat"], ["dog"])
    want = reference("X cat", "dog")
    assert ids == want["input_ids"] == [2, 6, 7, 3, 8, 3]
    assert types == want["token_type_ids"]
    assert ours.vocab_size == 9


def test_an_empty_vocab_line_is_named(tmp_path):
    """ValueError naming the file and the line number."""
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: empty line in a WordPiece vocabulary")):
        load_tokenizer(path)


def test_a_repeated_vocab_line_is_named_instead_of_shifting_the_later_ids(tmp_path):
    """A token on two lines would leave the ids after it one off from the line numbers that weights trained
    with the file use: ValueError naming the file, the line and the line it repeats."""
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\ncat\ncat\ndog\n")
    message = (
        f"{path}:6: token 'cat' repeats line 5; each line of a WordPiece vocabulary is one token, its id the "
        "line number (weights trained with this file would read every later id shifted)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_tokenizer(path)


def test_a_missing_tokenizer_file_is_named(tmp_path):
    """FileNotFoundError naming the path given."""
    missing = tmp_path / "vocab-missing.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{missing}: tokenizer file not found")):
        load_tokenizer(missing)


def test_a_corrupt_tokenizer_json_is_named(tmp_path):
    """ValueError naming the file and what it should have been."""
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ')
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a tokenizers tokenizer.json (")):
        load_tokenizer(tmp_path)


def test_max_length_defaults_to_128():
    """A long pair is cut to 128 tokens by default (and by the given length otherwise)."""
    first, second = ["cat " * 200], ["dog " * 200]
    for tokenizer in (load_tokenizer(VOCAB), PairTokenizer(bert_wordpiece(dict(ID)))):
        assert tokenizer.max_length == 128
        [(ids, _)] = tokenizer.encode_pairs(first, second)
        assert len(ids) == 128
    short = load_tokenizer(VOCAB, max_length=9)
    assert short.max_length == 9 and len(short.encode_pairs(first, second)[0][0]) == 9


def test_a_single_text_is_encoded_as_cls_text_sep():
    """The single-text template is "[CLS] $A [SEP]", token type 0 throughout."""
    tokenizer = load_tokenizer(VOCAB)
    encoding = tokenizer.tokenizer.encode("the cat")
    assert encoding.ids == [ID["[CLS]"], ID["the"], ID["cat"], ID["[SEP]"]]
    assert encoding.type_ids == [0, 0, 0, 0]


def test_save_writes_a_tokenizer_json_that_loads_to_the_same_encodings(tmp_path, monkeypatch):
    """``save`` writes at the path given (str or Path) and the file loads back to the same pair encodings."""
    monkeypatch.chdir(tmp_path)
    tokenizer = load_tokenizer(VOCAB, max_length=12)
    pairs = (["The cat sat on the mat.", "He ran fast"], ['She said "no way", running.', "the dog"])
    for target in (tmp_path / "saved" / "tokenizer.json", str(tmp_path / "as_str.json")):
        Path(target).parent.mkdir(exist_ok=True)
        tokenizer.save(target)
        assert Path(target).is_file()
        assert Tokenizer.from_file(str(target)).to_str() == tokenizer.tokenizer.to_str()
        assert load_tokenizer(target, max_length=12).encode_pairs(*pairs) == tokenizer.encode_pairs(*pairs)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["as_str.json", "saved"]
