"""Fixtures of the language-model workload's tests: a small corpus of pseudo-code in C4's JSON-lines form."""

import json
import random

import pytest

WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":"]


def _write_corpus(root, files=3, lines=150, seed=0, notes=False):
    """``files`` JSON-lines files of ``lines`` documents of 4-50 words each (``{"text": ...}``), drawn
    with ``seed``, in the new folder ``root``; with ``notes``, also a ``notes.txt`` of 400 words.
    Returns ``root``."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(files):
        with (root / f"part{number}.jsonl").open("w") as file:
            for _ in range(lines):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 50)))
                file.write(json.dumps({"text": text}) + "\n")
    if notes:
        (root / "notes.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(400)))
    return root


@pytest.fixture(scope="session")
def write_corpus():
    """The function that writes the corpus (:func:`_write_corpus`)."""
    return _write_corpus
