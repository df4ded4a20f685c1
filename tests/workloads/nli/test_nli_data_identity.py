"""A resume refuses data built differently from the run's: the embedded task's tokenizer is trained on the
machine, and training it again (a removed or other ``--cache``) need not give the same pieces or ids."""

import json

import pytest

from comera.data.tokenize import tokenizer_digest, train_wordpiece
from comera.recipes.run import SetupError, run
from comera.workloads import load_recipe

load_recipe("nli")


def _run(tmp_path, cache, **kwargs):
    return run(
        "nli",
        method="dense",
        preset="smoke",
        out=tmp_path / "run",
        cache_dir=cache,
        assignments=["train.early=2", "train.late=0", "train.unit=step"],
        progress=False,
        **kwargs,
    )


def test_the_run_records_its_tokenizer_and_a_resume_refuses_another(tmp_path):
    results = _run(tmp_path, tmp_path / "cache")
    config_path = tmp_path / "run" / "config.json"
    config = json.loads(config_path.read_text())
    digest = config["data_identity"]["tokenizer"]
    assert len(digest) == 64 and results["data"]["identity"] == {"tokenizer": digest}
    assert _run(tmp_path, tmp_path / "cache", resume=True)["steps"] == 2  # the same cache: accepted
    config["data_identity"]["tokenizer"] = "0" * 64
    config_path.write_text(json.dumps(config))
    with pytest.raises(SetupError, match=r"another tokenizer than the run's \(sha256 000000000000 then, "):
        _run(tmp_path, tmp_path / "cache", resume=True)


def test_a_folder_without_a_recorded_identity_still_resumes(tmp_path):
    _run(tmp_path, tmp_path / "cache")
    config_path = tmp_path / "run" / "config.json"
    config = json.loads(config_path.read_text())
    del config["data_identity"]
    config_path.write_text(json.dumps(config))
    assert _run(tmp_path, tmp_path / "cache", resume=True)["steps"] == 2


def test_the_digest_tells_tokenizers_apart_and_not_copies():
    texts = ["alpha beta gamma delta", "alpha beta", "gamma delta epsilon"] * 20
    first, second = train_wordpiece(texts, 60), train_wordpiece(texts[:30], 40)
    assert tokenizer_digest(first) == tokenizer_digest(type(first).from_str(first.to_str()))
    assert tokenizer_digest(first) != tokenizer_digest(second)
