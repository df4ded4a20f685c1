"""The recipe run: settings resolution and its errors, the run folder and results.json, resume rules."""

import json
import re

import pytest
import toy  # noqa: F401  (registers the toy recipe)
from sklearn.metrics import accuracy_score

from comera.methods import CoMERASettings, get_method, settings_values
from comera.recipes.run import SetupError, run
from comera.recipes.settings import parse_assignment, resolve_settings
from comera.train import read_metrics

PRESETS = toy.ToyRecipe.presets
_DROP = object()


def test_settings_layer_preset_method_file_and_assignments(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nbatch_size = 8\n[model]\nhidden = 24\n")
    dense = resolve_settings(
        PRESETS, "smoke", get_method("dense"), config_file=config, assignments=["train.lr_other=5e-4"]
    )
    assert dense["train"]["batch_size"] == 8 and dense["model"]["hidden"] == 24
    assert dense["train"]["lr_other"] == 5e-4
    comera = resolve_settings(PRESETS, "smoke", get_method("comera"))
    assert comera["train"]["lr_other"] == 1e-2, "the dense override applies to dense runs only"


@pytest.mark.parametrize(
    ("assignment", "match"),
    [
        ("model.width=3", r"unknown key model.width; valid keys of \[model\]: \['hidden'\]"),
        ("train.batchsize=3", r"unknown key train.batchsize; valid keys of \[train\]: \[.*'batch_size'"),
        ("optim.lr=3", r"unknown section 'optim'"),
        ("model.hidden=wide", r"model.hidden must be of type int"),
        ("train.batch_size=0", r"batch_size must be an int >= 1"),
        ("tensorize.preset=nope", r"tensorize.preset 'nope' is not registered"),
        ("train.run_dir=x", r"unknown key train.run_dir"),
        ("hidden=3", r"--set expects section.key=value"),
        ("train.gamma=0.1", r"unknown key train.gamma; valid keys of \[train\]"),
        ("train.prune_at=[]", r"unknown key train.prune_at"),
        ("method.gama=0.1", r"unknown key method.gama; valid keys of \[method\]: \[.*'gamma'"),
        ("method.gamma=-1", r"gamma must be a finite number in \[0.0, inf\)"),
        ("method.prune_at='end'", r"method.prune_at must be of type tuple, got 'end'"),
        ("method.target_loss='low'", r"method.target_loss must be of type float or None"),
    ],
)
def test_bad_settings_name_the_key_and_the_choices(assignment, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(PRESETS, "smoke", get_method("comera"), assignments=[assignment])


@pytest.mark.parametrize(
    ("preset_value", "assignment", "expected"),
    [
        ("auto", "train.compile=true", True),
        ("auto", "train.compile=false", False),
        (False, "train.compile=auto", "auto"),
        (False, "train.compile=true", True),
        (None, "method.target_loss=1", 1),
        (None, "tensorize.embeddings=true", True),
        (None, "tensorize.embeddings=['table']", ["table"]),
    ],
)
def test_a_setting_takes_every_type_its_field_declares(preset_value, assignment, expected):
    presets = {"smoke": {**PRESETS["smoke"], "train": {**PRESETS["smoke"]["train"]}}}
    if preset_value is not None:
        presets["smoke"]["train"]["compile"] = preset_value
    section, key, _ = parse_assignment(assignment)
    settings = resolve_settings(presets, "smoke", get_method("comera"), assignments=[assignment])
    assert settings[section][key] == expected


@pytest.mark.parametrize(
    ("assignment", "match"),
    [
        ("train.compile=3", r"train.compile must be of type bool or str, got 3"),
        ("train.compile=maybe", r"compile must be True, False or 'auto', got 'maybe'"),
        ("train.batch_size=8.0", r"train.batch_size must be of type int, got 8.0"),
        ("tensorize.rank='x'", r"tensorize.rank must be of type int or tuple, got 'x'"),
        ("tensorize.format=tx", r"format must be one of"),
    ],
)
def test_a_value_of_another_type_is_refused_before_anything_is_built(assignment, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(PRESETS, "smoke", get_method("comera"), assignments=[assignment])


def test_comera_settings_are_the_method_section(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[method]\ngamma = 0.5\nprune_at = ['end']\n")
    settings = resolve_settings(
        PRESETS, "smoke", get_method("comera"), config_file=config, assignments=["method.lr_cores=3e-3"]
    )
    assert settings["method"] == {
        **settings_values(CoMERASettings()),
        "gamma": 0.5,
        "prune_at": ["end"],
        "lr_cores": 3e-3,
    }
    assert "gamma" not in settings["train"]
    config.write_text("[train]\ngamma = 0.5\n")
    with pytest.raises(
        ValueError, match=r"--config .*run\.toml: unknown key train.gamma; valid keys of \[train\]"
    ):
        resolve_settings(PRESETS, "smoke", get_method("comera"), config_file=config)


@pytest.mark.parametrize(
    "change, found",
    [
        ({"method": {"tau": None}}, "unknown method.tau"),
        ({"train": {"gamma": 0.5}}, "unknown train.gamma"),
        ({"method": {"trims": _DROP}}, "missing method.trims"),
        ({"model": {"hidden": _DROP}, "method": {"tau": 0.1}}, "missing model.hidden; unknown method.tau"),
    ],
)
def test_a_run_folder_of_an_earlier_comera_is_refused_naming_its_keys(tmp_path, change, found):
    """A run folder whose ``config.json`` lacks a setting the current code writes, or holds one it no longer
    takes, is not converted: the resume is refused in one line naming the keys and the ways out, and
    ``--restart`` trains it again."""
    out = tmp_path / "run"
    arguments = {"preset": "smoke", "out": out, "cache_dir": tmp_path, "assignments": ["train.plot=false"]}
    run("toy", **arguments)
    config = json.loads((out / "config.json").read_text())
    for section, values in change.items():
        for key, value in values.items():
            if value is _DROP:
                del config["settings"][section][key]
            else:
                config["settings"][section][key] = value
    (out / "config.json").write_text(json.dumps(config))
    (out / "results.json").unlink()
    expected = (
        f"{out / 'config.json'}: settings written by an earlier comera ({found}); start it again with "
        "--restart or choose another --out"
    )
    with pytest.raises(SetupError, match=f"^{re.escape(expected)}$"):
        run("toy", resume=True, **arguments)
    assert run("toy", restart=True, **arguments)["steps"] > 0


def test_assignment_values_are_read_as_toml():
    assert parse_assignment("train.lr_other=1e-3") == ("train", "lr_other", 1e-3)
    assert parse_assignment("tensorize.rank=[2, 3]") == ("tensorize", "rank", [2, 3])
    assert parse_assignment("train.compile=false") == ("train", "compile", False)
    assert parse_assignment("data.path=some/where") == ("data", "path", "some/where")


def test_a_config_that_is_a_folder_or_not_utf8_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"--config .*: a folder; expected a TOML file"):
        resolve_settings(PRESETS, "smoke", get_method("comera"), config_file=tmp_path)
    config = tmp_path / "run.toml"
    config.write_bytes(b"[train]\n# caf\xe9\nbatch_size = 8\n")
    with pytest.raises(
        ValueError, match=r"--config .*run\.toml: line 2, column 6: byte 0xe9 is not valid UTF-8"
    ):
        resolve_settings(PRESETS, "smoke", get_method("comera"), config_file=config)


def test_unknown_preset_and_config_table():
    with pytest.raises(ValueError, match=r"unknown preset 'paper'; choose one of \['smoke'\]"):
        resolve_settings(PRESETS, "paper", get_method("comera"))


@pytest.mark.parametrize("method", ["dense", "comera"])
def test_a_run_writes_its_folder_and_results(tmp_path, method):
    out = tmp_path / method
    results = run("toy", method=method, preset="smoke", out=out, cache_dir=tmp_path / "cache")
    assert json.loads((out / "results.json").read_text()) == results
    assert set(results["evaluation"]) == {"validation", "test"}
    assert results["data"]["splits"]["train"] == {"read": 96, "skipped": 0}
    assert results["steps"] == 18 and results["step_time_s"] > 0 and results["peak_memory_mib"] > 0
    for name in ("config.json", "metrics.jsonl", "report.txt", "model/comera_config.json", "plots/loss.png"):
        assert (out / name).exists(), name
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals and set(evals[-1]["metrics"]) == {"accuracy", "loss"}
    if method == "dense":
        assert results["params"] == results["dense_params"] and results["compression"]["whole"] == 1.0
        assert results["stage"] == "train"
    else:
        assert results["params"] < results["dense_params"] and results["compression"]["tensorized"] > 1.0
        assert results["stage"] == "late" and (out / "plots" / "ranks.png").exists()


def test_final_accuracy_is_exact_over_the_split(tmp_path):
    import torch
    from torch.utils.data import DataLoader

    import comera

    out = tmp_path / "run"
    results = run("toy", method="comera", preset="smoke", out=out, cache_dir=tmp_path / "cache")
    model = toy.ToyRecipe().build_model({"hidden": 32}, None)
    model = comera.load_pretrained(out / "model", base_model=model)
    model.eval()
    test_split = toy.ToyRecipe().build_data(PRESETS["smoke"]["data"], None, tmp_path / "cache").evals["test"]
    inputs, labels = next(iter(DataLoader(test_split, batch_size=40)))
    with torch.no_grad():
        predicted = model(inputs).argmax(1)
    assert results["evaluation"]["test"]["accuracy"] == pytest.approx(accuracy_score(labels, predicted))


def test_an_existing_run_is_not_overwritten_and_resume_needs_the_same_settings(tmp_path):
    out = tmp_path / "run"
    run("toy", method="comera", preset="smoke", out=out, cache_dir=tmp_path)
    with pytest.raises(SetupError, match="already holds a run; continue it with --resume"):
        run("toy", method="comera", preset="smoke", out=out, cache_dir=tmp_path)
    with pytest.raises(SetupError, match=r"settings \(train.seed: unset \(the default, 0\) then, 3 now\)"):
        run("toy", preset="smoke", out=out, cache_dir=tmp_path, resume=True, assignments=["train.seed=3"])
    with pytest.raises(SetupError, match="there is no run to resume"):
        run("toy", preset="smoke", out=tmp_path / "none", cache_dir=tmp_path, resume=True)
    (out / "config.json").unlink()  # the settings lost, the checkpoints left: --restart is the way out
    with pytest.raises(SetupError, match=r"cannot continue without its settings; start it again with --rest"):
        run("toy", preset="smoke", out=out, cache_dir=tmp_path, resume=True)
    with pytest.raises(SetupError, match="no such file or folder"):
        run("toy", preset="smoke", out=tmp_path / "x", data=tmp_path / "missing.tsv", cache_dir=tmp_path)


def test_the_prune_before_the_save_is_logged_as_a_prune_event(tmp_path):
    """Without prune points (``method.prune_at=[]``) the model is still pruned to its active ranks before it
    is saved; that prune is a ``prune`` event at point ``save`` like any other, so the log tells when the
    saved model took its shapes."""
    out = tmp_path / "run"
    results = run("toy", preset="smoke", out=out, cache_dir=tmp_path, assignments=["method.prune_at=[]"])
    prunes = [r for r in read_metrics(out) if r.get("kind") == "event" and r.get("event") == "prune"]
    assert [event["point"] for event in prunes] == ["save"]
    assert prunes[0]["step"] == results["steps"]
