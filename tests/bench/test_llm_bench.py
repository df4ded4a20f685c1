"""``comera bench llm``: the steps table's ratios and its targets said met or missed against hand-made
cases, failed cases kept in the tables, the flags' errors, and a quick run of both sections end to end (each
case in a fresh process, weights plus optimizer state counted as the peers count it)."""

import json

import pytest

from comera.bench import llm


def _row(method, ms, weights_optimizer, training, rank=None):
    row = {
        "method": method,
        "ms": ms,
        "tokens": 1024,
        "tokens_per_s": 1024 / (ms / 1e3),
        "weights_optimizer_mib": weights_optimizer,
        "training_mib": training,
        "peak_mib": 500.0,
        "params": 10,
        "stored_params": 20,
        "dense_params": 50,
        "threads": 2,
    }
    if rank is not None:
        row.update(rank=rank, tensorized_ratio=12.0, model_ratio=3.0)
    return row


def _cells(report, first):
    line = next(line for line in report.splitlines() if line.startswith(f"| {first} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_steps_table_gives_ratios_to_dense_and_the_targets_met_or_missed():
    results = [
        _row("dense", 100.0, 600.0, 1200.0),
        _row("comera", 40.0, 100.0, 300.0),
        _row("galore", 120.0, 400.0, 1100.0),
        _row("apollo", 110.0, 90.0, 900.0),
        {"method": "cola", "error": ["RuntimeError: out of memory"]},
    ]
    report = llm.format_steps(results, "comera bench llm")
    comera = _cells(report, "comera")
    assert comera[1:8] == ["40.0", "25600", "2.50x", "100.0", "6.00x", "300.0", "4.00x"]
    assert "failed: RuntimeError: out of memory" in _cells(report, "cola")[-1]
    targets = llm.step_targets(results)
    assert targets == [
        "- tokens/s >= 2x dense: 2.50x, met",
        "- weights + optimizer state >= 5x smaller than dense: 6.00x, met",
        "- weights + optimizer state below galore's: 100.0 vs 400.0 MiB, met",
        "- weights + optimizer state below apollo's: 100.0 vs 90.0 MiB, missed",
        "- training memory below every baseline's: 300.0 MiB vs the lowest baseline's 900.0 (apollo), met",
    ]
    assert all(line in report for line in targets)


def test_without_a_dense_or_comera_case_the_targets_are_not_measured():
    results = [_row("comera", 40.0, 100.0, 300.0), {"method": "dense", "error": ["killed"]}]
    assert llm.step_targets(results) == ["Targets: not measured (the dense or the comera case failed)."]
    assert "| comera | 40.0 | 25600 | - |" in llm.format_steps(results, "c")


def test_the_title_names_the_settings_that_changed_the_preset():
    """Sections of the same table at other ``--set`` settings (``--label``) get titles of their own."""
    results = [_row("dense", 100.0, 600.0, 1200.0), _row("comera", 40.0, 100.0, 300.0)]
    plain = llm.format_steps(results, "c").splitlines()[0]
    wide = llm.format_steps(results, "c", ["model.hidden_size=256", "model.intermediate_size=704"])
    assert plain == "## Language model (LLaMA-style): one training step per method"
    assert wide.splitlines()[0] == (f"{plain} (`model.hidden_size=256`, `model.intermediate_size=704`)")


def test_the_ladder_table_has_dense_first_then_each_rank():
    results = [_row("dense", 100.0, 600.0, 1200.0), _row("comera", 20.0, 50.0, 200.0, rank=8)]
    results.append({"method": "comera", "rank": 4, "error": ["boom"]})
    report = llm.format_ladder(results, "comera bench llm --sections ladder")
    assert _cells(report, "8") == ["8", "12.0x", "3.00x", "20.0", "51200", "5.00x", "200.0", "6.00x"]
    assert "failed: boom" in _cells(report, "4")[-1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--repeats", "3"], "--repeats must be >= 5"),
        (["--batch", "0"], "--batch and every --ladder rank must be >= 1"),
        (["--preset", "huge"], "--preset: unknown preset 'huge'"),
        (["--methods", "dense", "nope"], "--methods: unknown method 'nope'"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--set", "tensorize.format=tucker"], "error: --set: tensorize.format must be one of"),
        (["--set", "train.nonsense=1"], "error: --set 'train.nonsense=1': unknown key train.nonsense"),
        (["--set", "model"], "error: --set expects section.key=value"),
        (["--label", "a/b"], "--label must be letters, digits"),
    ],
)
def test_bad_flags_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        llm.main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_quick_run_measures_both_sections_in_fresh_processes(tmp_path):
    out = tmp_path / "bench"
    flags = ["--quick", "--methods", "dense", "comera", "--ladder", "2", "--out", str(out)]
    assert llm.main(flags) == 0
    steps = json.loads((out / "steps.json").read_text())["results"]
    assert [row["method"] for row in steps] == ["dense", "comera"]
    for row in steps:
        assert row["tokens"] == llm.tokens_per_step("smoke", 2) == 2 * 32
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / (row["ms"] / 1e3))
        assert 0 < row["weights_optimizer_mib"] < row["training_mib"]
    dense, comera = steps
    assert comera["weights_optimizer_mib"] < dense["weights_optimizer_mib"]
    ladder = json.loads((out / "ladder.json").read_text())["results"]
    assert [row.get("rank") for row in ladder] == [None, 2] and ladder[1]["tensorized_ratio"] > 1
    assert (out / "llm_steps.png").stat().st_size > 1000 and "Targets" in (out / "steps.md").read_text()


def test_settings_given_with_set_reach_every_case_and_label_their_sections(tmp_path):
    """``--set`` changes the preset in the fresh case processes (here TTM projections and 16-token blocks),
    and ``--label`` writes the sections beside the preset's own instead of over them."""
    out, record = tmp_path / "bench", tmp_path / "benchmarks.md"
    record.write_text("<!-- bench:llm-steps:start -->\nthe preset's own\n<!-- bench:llm-steps:end -->\n")
    common = ["--quick", "--sections", "steps", "--methods", "comera", "--set", "data.seq_len=16"]
    assert llm.main([*common, "--out", str(out / "tt")]) == 0
    labelled = ["--set", "tensorize.format=ttm", "--write", str(record), "--label", "ttm"]
    assert llm.main([*common, *labelled, "--out", str(out / "ttm")]) == 0
    tt, ttm = (json.loads((out / name / "steps.json").read_text())["results"][0] for name in ("tt", "ttm"))
    assert tt["tokens"] == ttm["tokens"] == 2 * 16
    assert tt["params"] != ttm["params"]
    written = record.read_text()
    assert "the preset's own" in written and "<!-- bench:llm-steps-ttm:start -->" in written
    assert "tensorize.format=ttm" in written
