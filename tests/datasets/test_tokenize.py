"""Pair tokenisation: a hand-built expectation, transformers' BertTokenizer, and longest-first truncation."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import BertProcessing
from transformers import BertTokenizer

from comera.data.tokenize import PairTokenizer, bert_wordpiece, load_tokenizer, train_wordpiece

VOCAB = Path(__file__).parent.parent / "data" / "nli_vocab" / "vocab.txt"
WORDS = VOCAB.read_text().split()
ID = {token: index for index, token in enumerate(WORDS)}


def test_pair_is_cls_a_sep_b_sep_with_token_types():
    tokenizer = load_tokenizer(VOCAB, max_length=32)
    [(ids, types)] = tokenizer.encode_pairs(["The cat's mat."], ['He said "no way", running.'])
    first = ["the", "cat", "'", "s", "mat", "."]
    second = ["he", "said", '"', "no", "way", '"', ",", "run", "##ning", "."]
    assert ids == [ID[t] for t in ["[CLS]", *first, "[SEP]", *second, "[SEP]"]]
    assert types == [0] * (len(first) + 2) + [1] * (len(second) + 1)
    assert tokenizer.vocab_size == len(WORDS) and tokenizer.pad_id == 0


def _longest_first(n_first: int, n_second: int, budget: int) -> tuple[int, int]:
    """Longest-first as the ``tokenizers`` library (so Hugging Face's fast tokenizers, which the paper's code
    used) does it: a shorter sequence that fits in half the budget is kept whole and the longer one takes the
    rest; otherwise the budget is halved, the longer sequence (the second on a tie) taking the odd token."""
    if n_first + n_second <= budget:
        return n_first, n_second
    short = min(n_first, n_second, budget // 2)
    long = budget - short
    return (long, short) if n_first > n_second else (short, long)


@pytest.mark.parametrize("max_length", [7, 8, 12])
def test_truncation_is_longest_first_and_counts_the_special_tokens(max_length):
    tokenizer = load_tokenizer(VOCAB, max_length=max_length)
    for n_first in range(1, 10):
        for n_second in range(1, 10):
            [(ids, types)] = tokenizer.encode_pairs(
                [" ".join(["cat"] * n_first)], [" ".join(["dog"] * n_second)]
            )
            want_first, want_second = _longest_first(n_first, n_second, max_length - 3)
            assert ids.count(ID["cat"]) == want_first and ids.count(ID["dog"]) == want_second
            assert len(ids) == min(n_first + n_second + 3, max_length) and sum(types) == want_second + 1


def test_matches_transformers_bert_tokenizer_built_from_the_same_vocabulary():
    reference = BertTokenizer(vocab=str(VOCAB))
    ours = load_tokenizer(VOCAB, max_length=12)
    pairs = [
        ("The cat sat on the mat.", 'She said "hello", running.'),
        ("It isn't the dog's mat?", "He ran fast to the mat, no way."),
        ("Zebras sat.", "A cat."),
    ]
    got = ours.encode_pairs([a for a, _ in pairs], [b for _, b in pairs])
    for (first, second), (ids, types) in zip(pairs, got):
        want = reference(first, second, truncation="longest_first", max_length=12)
        assert ids == want["input_ids"] and types == want["token_type_ids"]


def test_many_pairs_encode_in_order_as_the_transformers_tokenizer_does():
    """More pairs than one encoding chunk: every pair in its place, truncated as the reference does."""
    reference = BertTokenizer(vocab=str(VOCAB))
    ours = load_tokenizer(VOCAB, max_length=10)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "fast"]
    pairs = [
        (
            " ".join(words[(i + j) % 8] for j in range(1 + i % 7)),
            " ".join(words[(3 * i + j) % 8] for j in range(1 + i % 9)),
        )
        for i in range(700)
    ]
    got = ours.encode_pairs([a for a, _ in pairs], [b for _, b in pairs])
    assert len(got) == len(pairs)
    for (first, second), (ids, types) in zip(pairs, got):
        want = reference(first, second, truncation="longest_first", max_length=10)
        assert ids == want["input_ids"] and types == want["token_type_ids"]


def test_tokenizer_json_with_fixed_padding_is_reset(tmp_path):
    fixed = bert_wordpiece({token: index for index, token in enumerate(WORDS)})
    fixed.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    fixed.enable_truncation(128)
    fixed.post_processor = BertProcessing(("[SEP]", ID["[SEP]"]), ("[CLS]", ID["[CLS]"]))
    fixed.save(str(tmp_path / "tokenizer.json"))
    assert len(Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("the cat").ids) == 128
    tokenizer = load_tokenizer(tmp_path, max_length=6)
    [(ids, types)] = tokenizer.encode_pairs(["the cat sat"], ["the dog"])
    assert ids == [ID[t] for t in ["[CLS]", "the", "cat", "[SEP]", "the", "[SEP]"]]
    assert types == [0, 0, 0, 0, 1, 1]


def test_cased_vocabulary_keeps_case():
    tokenizer = load_tokenizer(VOCAB.parent, lowercase=False)
    [(ids, _)] = tokenizer.encode_pairs(["The cat"], ["cat"])
    assert ids == [ID["[CLS]"], ID["[UNK]"], ID["cat"], ID["[SEP]"], ID["cat"], ID["[SEP]"]]


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_length must be an int >= 4"):
        load_tokenizer(VOCAB, max_length=3)
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor vocab.txt"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\ncat\n")
    with pytest.raises(ValueError, match=r"lacks the special token\(s\) \['\[CLS\]', '\[SEP\]'\]"):
        load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match="same length"):
        PairTokenizer(bert_wordpiece({t: i for i, t in enumerate(WORDS)})).encode_pairs(["a"], [])


def test_wordpiece_training_leaves_out_words_that_encode_as_unk():
    texts = ["the cat sat on the mat", "a cat and a mat", "zq" * 60]
    tokenizer = train_wordpiece(texts, 200)
    assert not [token for token in tokenizer.get_vocab() if "z" in token or "q" in token]
    assert "the" in tokenizer.get_vocab()
    assert tokenizer.encode("zq" * 60).tokens == ["[UNK]"]
    assert tokenizer.encode("the cat").tokens == ["the", "cat"]


def test_a_vocabulary_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes(b"[PAD]\n[UNK]\n[CLS]\n[SEP]\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"vocab\.txt:5: byte 0xe9 at offset 3 is not valid UTF-8"):
        load_tokenizer(path)


def test_a_vocabulary_with_a_byte_order_mark_keeps_its_first_token(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes(b"\xef\xbb\xbf" + VOCAB.read_bytes())
    assert load_tokenizer(path).tokenizer.get_vocab() == load_tokenizer(VOCAB).tokenizer.get_vocab()
