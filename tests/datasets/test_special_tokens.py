"""Tokenizers a user brings (``data.tokenizer_file``): GPT-2's, LLaMA's and T5's naming of their special
tokens, and a ``transformers`` ``save_pretrained`` folder that names its own; each mapped to the roles the
workloads use, recorded in the prepared corpus's index, and trained on for a few steps."""

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from comera.cli import main
from comera.data.bpe import special_ids
from comera.data.prepare import PrepareSettings, prepare_corpus
from comera.data.sources import split_of
from comera.data.special_tokens import load_given_tokenizer, special_token_names

WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":"]


def _texts(count=200, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) for _ in range(count)]


def write_corpus(root):
    root.mkdir(parents=True)
    with (root / "part.jsonl").open("w") as file:
        for text in _texts():
            file.write(json.dumps({"text": text}) + "\n")
    return root


def gpt2_like():
    """Byte-level BPE whose only special token is ``<|endoftext|>`` (GPT-2's convention)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_texts(), trainer)
    return tokenizer


def llama_like():
    """BPE with ``<unk>`` ``<s>`` ``</s>`` at ids 0, 1, 2 and no padding token (LLaMA 1 and 2)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(_texts(), trainer)
    return tokenizer


def t5_like():
    """Unigram with ``<pad>`` ``</s>`` ``<unk>`` at ids 0, 1, 2 and no beginning token (T5)."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"
    )
    tokenizer.train_from_iterator(_texts(), trainer)
    return tokenizer


CONVENTIONS = {
    "gpt2": (gpt2_like, {"eos": "<|endoftext|>", "bos": "<|endoftext|>", "unk": "<|endoftext|>"}, ["<pad>"]),
    "llama": (llama_like, {"eos": "</s>", "bos": "<s>", "unk": "<unk>"}, ["<pad>"]),
    "t5": (t5_like, {"eos": "</s>", "bos": "</s>", "unk": "<unk>", "pad": "<pad>"}, []),
}


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_a_tokenizer_named_by_another_convention_is_mapped_prepared_and_trained_on(convention, tmp_path):
    build, roles, added = CONVENTIONS[convention]
    original = build()
    path = tmp_path / "tokenizer.json"
    original.save(str(path))
    given = load_given_tokenizer(path)
    assert {role: given.names[role] for role in roles} == roles
    assert given.names["pad"] == (roles.get("pad") or "<pad>") and list(given.added) == added
    assert given.names["mask"] is None
    # the tokenizer's own ids are kept; an added <pad> comes after them
    vocabulary = original.get_vocab()
    assert all(given.tokenizer.token_to_id(token) == index for token, index in vocabulary.items())
    if added:
        assert given.tokenizer.token_to_id("<pad>") == original.get_vocab_size()

    data = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    settings = PrepareSettings(vocab_size=300, validation_fraction=0.1, tokenizer_file=path)
    index = prepare_corpus(data, out, settings, workers=0).index
    assert index["tokenizer"]["special_tokens"] == given.names
    assert index["tokenizer"]["added_tokens"] == added
    prepared = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert index["eos_id"] == prepared.token_to_id(roles["eos"]) == original.token_to_id(roles["eos"])
    # the stream: each training document encoded by the tokenizer as it was given, then the end token
    lines = (data / "part.jsonl").read_text().splitlines()
    texts = [
        json.loads(line)["text"]
        for number, line in enumerate(lines, 1)
        if split_of(f"part.jsonl:{number}", 0.1) == "train"
    ]
    want = [
        token
        for text in texts
        for token in [*original.encode(text, add_special_tokens=False).ids, index["eos_id"]]
    ]
    assert np.fromfile(out / "train-00000.bin", dtype=index["dtype"]).tolist() == want

    arguments = ["train", "llm", "--method", "dense", "--preset", "smoke", "--data", str(out)]
    arguments += ["--out", str(tmp_path / "run"), "--cache", str(tmp_path / "cache"), "--no-progress"]
    for assignment in ["train.early=3", "train.late=1", "train.plot=false"]:
        arguments += ["--set", assignment]
    assert main(arguments) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["data"]["vocab_size"] == prepared.get_vocab_size()
    assert results["data"]["special_ids"] == {"pad": index["pad_id"], "eos": index["eos_id"]}


def test_a_save_pretrained_folder_names_its_own_special_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer = Tokenizer(models.BPE(unk_token="<|unknown|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<|unknown|>", "<|start|>", "<|stop|>", "<|fill|>", "<|hide|>"]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials)
    tokenizer.train_from_iterator(_texts(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<|unknown|>",
        bos_token="<|start|>",
        eos_token="<|stop|>",
        pad_token="<|fill|>",
        mask_token="<|hide|>",
    )
    folder = tmp_path / "saved"
    fast.save_pretrained(str(folder))
    given = load_given_tokenizer(folder)
    assert given.names == {
        "bos": "<|start|>",
        "pad": "<|fill|>",
        "eos": "<|stop|>",
        "unk": "<|unknown|>",
        "mask": "<|hide|>",
    }
    assert given.added == ()
    ids = special_ids(given.tokenizer, given.names)
    assert (ids.bos, ids.pad, ids.eos, ids.unk, ids.mask) == (1, 3, 2, 0, 4)

    data = write_corpus(tmp_path / "corpus")
    arguments = ["train", "mlm", "--method", "dense", "--preset", "smoke", "--data", str(data)]
    arguments += ["--out", str(tmp_path / "run"), "--cache", str(tmp_path / "cache"), "--no-progress"]
    for assignment in ["train.early=3", "train.late=1", "train.plot=false", f"data.tokenizer_file={folder}"]:
        arguments += ["--set", assignment]
    assert main(arguments) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["data"]["special_ids"] == {"bos": 1, "pad": 3, "eos": 2, "mask": 4}
    index = json.loads((tmp_path / results["data"]["prepared"]["folder"] / "index.json").read_text())
    assert index["tokenizer"]["special_tokens"] == given.names
    assert index["tokenizer"]["given_files"][0] == "tokenizer.json"


def test_the_masked_lm_refuses_a_tokenizer_without_a_mask_token_before_encoding(tmp_path, capsys):
    path = tmp_path / "tokenizer.json"
    gpt2_like().save(str(path))
    data = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    arguments = ["prepare", "mlm", "--data", str(data), "--out", str(out), "--workers", "0"]
    assert main([*arguments, "--set", f"data.tokenizer_file={path}"]) == 2
    error = capsys.readouterr().err
    assert "the masked LM needs a mask token" in error and "['<mask>', '[MASK]']" in error
    assert not list(out.glob("*.bin"))


def test_a_tokenizer_without_an_end_of_document_token_or_with_a_wrong_name_is_refused(tmp_path):
    tokenizer = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<|x|>"])
    tokenizer.train_from_iterator(_texts(), trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    with pytest.raises(ValueError, match=r"lacks the special token\(s\) ending a document: none of \['</s>'"):
        load_given_tokenizer(path)
    with pytest.raises(ValueError, match="names '<eos>' as its eos token, but its vocabulary lacks it"):
        special_token_names(tokenizer, {"eos": "<eos>"})
    folder = tmp_path / "saved"
    folder.mkdir()
    with pytest.raises(ValueError, match="is a folder without a tokenizer.json"):
        load_given_tokenizer(folder)
