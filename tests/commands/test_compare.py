"""``comera compare``: the table against each run's results.json, reuse and resume of finished and unfinished
runs, refusal of bad arguments before anything trains, a failing method reported while the others run, and
the command end to end in fresh processes."""

import json
import os
import subprocess
import sys

import pytest
import toy  # noqa: F401  (registers the toy recipe)

from comera.cli.commands import compare as compare_module
from comera.cli.commands.compare import compare, format_markdown, method_assignments
from comera.recipes.run import SetupError


def _table_rows(markdown: str) -> dict[str, dict[str, str]]:
    """The markdown table as method -> column -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _compare(tmp_path, methods, **kwargs):
    kwargs.setdefault("out", tmp_path / "cmp")
    return compare(
        "toy",
        methods,
        preset="smoke",
        cache_dir=tmp_path,
        fresh_process=False,
        log=lambda line: None,
        **kwargs,
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished comparison of dense and comera on the toy recipe."""
    tmp_path = tmp_path_factory.mktemp("compare")
    runs = _compare(tmp_path, ["dense", "comera"])
    return tmp_path, runs


def test_the_table_reports_each_runs_results(finished):
    tmp_path, runs = finished
    out = tmp_path / "cmp"
    assert [(item.method, item.status) for item in runs] == [("dense", "trained"), ("comera", "trained")]
    results = {item.method: json.loads((item.run_dir / "results.json").read_text()) for item in runs}
    assert {item.method: item.results for item in runs} == results
    rows = _table_rows((out / "comparison.md").read_text())
    assert list(rows) == ["dense", "comera"]
    dense, comera = results["dense"], results["comera"]
    for method, result in results.items():
        row = rows[method]
        split = result["evaluation"]["validation"]
        assert float(row["accuracy"]) == pytest.approx(split["accuracy"], rel=1e-3)
        assert float(row["loss"]) == pytest.approx(split["loss"], rel=1e-3)
        assert int(row["params"].replace(",", "")) == result["params"]
        assert float(row["step ms"]) == pytest.approx(1e3 * result["step_time_s"], rel=1e-3)
        speed = dense["step_time_s"] / result["step_time_s"]
        assert float(row["speed vs dense"].rstrip("x")) == pytest.approx(speed, abs=0.006)
        assert float(row["whole model"].rstrip("x")) == pytest.approx(
            result["compression"]["whole"], abs=0.006
        )
    change = 100 * (
        comera["evaluation"]["validation"]["accuracy"] / dense["evaluation"]["validation"]["accuracy"] - 1
    )
    assert float(rows["comera"]["accuracy vs dense"].rstrip("%")) == pytest.approx(change, abs=0.006)
    assert rows["dense"]["tensorized"] == "-"
    assert float(rows["comera"]["tensorized"].rstrip("x")) == pytest.approx(
        comera["compression"]["tensorized"], abs=0.06
    )
    assert "size target" in rows["comera"]["note"]
    record = json.loads((out / "comparison.json").read_text())
    assert record["primary_metric"] == "accuracy"
    assert [entry["results"] for entry in record["runs"]] == [results["dense"], results["comera"]]
    assert (out / "compare-accuracy.png").stat().st_size > 0


def test_a_finished_run_is_reused_and_rerun_trains_it_again(finished):
    tmp_path, _ = finished
    out = tmp_path / "cmp"
    written = (out / "dense" / "results.json").stat().st_mtime_ns
    again = _compare(tmp_path, ["dense"])
    assert [item.status for item in again] == ["reused"]
    assert (out / "dense" / "results.json").stat().st_mtime_ns == written
    assert "reused" in _table_rows((out / "comparison.md").read_text())["dense"]["note"]
    fresh = _compare(tmp_path, ["dense"], rerun=True)
    assert [item.status for item in fresh] == ["trained"]
    assert (out / "dense" / "results.json").stat().st_mtime_ns != written


def test_an_unfinished_run_is_resumed_from_its_checkpoint(tmp_path):
    first = _compare(tmp_path, ["comera"])
    run_dir = first[0].run_dir
    (run_dir / "results.json").unlink()
    resumed = _compare(tmp_path, ["comera"])
    assert resumed[0].status == "trained"
    assert resumed[0].results["steps"] == first[0].results["steps"]
    assert resumed[0].results["evaluation"] == first[0].results["evaluation"]


def test_each_run_is_resolved_once_and_trained_from_its_spec(tmp_path, monkeypatch):
    """The plan's :class:`comera.recipes.spec.RunSpec` of each run is the one its in-process run trains: the
    settings are layered once per run, not once to plan and again to train."""
    from comera.recipes import spec

    layered = []
    original = spec.layered_settings
    monkeypatch.setattr(
        spec, "layered_settings", lambda *a, **k: layered.append(a[2].name) or original(*a, **k)
    )
    done = _compare(tmp_path, ["dense", "comera"])
    assert [item.status for item in done] == ["trained", "trained"]
    assert layered == ["dense", "comera"]


@pytest.mark.parametrize("damage", ["null", "{}", '{"evaluation": "oops"}', "{not json"])
def test_a_damaged_results_json_makes_the_run_resume_not_be_reused(tmp_path, damage):
    """A ``results.json`` that is not what a finished run writes (JSON null, no evaluation object, not JSON)
    is not reused as a row: the run is resumed from its checkpoint, which writes it again."""
    first = _compare(tmp_path, ["comera"])
    run_dir = first[0].run_dir
    (run_dir / "results.json").write_text(damage)
    resumed = _compare(tmp_path, ["comera"])
    assert resumed[0].status == "trained"
    assert resumed[0].results["evaluation"] == first[0].results["evaluation"]
    assert json.loads((run_dir / "results.json").read_text())["evaluation"] == first[0].results["evaluation"]


def test_a_folder_with_other_settings_is_refused_before_anything_trains(finished):
    tmp_path, _ = finished
    with pytest.raises(SetupError, match=r"cmp/dense holds a run with other settings.*settings"):
        _compare(tmp_path, ["lte", "dense"], assignments=["train.lr_other=0.5"])
    assert not (tmp_path / "cmp" / "lte").exists()


@pytest.mark.parametrize(
    ("methods", "kwargs", "message"),
    [
        ([], {}, r"methods: give at least one of \["),
        (["dense", "comera", "dense"], {}, r"each method at most once; repeated: \['dense'\]"),
        (["dense", "sgd"], {}, r"unknown method 'sgd'"),
        (["dense"], {"preset": "huge"}, r"unknown preset 'huge'"),
        (["dense", "comera"], {"assignments": ["train.bogus=1"]}, r"unknown key train.bogus"),
        (["dense", "lte"], {"assignments": ["method.gamma=2"]}, r"method\.gamma: none of the compared"),
        (["dense"], {"data": "no/such/file.tsv"}, r"--data no/such/file.tsv: no such file"),
    ],
)
def test_bad_arguments_are_refused_before_anything_trains(tmp_path, methods, kwargs, message):
    kwargs = dict(kwargs)  # the parametrized dict is shared by every run of this test in the process
    preset = kwargs.pop("preset", "smoke")
    with pytest.raises(SetupError, match=message):
        compare(
            "toy",
            methods,
            preset=preset,
            out=tmp_path / "cmp",
            cache_dir=tmp_path,
            fresh_process=False,
            log=lambda line: None,
            **kwargs,
        )
    assert not (tmp_path / "cmp").exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "cmp").write_text("not a folder")
    with pytest.raises(SetupError, match=r"--out .*cmp is a file"):
        _compare(tmp_path, ["dense"])


def test_a_missing_package_is_refused_before_anything_trains(tmp_path, monkeypatch):
    class Missing:
        def package(self):
            raise ImportError("the 'galore' method needs the 'galore-torch' package")

    real = compare_module.get_method
    monkeypatch.setattr(compare_module, "get_method", lambda name: Missing() if name == "lte" else real(name))
    with pytest.raises(SetupError, match="needs the 'galore-torch' package"):
        _compare(tmp_path, ["dense", "lte"])
    assert not (tmp_path / "cmp").exists()


def test_a_failing_method_is_reported_and_the_others_still_run(tmp_path):
    runs = _compare(tmp_path, ["lte", "dense"], assignments=["train.batch_size=18"])
    assert [(item.method, item.status) for item in runs] == [("lte", "failed"), ("dense", "trained")]
    assert "must be a multiple of method.heads=4" in runs[0].error
    rows = _table_rows((tmp_path / "cmp" / "comparison.md").read_text())
    assert rows["lte"]["note"].startswith("failed: ") and rows["lte"]["params"] == "-"
    assert rows["dense"]["params"] != "-"


def test_without_a_dense_row_there_are_no_ratios(finished):
    _, runs = finished
    rows = _table_rows(format_markdown([runs[1]], "accuracy"))
    assert rows["comera"]["speed vs dense"] == "-" and "accuracy vs dense" not in rows["comera"]


def test_the_command_compares_in_fresh_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "comera", "compare", "nli", "--preset", "smoke"]
    command += ["--methods", "dense", "comera", "--out", str(tmp_path / "cmp"), "--cache", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = _table_rows(done.stdout)
    assert list(rows) == ["dense", "comera"]
    for method, row in rows.items():
        results = json.loads((tmp_path / "cmp" / method / "results.json").read_text())
        assert float(row["accuracy"]) == pytest.approx(
            results["evaluation"]["validation"]["accuracy"], rel=1e-3
        )
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "reusing the finished run" in again.stdout
    bad = subprocess.run([*command, "--set", "train.bogus=1"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "comera compare: " in bad.stderr and "train.bogus" in bad.stderr


def test_a_method_setting_reaches_only_the_methods_that_have_it():
    routed = method_assignments(
        ["dense", "comera", "lte"], ["train.seed=3", "method.gamma=0.5", "method.target_ratio=0.3"]
    )
    assert routed["dense"] == routed["lte"] == ["train.seed=3"]
    assert routed["comera"] == ["train.seed=3", "method.gamma=0.5", "method.target_ratio=0.3"]


def test_a_method_setting_no_compared_method_has_is_refused_naming_its_owner(tmp_path):
    with pytest.raises(
        SetupError, match=r"method\.gamma: none of the compared methods \['dense'\].*\['comera'\]"
    ):
        _compare(tmp_path, ["dense"], assignments=["method.gamma=0.5"])


def test_a_comparison_with_a_comera_setting_trains_dense_with_its_own_settings(tmp_path):
    runs = _compare(tmp_path, ["dense", "comera"], assignments=["method.gamma=0.5"])
    assert [run.status for run in runs] == ["trained", "trained"]
    configs = {run.method: json.loads((run.run_dir / "config.json").read_text()) for run in runs}
    assert configs["comera"]["settings"]["method"]["gamma"] == 0.5
    assert "gamma" not in configs["dense"]["settings"]["method"]


def test_a_variant_is_one_more_row_with_settings_of_its_own(tmp_path):
    variants = {"comera-r2": ("comera", ["method.target_ratio=0.8", "tensorize.rank=2"])}
    runs = _compare(tmp_path, ["dense", "comera"], assignments=["method.gamma=0.5"], variants=variants)
    assert [(run.method, run.status) for run in runs] == [
        ("dense", "trained"),
        ("comera", "trained"),
        ("comera-r2", "trained"),
    ]
    configs = {run.method: json.loads((run.run_dir / "config.json").read_text()) for run in runs}
    variant = configs["comera-r2"]
    assert runs[2].run_dir == tmp_path / "cmp" / "comera-r2" and variant["method"] == "comera"
    assert variant["settings"]["method"]["gamma"] == 0.5, "the common settings reach the variant"
    assert (
        variant["settings"]["method"]["target_ratio"] == 0.8 and variant["settings"]["tensorize"]["rank"] == 2
    )
    assert configs["comera"]["settings"]["method"]["target_ratio"] != 0.8
    rows = _table_rows((tmp_path / "cmp" / "comparison.md").read_text())
    assert list(rows) == ["dense", "comera", "comera-r2"] and rows["comera-r2"]["speed vs dense"] != "-"
    again = _compare(tmp_path, ["dense"], variants=variants, assignments=["method.gamma=0.5"])
    assert [(run.method, run.status) for run in again] == [("dense", "reused"), ("comera-r2", "reused")]


@pytest.mark.parametrize(
    "variants, message",
    [
        ({"dense": ("comera", [])}, r"variant name 'dense' must be .* not a method's name"),
        ({"a/b": ("comera", [])}, r"variant name 'a/b' must be letters"),
        ({"v": ("nope", [])}, r"unknown method 'nope'"),
        ({"v": ("comera", ["tensorize.rank"])}, r"tensorize\.rank"),
        ({"v": ("comera", ["train.bogus=1"])}, r"train\.bogus"),
    ],
)
def test_a_bad_variant_is_refused_before_anything_trains(tmp_path, variants, message):
    with pytest.raises(SetupError, match=message):
        _compare(tmp_path, ["dense"], variants=variants)
    assert not (tmp_path / "cmp" / "dense").exists()


@pytest.mark.parametrize(
    "words, message",
    [
        (["--variant", "v"], "--variant v: give NAME METHOD"),
        (["--variant", "v", "comera"] * 2, "at most once"),
    ],
)
def test_the_command_refuses_a_short_or_repeated_variant(words, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare_module.main(["toy", "--methods", "dense", *words])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "passed"), [([], "--no-progress"), (["--progress"], "--progress")])
def test_the_progress_option_reaches_every_run(tmp_path, monkeypatch, flag, passed):
    """``--no-progress`` (the default) and ``--progress`` are accepted, as ``comera train`` takes them, and
    each run gets the choice."""
    commands = []
    monkeypatch.setattr(compare_module, "run_child", lambda command: commands.append(command) or 1)
    arguments = ["nli", "--preset", "smoke", "--methods", "dense", "comera", "--out", str(tmp_path / "c")]
    assert compare_module.main([*arguments, "--cache", str(tmp_path), *flag]) == 1
    assert len(commands) == 2 and all(command[-1] == passed for command in commands), commands
    assert compare_module.main([*arguments, "--cache", str(tmp_path), "--no-progress"]) == 1


def test_a_comparison_stopped_before_anything_was_written_leaves_no_folder(tmp_path, monkeypatch):
    """A Ctrl-C during the first run (which removes its own folder), or a start refused by its ``--cache``,
    removes the comparison folder and the parents the call made, when nothing was written in them; a folder
    that existed before stays."""
    (tmp_path / "cache-file").write_text("a file")
    with pytest.raises(SetupError, match="--cache"):
        cache = tmp_path / "cache-file" / "x"
        compare("toy", ["dense"], preset="smoke", out=tmp_path / "a" / "b", cache_dir=cache)
    assert not (tmp_path / "a").exists()

    def interrupted(spec, arguments):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare_module, "_in_process_runner", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _compare(tmp_path, ["dense"], out=tmp_path / "a" / "b" / "cmp")
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(KeyboardInterrupt):
        _compare(tmp_path, ["dense"], out=tmp_path / "kept")
    assert (tmp_path / "kept").is_dir()
