"""A run folder written before Reshape 2 (CoMERA's settings under ``train`` in its ``config.json``) resumes
with the current code, given the same settings under their new keys, and ends where the uninterrupted old
run ended (tests/data/run_folder_v0/README.md says how the fixture was made)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import comera.workloads.nli.recipe  # noqa: F401  (registers the nli recipe)
from comera.recipes.run import SetupError, run

FIXTURE = Path(__file__).parents[1] / "data" / "run_folder_v0"
STAGES = ["train.checkpoint_every=3", "train.keep_checkpoints=9", "train.early=6", "train.late=9"]
COMERA = ["method.gamma=0.01", "method.recovery=0.5", "method.trims=1"]  # trims: one trim, as then


def _copy(tmp_path, drop=()):
    out = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", out)
    shutil.copytree(FIXTURE / "cache", tmp_path / "cache")
    for name in drop:
        (out / "checkpoints" / name).unlink()
    return out


def _resume(tmp_path, out, assignments):
    return run(
        "nli", preset="smoke", out=out, cache_dir=tmp_path / "cache", assignments=assignments, resume=True
    )


@pytest.mark.parametrize(
    ("drop", "resumed_from"),
    [((), "step-00000012.pt"), (("step-00000012.pt",), "step-00000003.pt")],
    ids=["pruned_late_checkpoint", "early_checkpoint"],
)
def test_an_old_run_folder_resumes_to_the_old_uninterrupted_run(tmp_path, drop, resumed_from):
    out = _copy(tmp_path, drop)
    results = _resume(tmp_path, out, [*STAGES, *COMERA])
    expected = json.loads((FIXTURE / "expected" / "results.json").read_text())
    for key in ("steps", "stage", "size_ratio", "params", "target_reached"):
        assert results[key] == expected[key], key
    got = load_file(str(out / "model" / "model.safetensors"))
    want = load_file(str(FIXTURE / "expected" / "model.safetensors"))
    assert got.keys() == want.keys()
    # the expected run was computed once, on the machine that made the fixture (an AMD EPYC): on another
    # kind of CPU the fused AdamW and GEMM kernels round differently, so weights and metrics agree within a
    # tolerance there (docs/testing.md, "When a test may compare bit for bit"); on the EPYC they are equal
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert results["evaluation"].keys() == expected["evaluation"].keys()
    for split, metrics in expected["evaluation"].items():
        assert results["evaluation"][split] == pytest.approx(metrics, rel=1e-5), split
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [event for event in events if event.get("event") == "resume"]
    assert resume["checkpoint"].endswith(resumed_from)
    steps = [event["step"] for event in events if event["kind"] == "train"]
    assert steps == list(range(1, 16)), "every step logged once"
    header = json.loads((out / "config.json").read_text())
    method = header["settings"]["method"]
    assert "gamma" not in header["settings"]["train"] and method["gamma"] == 0.01
    assert method["recovery"] == 0.5 and method["lr_gates"] == 0.01


def test_the_old_keys_name_their_new_home_and_other_settings_are_still_refused(tmp_path):
    out = _copy(tmp_path)
    with pytest.raises(SetupError, match="train.gamma moved to method.gamma"):
        _resume(tmp_path, out, [*STAGES, "train.gamma=0.01", "method.recovery=0.5"])
    with pytest.raises(SetupError, match=r"other settings \(method.gamma: 0.01 then, 0.02 now\)"):
        _resume(tmp_path, out, [*STAGES, "method.gamma=0.02", "method.recovery=0.5"])
    assert not (out / "results.json").exists()
