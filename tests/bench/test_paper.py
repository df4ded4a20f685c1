"""``comera bench paper``: one case in process (LTE's heads at batch 1, timings and counts; a ladder rung),
the report's ratios and plots, the flags' errors, the transformer section with its cases in fresh processes
on the toy recipe, and the whole ``--quick`` run (every section)."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comera.bench import paper

RECIPES = Path(__file__).parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))
import toy  # noqa: E402, F401  (registers the toy recipe)


def test_lte_heads_divide_the_batch():
    assert [paper.lte_heads(batch, 4) for batch in (1, 2, 6, 8, 9, 32)] == [1, 2, 3, 4, 3, 4]


def test_a_case_times_every_step_and_counts_parameters(tmp_path):
    result = paper.run_case("toy", "smoke", "lte", 1, repeats=5, warmup=1, cache_dir=tmp_path)
    assert result["settings"] == ["method.heads=1"] and result["batch"] == 1
    assert len(result["times_ms"]) == 5 and result["ms"] == statistics.median(result["times_ms"])
    # one head of rank 16 on 16 -> 32 and of rank 32 on 32 -> 32, next to the dense model
    assert (
        result["dense_params"] == 1699 and result["stored_params"] == 1699 + (16 * 16 + 32 * 16) + 2 * 32 * 32
    )
    assert result["params"] == result["stored_params"] - (16 * 32 + 32 * 32), "main weights are frozen"


def _row(method, batch, ms, mib, settings=(), state=0.25):
    """A case whose training memory is ``mib``: ``state`` MiB kept between steps plus the step's rise."""
    return {
        "method": method,
        "batch": batch,
        "ms": ms,
        "state_mib": state,
        "train_mib": mib - state,
        "training_mib": mib,
        "settings": list(settings),
        "params": 10,
        "stored_params": 20,
        "dense_params": 50,
    }


def test_report_gives_ratios_to_comera_and_marks_failures(tmp_path):
    results = [
        _row("comera", 8, 2.0, 4.0),
        _row("dense", 8, 10.0, 36.0),
        _row("lte", 1, 3.0, 1.0, ["method.heads=1"]),
        {"method": "galore", "batch": 8, "error": ["ImportError: pip install 'comera[baselines]'"]},
    ]
    report = paper.format_report(results, "comera bench paper")
    assert "| 8 | dense | 10.0 | 5.00x | 0.2 | 35.8 | 36.0 | 9.00x | 10 | 2.50x |  |" in report
    assert "| 8 | comera | 2.0 | 1.00x | 0.2 | 3.8 | 4.0 | 1.00x | 10 | 2.50x |  |" in report
    assert "| 1 | lte | 3.0 | - | 0.2 | 0.8 | 1.0 | - | 10 | 2.50x | method.heads=1 |" in report
    assert "| 8 | galore | - | - | - | - | - | - | - | - | failed: ImportError" in report
    pytest.importorskip("matplotlib")
    written = paper.plot_report(results, tmp_path)
    assert [path.name for path in written] == ["transformer_time.png", "transformer_memory.png"]
    assert all(path.stat().st_size > 1000 for path in written)


def test_a_memory_rise_below_the_floor_is_not_divided_by():
    results = [_row("comera", 1, 2.0, 0.5), _row("galore", 1, 5.0, 12.0), _row("comera", 8, 2.0, 1.5)]
    results.append(_row("dense", 8, 4.0, 6.0))
    report = paper.format_report(results, "comera bench paper")
    assert "| 1 | galore | 5.0 | 2.50x | 0.2 | 11.8 | 12.0 | - |" in report
    assert "| 8 | dense | 4.0 | 2.00x | 0.2 | 5.8 | 6.0 | 4.00x |" in report


def test_a_case_killed_without_a_message_says_how_it_ended(tmp_path, monkeypatch):
    def killed(command, **_):
        return subprocess.CompletedProcess(command, -15, stdout="", stderr="")

    monkeypatch.setattr(paper.subprocess, "run", killed)
    args = paper.parse_arguments(["--sections", "transformer", "--out", str(tmp_path)])
    result = paper.run_fresh_case(
        args.workload, args.preset, "dense", 1, repeats=args.repeats, warmup=args.warmup, cache_dir=tmp_path
    )
    assert result["error"] == ["exit status -15, nothing on stderr"]
    assert "failed: exit status -15, nothing on stderr" in paper.format_report([result], "c")


@pytest.fixture
def fresh_cases(monkeypatch):
    """Cases run in fresh interpreters, which must import this checkout and the toy recipe; the thread
    count ``main`` sets for itself is restored afterwards."""
    source = Path(paper.__file__).parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(source), str(RECIPES)]))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_command_runs_each_case_in_a_fresh_process(tmp_path, fresh_cases):
    out = tmp_path / "bench"
    argv = ["--sections", "transformer", "--workload", "toy", "--import", "toy", "--preset", "smoke"]
    argv += ["--methods", "cola", "--batches", "4", "--warmup", "1", "--threads", "1", "--out", str(out)]
    assert paper.main(argv) == 0
    record = json.loads((out / "transformer.json").read_text())
    assert record["section"] == "transformer" and record["command"].startswith("comera bench paper")
    (result,) = record["results"]
    assert result["method"] == "cola" and result["batch"] == 4 and result["params"] == 867
    assert result["peak_mib"] >= result["model_mib"] > 0
    assert result["training_mib"] == result["state_mib"] + max(result["train_mib"], 0.0)
    # CoLA's 867 trained parameters: weights, gradients and AdamW's two moments, plus one step counter each
    assert result["state_mib"] * 2**20 >= 4 * 4 * 867
    assert "| 4 | cola |" in (out / "transformer.md").read_text()
    assert not (out / "ladder.json").exists(), "only the chosen sections run"
    assert paper.main(["--workload", "nope", "--out", str(out)]) == 2


def test_a_ladder_rung_is_pruned_and_reports_its_compression(tmp_path):
    assert paper.ladder_ranks("toy", "smoke") == [3, 2, 1]
    full, cut = (
        paper.run_case("toy", "smoke", "comera", 4, repeats=5, warmup=1, cache_dir=tmp_path, rank=rank)
        for rank in (3, 1)
    )
    assert full["rank"] == 3 and full["pruned_layers"] == 0 and full["max_rank"] == 3
    assert cut["rank"] == 1 and cut["pruned_layers"] == 2 and cut["max_rank"] == 1
    assert 1 < full["tensorized_ratio"] < cut["tensorized_ratio"]
    assert 1 < full["model_ratio"] < cut["model_ratio"]
    assert cut["stored_params"] < full["stored_params"], "the cores were sliced, not only gated"


def test_bad_flags_name_the_flag_and_the_valid_values(tmp_path, capsys):
    with pytest.raises(SystemExit):
        paper.main(["--sections", "ladder", "fig9", "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert "argument --sections: invalid choice: 'fig9'" in error
    assert all(name in error.split("choose from")[1] for name in paper.SECTIONS)
    for argv, flag in (
        (["--ladder", "8", "0"], "--ladder"),
        (["--dlrm-batches", "10"], "--dlrm-batches"),
        (["--repeats", "3"], "--repeats"),
    ):
        with pytest.raises(SystemExit):
            paper.main([*argv, "--out", str(tmp_path)])
        assert flag in capsys.readouterr().err
    assert paper.main(["--preset", "huge", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "--preset: unknown preset 'huge'" in error and "'smoke'" in error
    assert paper.main(["--methods", "sgd", "--out", str(tmp_path)]) == 2
    assert "--methods: unknown method 'sgd'" in capsys.readouterr().err


def test_quick_sets_defaults_that_explicit_flags_override():
    args = paper.parse_arguments(["--quick", "--batches", "4", "--sections", "mlm", "ladder"])
    assert args.batches == [4] and args.preset == "smoke" and args.threads == 1
    assert args.sections == ["ladder", "mlm"], "sections run in their fixed order"
    assert paper.parse_arguments(["--ladder", "2", "8", "8"]).ladder == [8, 2]


def _positive_times(results: list[dict], *fields: str) -> None:
    for result in results:
        assert "error" not in result, result
        assert result["ms"] > 0 and all(result[field] >= 0 for field in fields), result


def test_quick_run_covers_every_section(tmp_path, fresh_cases):
    """The whole ``--quick`` run (about three minutes on 2 cores) with the transformer section cut to dense
    and comera, which keeps the test near two minutes; the other methods run in the test above."""
    out, target = tmp_path / "bench", tmp_path / "benchmarks.md"
    assert (
        paper.main(["--quick", "--methods", "dense", "comera", "--out", str(out), "--write", str(target)])
        == 0
    )
    sections = {name: json.loads((out / f"{name}.json").read_text()) for name in paper.SECTIONS}
    assert all(record["section"] == name for name, record in sections.items())
    transformer = sections["transformer"]["results"]
    assert {(r["method"], r["batch"]) for r in transformer} == {
        (m, b) for m in ("dense", "comera") for b in (1, 8)
    }
    _positive_times(transformer, "train_mib", "peak_mib")
    ladder = sections["ladder"]["results"]
    _positive_times(ladder, "train_mib", "peak_mib")
    assert [r.get("rank") for r in ladder] == [None, 4, 3, 2, 1] and ladder[0]["method"] == "dense"
    for field in ("tensorized_ratio", "model_ratio"):
        ratios = [r[field] for r in ladder[1:]]
        assert ratios[0] > 1 and all(a < b for a, b in zip(ratios, ratios[1:])), (field, ratios)
    lookup = sections["lookup"]["results"]
    _positive_times(lookup, "peak_mb")
    assert {r["method"] for r in lookup} == set(paper.embedding.METHODS)
    dlrm = sections["dlrm"]["results"]
    _positive_times(dlrm, "peak_mb")
    assert {r["method"] for r in dlrm} == set(paper.dlrm.METHODS)
    mlm = sections["mlm"]["results"]
    _positive_times(mlm, "step_peak_mb")
    assert [r["method"] for r in mlm] == ["dense", "comera"]
    text = target.read_text()
    for name in paper.SECTIONS:
        assert f"<!-- bench:paper-{name}:start -->" in text and f"<!-- bench:paper-{name}:end -->" in text
        assert (out / f"{name}.md").read_text().strip() in text
    assert "Targets (reported, not asserted)" in text
    pytest.importorskip("matplotlib")
    for name in ("transformer_time", "ladder_time", "lookup_memory", "dlrm_time", "mlm_memory"):
        assert (out / f"{name}.png").stat().st_size > 1000


def test_training_state_counts_every_kept_tensor_once():
    from comera.measure import training_state_mib
    from comera.tt.recycle import output_pool

    output_pool().release()  # outputs pooled by earlier tests in this process are not this model's
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(8, 10)).square().sum().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    expected = 4 * params * 4 + buffers + steps  # weights, grads, exp_avg, exp_avg_sq (fp32) + counters
    assert training_state_mib(model, optimizer) * 2**20 == expected
    assert training_state_mib(model) * 2**20 == 2 * params * 4 + buffers

    class Projector:
        def __init__(self, matrix):
            self.ortho_matrix = matrix

    weight = model[0].weight
    optimizer.state[weight]["projector"] = Projector(torch.zeros(20, 3))
    optimizer.state[weight]["view"] = weight.detach()[:5]  # a view of a counted storage
    assert training_state_mib(model, optimizer) * 2**20 == expected + 20 * 3 * 4

    pool = output_pool()
    pool.release()
    dropped = pool.take((1 << 20,), torch.zeros(1))  # 4 MiB: pooled by default
    assert training_state_mib(model, optimizer) * 2**20 == expected + 20 * 3 * 4
    del dropped  # now a free buffer the pool alone keeps: counted
    assert training_state_mib(model, optimizer) * 2**20 == expected + 20 * 3 * 4 + (4 << 20)
    pool.release()
