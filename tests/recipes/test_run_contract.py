"""Contract of ``comera.recipes.run``: results.json's step time, peak memory and per-rank numbers, strict
JSON, the resume refusals and their messages, the empty-split and run-folder messages, default folders."""

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
import toy
from torch.utils.data import TensorDataset

from comera.recipes import run_folder
from comera.recipes.base import RecipeData, register_recipe
from comera.recipes.run import (
    SetupError,
    default_cache_dir,
    default_run_dir,
    read_run_config,
    run,
)
from comera.recipes.run_folder import header_difference
from comera.recipes.run_records import median_step_time, peak_memory, per_rank_summary, strict_json
from comera.recipes.spec import run_spec


def _train(step_time=None, peak=None, **extra):
    record = {"kind": "train", **extra}
    if step_time is not None:
        record["step_time"] = step_time
    if peak is not None:
        record["peak_memory_mib"] = peak
    return record


def test_step_time_is_the_median_after_the_first_window():
    """The first train record is dropped (warm-up); eval/event records, zero and missing times are ignored."""
    records = [
        _train(10.0),
        {"kind": "eval", "step_time": 100.0},
        _train(),
        _train(0.0),
        _train(1.0),
        {"kind": "event", "step_time": 50.0},
        _train(2.0),
        _train(3.0),
    ]
    assert median_step_time(records) == 2.0


@pytest.mark.parametrize(("times", "expected"), [([5.0], 5.0), ([10.0, 1.0], 1.0), ([9.0, 1.0, 3.0], 2.0)])
def test_step_time_keeps_a_single_window_and_drops_only_the_first(times, expected):
    """One window is kept as it is; with two or more only the first is dropped."""
    assert median_step_time([_train(t) for t in times]) == expected


def test_step_time_and_peak_memory_are_nan_without_train_records():
    """No measured train step: both numbers are NaN (written as null)."""
    records = [{"kind": "eval", "metrics": {}}, _train()]
    assert math.isnan(median_step_time(records))
    assert math.isnan(peak_memory(records))


def test_peak_memory_is_the_largest_of_the_train_records():
    """The peak over train records only (an eval record's number does not count)."""
    records = [_train(1.0, 30.0), {"kind": "eval", "peak_memory_mib": 999.0}, _train(1.0, 50.0), _train(1.0)]
    assert peak_memory(records) == 50.0


def test_per_rank_numbers_are_per_rank_medians_and_peaks():
    """Per rank: the median step time after the first window, the largest peak; eval rows are ignored."""
    records = [
        _train(step_time_per_rank=[10.0, 20.0], peak_memory_mib_per_rank=[5.0, 7.0]),
        {"kind": "eval", "step_time_per_rank": [99.0, 99.0], "peak_memory_mib_per_rank": [99.0, 99.0]},
        _train(step_time_per_rank=[1.0, 2.0], peak_memory_mib_per_rank=[9.0, 6.0]),
        _train(step_time_per_rank=[3.0, 4.0], peak_memory_mib_per_rank=[8.0, 1.0]),
    ]
    assert per_rank_summary(records, 2) == {
        "step_time_s_per_rank": [2.0, 3.0],
        "peak_memory_mib_per_rank": [9.0, 7.0],
    }


def test_per_rank_of_a_single_window_and_of_a_single_process():
    """One window per rank is kept as it is; records without per-rank numbers give no keys."""
    records = [_train(step_time_per_rank=[4.0, 6.0, 8.0], peak_memory_mib_per_rank=[1.0, 2.0, 3.0])]
    assert per_rank_summary(records, 3) == {
        "step_time_s_per_rank": [4.0, 6.0, 8.0],
        "peak_memory_mib_per_rank": [1.0, 2.0, 3.0],
    }
    assert per_rank_summary([_train(1.0, 2.0)], 1) == {}
    two = [
        _train(step_time_per_rank=[10.0, 20.0], peak_memory_mib_per_rank=[1.0, 2.0]),
        _train(step_time_per_rank=[1.0, 2.0], peak_memory_mib_per_rank=[1.0, 2.0]),
    ]
    assert per_rank_summary(two, 2)["step_time_s_per_rank"] == [1.0, 2.0], "of two windows the second"


def test_per_rank_numbers_come_from_the_records_of_the_final_process_count():
    """A run resumed with another ``--nproc``: the per-rank numbers describe the processes it ended with
    (none when it ended in one), not those of an earlier attempt."""
    records = [
        _train(step_time_per_rank=[10.0, 20.0], peak_memory_mib_per_rank=[5.0, 7.0]),
        _train(step_time_per_rank=[11.0, 21.0], peak_memory_mib_per_rank=[5.0, 7.0]),
        _train(1.0, 2.0),
    ]
    assert per_rank_summary(records, 1) == {}
    three = [_train(step_time_per_rank=[1.0, 2.0, 3.0], peak_memory_mib_per_rank=[4.0, 5.0, 6.0])]
    assert per_rank_summary(records + three, 3) == {
        "step_time_s_per_rank": [1.0, 2.0, 3.0],
        "peak_memory_mib_per_rank": [4.0, 5.0, 6.0],
    }


def test_strict_json_is_indented_by_two_with_null_for_non_finite_numbers():
    """The exact text: two-space indent, NaN and infinity as null, a final newline."""
    text = strict_json({"a": [1.0, float("nan")], "b": float("inf")})
    assert text == '{\n  "a": [\n    1.0,\n    null\n  ],\n  "b": null\n}\n'


def test_strict_json_refuses_a_non_finite_number_it_cannot_replace():
    """A NaN dict key cannot become null: strict JSON refuses it rather than write ``NaN``."""
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        strict_json({float("nan"): 1})


def test_an_unreadable_config_json_is_named(tmp_path):
    """``config.json`` that is not JSON: the message names the file and what to do."""
    path = tmp_path / "config.json"
    path.write_text("{")
    expected = (
        re.escape(f"{path} is not valid JSON (")
        + r".+"
        + re.escape(
            "), so the run in its folder cannot be checked against this command; repair the file, or use "
            "another --out"
        )
    )
    with pytest.raises(ValueError, match=f"^{expected}$"):
        read_run_config(path)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[1, 2]", "holds a JSON array, not the object a run writes"),
        ('"a run"', "holds a JSON string, not the object a run writes"),
        ("3", "holds a JSON number, not the object a run writes"),
        ("null", "holds a JSON null, not the object a run writes"),
        ('{"settings": "oops"}', "holds a JSON string under 'settings', where a run writes an object"),
        (
            '{"settings": {"model": {}, "train": [1, 2]}}',
            "holds a JSON array under 'settings.train', where a run writes an object",
        ),
    ],
)
def test_a_config_json_not_shaped_as_a_run_writes_it_is_named(tmp_path, text, problem):
    """Valid JSON that is not shaped as a run writes it (an object whose settings are objects): the same
    named refusal as invalid JSON, with the JSON type and the key."""
    path = tmp_path / "config.json"
    path.write_text(text)
    expected = re.escape(
        f"{path} {problem}, so the run in its folder cannot be checked against this command; repair the "
        "file, or use another --out"
    )
    with pytest.raises(ValueError, match=f"^{expected}$"):
        read_run_config(path)


@pytest.mark.parametrize(
    "recorded", [{"settings": {"method": None, "train": {"seed": 0}}}, {"recipe": "toy"}]
)
def test_a_config_json_shaped_as_a_run_writes_it_is_read(tmp_path, recorded):
    """Null sections (as a method without settings writes) and missing settings are accepted shapes."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(recorded))
    assert read_run_config(path) == recorded


def test_a_header_without_data_files_matches_any_fingerprint():
    """A folder written before fingerprints were recorded compares equal on everything else."""
    header = {"recipe": "toy", "data": None, "data_files": {"a": 1}, "settings": {"train": {"seed": 0}}}
    recorded = {key: value for key, value in header.items() if key != "data_files"}
    assert header_difference(recorded, header) is None


def test_every_changed_setting_is_named_in_order():
    """Several changed settings are listed sorted, ``then``/``now``, separated by ``; ``."""
    recorded = {"recipe": "toy", "settings": {"model": {"hidden": 32}, "train": {"seed": 0, "early": 2}}}
    header = {"recipe": "toy", "settings": {"model": {"hidden": 24}, "train": {"seed": 3, "early": 2}}}
    assert header_difference(recorded, header) == (
        "it was started with other settings (model.hidden: 32 then, 24 now; train.seed: 0 then, 3 now)"
    )


def _recorded_identity(tmp_path, identity):
    (tmp_path / "config.json").write_text(json.dumps({"recipe": "toy", "data_identity": identity}))


def test_a_resume_with_other_built_data_names_the_entry_and_both_digests(tmp_path):
    """The first entry (sorted) whose digest differs is named, with both digests cut to 12 characters."""
    then = {"a": "0" * 64, "b": "1234567890abcdef" * 4}
    now = {"a": "0" * 64, "b": "fedcba0987654321" * 4}
    _recorded_identity(tmp_path, then)
    cache = tmp_path / "cache"
    expected = (
        f"--resume: the run in {tmp_path} cannot continue: the data build made another b than the run's "
        "(sha256 1234567890ab then, fedcba098765 now; it is trained on the machine, and training it again "
        "need not give the same one): resume with the --cache folder the run used (this command read "
        f"{cache}), or start it again with --restart"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        run_folder.check_data_identity(tmp_path, now, cache)
    run_folder.check_data_identity(tmp_path, then, cache)  # the same build: no error


@pytest.mark.parametrize(
    ("then", "now", "shown"),
    [(None, {"v": "ab"}, "None then, ab now"), ({"v": "ab"}, None, "ab then, None now")],
)
def test_a_resume_where_one_side_has_no_identity_shows_none(tmp_path, then, now, shown):
    """A missing identity on either side is shown as ``None``."""
    _recorded_identity(tmp_path, then)
    with pytest.raises(ValueError, match=rf"another v than the run's \(sha256 {shown};"):
        run_folder.check_data_identity(tmp_path, now, tmp_path)


def test_a_folder_without_a_recorded_identity_resumes(tmp_path):
    """A ``config.json`` written before identities were recorded passes any identity."""
    (tmp_path / "config.json").write_text(json.dumps({"recipe": "toy"}))
    run_folder.check_data_identity(tmp_path, {"v": "ab"}, tmp_path)


def test_the_aside_folder_is_the_first_free_number(tmp_path):
    """``OUT.old-N``: N is the first number not taken."""
    out = tmp_path / "run"
    assert run_folder.aside_name(out) == tmp_path / "run.old-1"
    (tmp_path / "run.old-1").mkdir()
    assert run_folder.aside_name(out) == tmp_path / "run.old-2"


def _header(seed):
    return run_spec("toy", "dense", "smoke", assignments=[f"train.seed={seed}"]).header()


def test_a_refused_resume_names_the_difference_and_the_ways_out(tmp_path):
    """The whole refusal: the folder, the changed setting, and the three ways to go on."""
    (tmp_path / "config.json").write_text(json.dumps(_header(0)))
    expected = (
        f"--resume: the run in {tmp_path} cannot continue: it was started with other settings (train.seed: 0 "
        "then, 3 now); resume with the same command and data, start it again with --restart, or start a new "
        "run with another --out"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        run_folder.check_run_folder(tmp_path, _header(3), True)
    assert run_folder.check_run_folder(tmp_path, _header(0), True) is None


def test_a_folder_holding_a_run_is_refused_with_the_ways_out(tmp_path):
    """A new run into a folder holding one: the whole message."""
    (tmp_path / "metrics.jsonl").write_text("")
    expected = (
        f"{tmp_path} already holds a run; continue it with --resume, start it again with --restart (its "
        "files are moved aside), or choose another --out"
    )
    with pytest.raises(FileExistsError, match=f"^{re.escape(expected)}$"):
        run_folder.check_run_folder(tmp_path, _header(0), False)


def _data(train, evals, info):
    return RecipeData(train=train, evals=evals, info=info)


def _examples(count):
    return TensorDataset(torch.zeros(count, 2))


@pytest.mark.parametrize(
    ("counts", "shown"),
    [(None, ""), ({}, " (0 read, 0 skipped)"), ({"read": 5, "skipped": 2}, " (5 read, 2 skipped)")],
)
def test_an_empty_split_is_named_with_its_counts(tmp_path, counts, shown):
    """An empty split names the data source, the split and, when the recipe counted them, read/skipped."""
    info = {} if counts is None else {"splits": {"test": counts}}
    data = _data(_examples(3), {"test": _examples(0)}, info)
    expected = f"--data {tmp_path}: the test split has no examples{shown}; give data with some"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        run_folder.check_splits(data, tmp_path)


def test_an_empty_train_split_of_the_embedded_data_is_named():
    """Without ``--data`` the source is the embedded data; the train split is named ``train``."""
    data = _data(_examples(0), {"test": _examples(2)}, {"splits": {"train": {"read": 0, "skipped": 4}}})
    expected = "the embedded data: the train split has no examples (0 read, 4 skipped); give data with some"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        run_folder.check_splits(data, None)


def test_default_folders(monkeypatch, tmp_path):
    """The cache is ``$COMERA_CACHE`` or ``~/.cache/comera``; the run folder ``runs/RECIPE-PRESET-METHOD``."""
    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("COMERA_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "comera"
    assert default_run_dir("toy", "smoke", "dense") == Path("runs") / "toy-smoke-dense"


IDENTITY = {"vocab": "a1b2c3d4e5f6a7b8c9d0" * 3}
"""What the contract recipe's data build reports as made on the machine (a test changes it)."""


@register_recipe
class ContractRecipe(toy.ToyRecipe):
    """The toy, reporting what :func:`run` handed it: the data path, the cache folder, the seed in force
    when the model was built; an ``identity``; a ``split`` setting that empties or drops the test split."""

    name = "toy_contract"
    presets = {
        "smoke": {
            "model": {"hidden": 8},
            "data": {"train_samples": 64, "eval_samples": 8, "split": "full"},
            "train": {"early": 1, "late": 0, "log_every": 1, "plot": False},
            "tensorize": {"preset": "toy-mlp"},
        }
    }

    def build_data(self, settings, data_path, cache_dir):
        data = super().build_data(settings, data_path, cache_dir)
        evals = {"validation": data.evals["validation"]}
        if settings["split"] == "empty":
            evals["test"] = _examples(0)
        elif settings["split"] == "full":
            evals["test"] = data.evals["test"]
        info = {
            **data.info,
            "seen": {"data": str(data_path), "cache": str(cache_dir)},
            "identity": dict(IDENTITY),
        }
        return RecipeData(train=data.train, evals=evals if settings["split"] != "none" else {}, info=info)

    def build_model(self, settings, data):
        self.seed = torch.initial_seed()
        return super().build_model(settings, data)

    def evaluator(self, settings):
        assert settings["model"]["hidden"] == 8, "the evaluator is given the run's settings"
        return super().evaluator(settings)

    def extra_results(self, results, data, trainer):
        return {"seed_seen": self.seed}


def _run(tmp_path, **arguments):
    return run(
        "toy_contract", method="dense", preset="smoke", **{"cache_dir": tmp_path / "cache", **arguments}
    )


@pytest.fixture(scope="module")
def contract_run(tmp_path_factory):
    """One dense run of the contract recipe with ``--data`` given; its folder and results."""
    tmp_path = tmp_path_factory.mktemp("contract")
    data = tmp_path / "data.txt"
    data.write_text("unused")
    started = time.perf_counter()
    results = _run(tmp_path, out=tmp_path / "run", data=data)
    return tmp_path, data, {**results, "measured_s": time.perf_counter() - started}


def test_the_recipe_gets_the_data_path_and_the_cache_and_the_seed(contract_run):
    """``--data``, ``--cache`` reach the data build; without ``train.seed`` the model is built at seed 0."""
    tmp_path, data, results = contract_run
    assert results["data"]["seen"] == {"data": str(data), "cache": str(tmp_path / "cache")}
    assert results["seed_seen"] == 0


def test_the_header_records_the_data_and_its_identity(contract_run):
    """``config.json`` names the resolved data path and the build's identity."""
    tmp_path, data, _ = contract_run
    header = json.loads((tmp_path / "run" / "config.json").read_text())
    assert header["data"] == str(data.resolve()) and header["data_identity"] == IDENTITY
    assert (tmp_path / "run" / "config.json").read_text() == json.dumps(header, indent=2) + "\n"


def test_results_json_keys_and_single_process_numbers(contract_run):
    """results.json: the header's names, one process, no non-finite step, 2 steps of the default batch 32."""
    tmp_path, _, results = contract_run
    measured = results.pop("measured_s")
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results
    assert 0 < results["wall_time_s"] <= measured, "a fresh run's wall time is this process's alone"
    assert (results["recipe"], results["method"], results["preset"]) == ("toy_contract", "dense", "smoke")
    assert results["processes"] == 1 and results["nonfinite_steps"] == 0 and results["steps"] == 2
    assert "step_time_s_per_rank" not in results and "earlier_run" not in results
    assert set(results["evaluation"]) == {"validation", "test"}


def test_a_resume_with_other_built_data_is_refused(contract_run, monkeypatch):
    """A resume whose data build reports another identity is refused naming the entry and both digests."""
    tmp_path, data, _ = contract_run
    monkeypatch.setitem(IDENTITY, "vocab", "ffffffffffffffff")
    cache = tmp_path / "cache"
    expected = (
        f"--resume: the run in {tmp_path / 'run'} cannot continue: the data build made another vocab than "
        "the run's (sha256 a1b2c3d4e5f6 then, ffffffffffff now; it is trained on the machine, and training "
        "it again need not give the same one): resume with the --cache folder the run used (this command "
        f"read {cache}), or start it again with --restart"
    )
    with pytest.raises(SetupError, match=f"^{re.escape(expected)}$"):
        _run(tmp_path, out=tmp_path / "run", data=data, resume=True)


def test_an_empty_split_of_given_data_names_the_data_path(tmp_path):
    """An empty split of ``--data PATH`` is named with that path."""
    data = tmp_path / "data.txt"
    data.write_text("unused")
    expected = f"--data {data}: the test split has no examples (8 read, 0 skipped); give data with some"
    with pytest.raises(SetupError, match=f"^{re.escape(expected)}$"):
        _run(tmp_path, out=tmp_path / "run", data=data, assignments=["data.split=empty"])


def test_a_run_without_evaluation_splits_and_with_a_seed(tmp_path):
    """A recipe with no evaluation split trains and reports none; ``train.seed`` is the build's seed."""
    results = _run(tmp_path, out=tmp_path / "run", assignments=["data.split=none", "train.seed=5"])
    assert results["evaluation"] == {} and results["seed_seen"] == 5


def test_the_default_folders_are_used(tmp_path, monkeypatch):
    """Without ``out`` and ``cache_dir``: ``runs/RECIPE-PRESET-METHOD`` and ``$COMERA_CACHE``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "env-cache"))
    results = run("toy_contract", method="dense", preset="smoke", assignments=["data.split=none"])
    assert (tmp_path / "runs" / "toy_contract-smoke-dense" / "results.json").is_file()
    assert results["data"]["seen"]["cache"] == str(tmp_path / "env-cache")


@pytest.mark.parametrize("option", ["out", "cache_dir"])
def test_a_file_in_place_of_a_folder_names_the_option(tmp_path, option):
    """``--out`` or ``--cache`` naming a file is refused naming the option and the path."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    arguments = {"out": tmp_path / "run", "cache_dir": tmp_path / "cache", option: blocker}
    flag = "--out" if option == "out" else "--cache"
    with pytest.raises(SetupError, match=f"^{re.escape(f'{flag} {blocker} is a file, not a folder')}$"):
        run("toy_contract", method="dense", preset="smoke", **arguments)


def test_run_arguments_are_checked_before_anything_is_built(tmp_path):
    """The default preset is ``small``; resume with restart, and a config file's bad key, are refused."""
    with pytest.raises(SetupError, match=r"^unknown preset 'small'; choose one of \['smoke'\]$"):
        run("toy_contract", out=tmp_path / "run", cache_dir=tmp_path)
    expected = "--resume and --restart exclude each other: continue the run, or start it again"
    with pytest.raises(SetupError, match=f"^{re.escape(expected)}$"):
        _run(tmp_path, out=tmp_path / "run", resume=True, restart=True)
    config = tmp_path / "run.toml"
    config.write_text("[model]\nwidth = 3\n")
    with pytest.raises(SetupError, match=r"unknown key model\.width"):
        _run(tmp_path, out=tmp_path / "run", config_file=config)
    with pytest.raises(ValueError, match=r"unknown key model\.width"):
        run_spec("toy_contract", "dense", "smoke", config_file=config).header()


def test_a_config_json_with_a_utf8_byte_order_mark_is_read(tmp_path):
    """A ``config.json`` saved again by an editor that writes a BOM still resumes its run."""
    path = tmp_path / "config.json"
    path.write_bytes(b'\xef\xbb\xbf{"recipe": "toy", "settings": {"train": {"seed": 0}}}')
    assert read_run_config(path) == {"recipe": "toy", "settings": {"train": {"seed": 0}}}
