"""``comera demo``: the table's rows and ratios, the flags, and the speed comparison run for real at the
``smoke`` size (each method in a fresh process) next to accuracy runs stood in for by fixed results."""

import json
from pathlib import Path

import pytest

from comera.cli.commands import demo
from comera.cli.commands.compare import MethodRun

SOURCE = Path(demo.__file__).parents[2]


def _results(params, accuracy, tensorized):
    """A ``results.json`` of an accuracy run."""
    return {
        "evaluation": {"validation": {"accuracy": accuracy, "loss": 0.5}},
        "params": params,
        "compression": {"tensorized": tensorized, "whole": 1.0},
        "data": {"source": "stdlib", "splits": {"train": {"read": 48}, "validation": {"read": 16}}},
    }


def _case(ms, state, rise, params):
    """A speed case as :func:`comera.bench.paper.run_case` reports it."""
    return {"ms": ms, "state_mib": state, "train_mib": rise, "training_mib": state + rise, "params": params}


RESULTS = {"dense": _results(10_000, 0.8325, None), "comera": _results(2_000, 0.8615, 42.5)}


def test_the_table_gives_each_ratio_to_dense():
    speed = {
        "dense": _case(9000.0, 760.0, 770.0, 49_000_000),
        "comera": _case(1500.0, 88.0, 562.0, 1_400_000),
    }
    table = demo.format_table(RESULTS, "preset small (w)", speed, "preset paper (w), batch 32")
    lines = table.splitlines()
    assert lines[0].split() == ["dense", "comera", "comera", "vs", "dense"]
    assert set(lines[1]) == {"-"}
    assert lines[2] == "preset small (w), trained:"
    assert lines[3].split() == ["accuracy", "(validation)", "0.833", "0.862", "+2.9", "points"]
    assert lines[4].split() == ["parameters", "10,000", "2,000", "5.0x", "fewer"]
    assert lines[5].split() == ["compression,", "tensorized", "layers", "-", "42.5x"]
    assert lines[6] == "preset paper (w), batch 32:"
    assert lines[7].split() == ["parameters", "49,000,000", "1,400,000", "35.0x", "fewer"]
    assert lines[8].split() == ["step", "time", "(ms,", "median)", "9000", "1500", "6.0x", "faster"]
    # training memory: 760 + 770 = 1530 MiB against 88 + 562 = 650 MiB
    assert lines[9].split() == ["training", "memory", "(MiB)", "1530", "650", "2.4x", "less"]
    assert lines[10].split() == ["kept", "between", "steps", "760", "88"]
    assert lines[11].split() == ["rise", "during", "a", "step", "770", "562"]
    assert len(lines) == 12
    assert lines[3].index("0.833") + len("0.833") == lines[8].index("9000") + len("9000"), "right-aligned"


def test_a_slower_or_failed_comera_is_said_so():
    speed = {"dense": _case(100.0, 1.0, 1.0, 10), "comera": _case(250.0, 1.0, 3.0, 5)}
    table = demo.format_table(RESULTS, "small", speed, "smoke")
    assert "2.5x slower" in table and "2.0x more" in table
    failed = {"dense": speed["dense"], "comera": {"error": ["RuntimeError: out of memory"]}}
    table = demo.format_table(RESULTS, "small", failed, "paper")
    assert table.splitlines()[-1].endswith("  -  comera failed: RuntimeError: out of memory")
    assert "step time" not in demo.format_table(RESULTS, "small")


def test_the_speed_preset_follows_the_preset():
    assert demo.parse_arguments([]).speed_preset == "paper"
    assert demo.parse_arguments(["--preset", "smoke"]).speed_preset == "smoke"
    assert demo.parse_arguments(["--preset", "smoke", "--speed-preset", "paper"]).speed_preset == "paper"


@pytest.mark.parametrize(
    "flag, value, least", [("--speed-steps", 4, 5), ("--speed-warmup", 0, 1), ("--speed-batch", 0, 1)]
)
def test_a_flag_below_its_range_is_named(flag, value, least, capsys):
    with pytest.raises(SystemExit):
        demo.parse_arguments([flag, str(value)])
    assert f"{flag} must be >= {least}, got {value}" in capsys.readouterr().err


@pytest.fixture
def stand_in_accuracy_runs(monkeypatch, tmp_path):
    """``compare`` replaced by finished runs with :data:`RESULTS` (the accuracy runs train for minutes);
    fresh processes import this checkout."""
    monkeypatch.setenv("PYTHONPATH", str(SOURCE))
    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "cache"))

    def finished(workload, methods, *, preset, assignments, out, rerun):
        runs = []
        for method in methods:
            run_dir = Path(out) / method
            run_dir.mkdir(parents=True)
            if method == "comera":
                (run_dir / "plots").mkdir()  # the dense stand-in plots nothing (as with train.plot=false)
            settings = {"model": {"d_model": 128, "n_layers": 2}}
            (run_dir / "config.json").write_text(json.dumps({"settings": settings}))
            runs.append(MethodRun(method, run_dir, "trained", RESULTS[method]))
        return runs

    monkeypatch.setattr(demo, "compare", finished)


def test_the_demo_measures_both_methods_in_fresh_processes(tmp_path, capsys, stand_in_accuracy_runs):
    out = tmp_path / "demo"
    argv = ["--out", str(out), "--preset", "smoke", "--speed-batch", "4", "--speed-steps", "5"]
    assert demo.main(argv) == 0
    record = json.loads((out / "speed.json").read_text())
    assert record["settings"] == {"preset": "smoke", "batch": 4, "steps": 5, "warmup": 1}
    dense, comera = record["cases"]["dense"], record["cases"]["comera"]
    for method, case in record["cases"].items():
        assert (case["method"], case["preset"], case["batch"]) == (method, "smoke", 4)
        assert len(case["times_ms"]) == 5 and case["ms"] == sorted(case["times_ms"])[2]
        assert case["training_mib"] == case["state_mib"] + max(case["train_mib"], 0.0)
    assert dense["params"] == dense["dense_params"] > comera["params"]
    printed = capsys.readouterr().out
    assert "preset smoke (width 128, 2 blocks), trained:" in printed
    assert "preset smoke (width 16, 2 blocks), batch 4, median of 5 timed steps after 3 untimed:" in printed
    assert f"{dense['params']:,}" in printed and f"{comera['ms']:.0f}" in printed
    assert f"speed and memory: {out}/speed.json" in printed
    assert f"comera: {out}/comera/results.json, plots in {out}/comera/plots/\n" in printed
    assert f"dense: {out}/dense/results.json\n" in printed  # a folder that does not exist is not named


def test_no_speed_leaves_the_speed_comparison_out(tmp_path, capsys, stand_in_accuracy_runs, monkeypatch):
    monkeypatch.setattr(demo, "run_speed", lambda *_: pytest.fail("the speed comparison ran"))
    assert demo.main(["--out", str(tmp_path / "demo"), "--no-speed"]) == 0
    printed = capsys.readouterr().out
    assert "+2.9 points" in printed and "step time" not in printed
    assert not (tmp_path / "demo" / "speed.json").exists()


def test_an_unknown_speed_preset_is_named_before_anything_trains(tmp_path, capsys, stand_in_accuracy_runs):
    assert demo.main(["--out", str(tmp_path / "demo"), "--speed-preset", "huge"]) == 2
    assert "--speed-preset: unknown preset 'huge'" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
