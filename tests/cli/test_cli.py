"""The ``comera`` command: benchmark dispatch and the docs section it writes."""

import json
import re
import subprocess
import sys

import pytest

from comera.cli import main
from comera.measure import update_section


def test_update_section_replaces_only_its_own_block(tmp_path):
    path = tmp_path / "bench.md"
    update_section(path, "layers", "first")
    update_section(path, "embedding", "other")
    update_section(path, "layers", "second")
    text = path.read_text()
    assert "second" in text and "first" not in text and "other" in text
    assert text.count("<!-- bench:layers:start -->") == 1


def test_bench_layers_quick_writes_a_table(tmp_path):
    target = tmp_path / "benchmarks.md"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "comera",
            "bench",
            "layers",
            "--quick",
            "--repeats",
            "1",
            "--write",
            str(target),
            "--section",
            "layers-quick",
            "--min-seconds",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    written = target.read_text()
    assert "<!-- bench:layers-quick:start -->" in written and "<!-- bench:layers:start -->" not in written
    assert "Command: `comera bench layers --quick --repeats 1 --write" in written
    assert "at least 1 runs after 2 warm-up runs (more, up to 1000, until a row's runs took 0 s)" in written
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 768->768 | 128 | 16 |")]
    assert rows, result.stdout
    cells = [cell.strip() for cell in rows[-1].strip("|").split("|")]
    header = next(line for line in result.stdout.splitlines() if line.startswith("| shape |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert len(columns) == len(cells) and "TT merge, no oneDNN" in columns
    assert cells[columns.index("auto picks")] in {"merge", "sequential", "dense", "factors"}
    assert float(cells[3]) > 0 and float(cells[4]) > 0
    assert "| 768->768 | 128 | 16 |" in target.read_text()
    assert "of the fastest order measured in this run in" in target.read_text()


def test_unknown_benchmark_is_rejected():
    with pytest.raises(SystemExit):
        main(["bench", "nonexistent"])


def test_report_prints_the_saved_models_layers(tmp_path, capsys):
    import torch
    from torch import nn

    from comera import TTLinear, register_model, save_pretrained

    @register_model("cli-test-mlp")
    class TinyMLP(nn.Sequential):
        def __init__(self):
            super().__init__(TTLinear(64, 48, rank=3), nn.ReLU(), nn.Linear(48, 2))
            self.comera_model = {"name": "cli-test-mlp", "kwargs": {}}

    model = TinyMLP()
    with torch.no_grad():
        model[0].gates[0][1:] = 0.0
    save_pretrained(model, tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("0 ")]
    assert len(rows) == 1
    assert rows[0][6] == ",".join(map(str, model[0].ranks)) == "1,3,3"
    assert int(rows[0][7].replace(",", "")) == model[0].num_parameters()


def test_report_and_plot_fail_cleanly_on_missing_folders(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["plot", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "comera_config.json" in err and "metrics" in err


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "comera", *args], capture_output=True, text=True, timeout=120
    )


def _saved_unregistered_model(directory):
    import torch
    from torch import nn

    from comera import prune_, save_pretrained, tensorize_

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(40, 12), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 20), nn.Linear(12, 40)
    )
    model[4].weight = model[0].weight  # a head tied to the table
    tensorize_(model, rank=3, embeddings=True, target_modules=["1", "3"])
    with torch.no_grad():
        model[1].gates[0][1:] = 0.0
        model[3].gates[1].zero_()
    prune_(model)
    save_pretrained(model, directory)
    return model


def test_report_of_an_unfinished_run_says_so(tmp_path, capsys):
    """A run folder without its model or results yet (killed, or still training) is named as a run that
    has not finished, not as a folder that is no run."""
    (tmp_path / "config.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    assert "a run that has not finished" in capsys.readouterr().err


def test_report_works_in_a_fresh_process_for_an_unregistered_model(tmp_path):
    """A new process has an empty model registry; the report needs only the recorded layers."""
    from comera import compression_report

    model = _saved_unregistered_model(tmp_path)
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(compression_report(model))


def test_report_of_a_run_folder_shows_the_model_and_the_results(tmp_path):
    import json

    from comera import compression_report

    model = _saved_unregistered_model(tmp_path / "model")
    (tmp_path / "results.json").write_text(json.dumps({"eval": {"accuracy": 0.75}, "steps": 10}))
    result = _run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert str(compression_report(model)) in result.stdout
    assert "eval.accuracy: 0.75" in result.stdout and "steps: 10" in result.stdout
    (tmp_path / "results.json").unlink()
    assert (
        _run_cli("report", str(tmp_path))
        .stdout.strip()
        .endswith(str(compression_report(model)).splitlines()[-1])
    )


def _metrics(tmp_path, lines):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"kind": "train", "step": 1, "ratio": 1.0}'], r"record 1 \(train\) lacks \['loss'\]"),
        (['{"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}', "[1, 2]", "{}"], "line 2 is a list"),
        (['{"kind": "eval", "step": 1}', '{"kind": "train", "step": 1, "loss": 1, "ratio": 1}'], "lacks"),
    ],
)
def test_plot_of_malformed_records_names_the_record(tmp_path, capsys, lines, message):
    assert main(["plot", str(_metrics(tmp_path, lines))]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_plot_into_a_file_is_refused(tmp_path, capsys):
    run = _metrics(tmp_path, ['{"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}'])
    target = tmp_path / "file.png"
    target.write_text("x")
    assert main(["plot", str(run), "--out", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(target / "under")]) == 2
    assert f"--out {target / 'under'}: {target} is a file, not a folder" in capsys.readouterr().err


def test_plot_with_a_folder_where_a_plot_file_goes_is_one_line(tmp_path, capsys):
    run = _metrics(tmp_path, ['{"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}'])
    (run / "plots" / "ratio.png").mkdir(parents=True)
    assert main(["plot", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("comera plot: ") and "ratio.png" in error and len(error.splitlines()) == 1


def test_bench_help_lists_the_benchmarks(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "transformer" in out and "embedding" in out


def test_plot_compare_draws_one_metric_of_several_runs(tmp_path, capsys):
    runs = []
    for name, values in (("dense", [0.6, 0.7]), ("comera", [0.55, 0.72])):
        lines = ['{"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}']
        lines += [
            f'{{"kind": "eval", "step": {10 * (i + 1)}, "metrics": {{"accuracy": {v}}}}}'
            for i, v in enumerate(values)
        ]
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(str(run))
    target = tmp_path / "both.png"
    assert main(["plot", runs[0], "--compare", runs[1], "--metric", "accuracy", "--out", str(target)]) == 0
    assert target.stat().st_size > 1000
    assert main(["plot", runs[0], "--compare", runs[1], "--metric", "auc"]) == 2
    assert "no evaluation record has the metric 'auc'" in capsys.readouterr().err
    assert main(["plot", runs[0], "--compare", runs[1]]) == 2


def saved_figures(monkeypatch) -> list[dict]:
    """What each figure written through matplotlib's ``Figure.savefig`` showed, read just before the write:
    its first axis's line labels with their x data, its texts, title and x label."""
    from matplotlib.figure import Figure

    saved: list[dict] = []
    real = Figure.savefig

    def keep(figure, *args, **kwargs):
        axis = figure.axes[0]
        saved.append(
            {
                "lines": {line.get_label(): list(line.get_xdata()) for line in axis.lines},
                "texts": [text.get_text() for text in axis.texts],
                "title": axis.get_title(),
                "xlabel": axis.get_xlabel(),
            }
        )
        return real(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def test_plot_compare_draws_the_events_of_the_first_run_that_has_any(tmp_path, monkeypatch):
    from comera.train import plots

    runs = []
    for name, events in (("dense", []), ("comera", [("late_stage", 10)]), ("other", [("prune", 5)])):
        lines = [f'{{"kind": "eval", "step": {step}, "metrics": {{"accuracy": 0.5}}}}' for step in (10, 20)]
        lines += [f'{{"kind": "event", "step": {step}, "event": "{event}"}}' for event, step in events]
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(run)
    saved = saved_figures(monkeypatch)
    plots.plot_comparison(runs, "accuracy", tmp_path / "all.png")
    (figure,) = saved
    assert {label: x for label, x in figure["lines"].items() if ": " in label} == {
        "comera: late stage": [10, 10]
    }


def test_plot_compare_of_runs_evaluated_once_shows_their_final_values(tmp_path, monkeypatch):
    from comera.train import plots

    runs = []
    for name, value in (("dense", 0.86), ("comera", 0.87)):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(f'{{"kind": "eval", "step": 251, "metrics": {{"ne": {value}}}}}\n')
        runs.append(run)
    saved = saved_figures(monkeypatch)
    path = plots.plot_comparison(runs, "ne", tmp_path / "ne.png")
    assert saved[0]["texts"] == ["0.86", "0.87"]
    assert saved[0]["title"] == "ne on the evaluation split at step 251"
    assert path.stat().st_size > 1000
    (runs[1] / "metrics.jsonl").write_text(
        '{"kind": "eval", "step": 100, "metrics": {"ne": 0.9}}\n'
        '{"kind": "eval", "step": 251, "metrics": {"ne": 0.87}}\n'
    )
    plots.plot_comparison(runs, "ne", tmp_path / "ne2.png")
    assert saved[1]["texts"] == [] and saved[1]["lines"]["comera"] == [100, 251], (
        "a run with a curve gets curves"
    )


def _eval_runs(tmp_path, times):
    runs = []
    for name, run_times in times.items():
        run = tmp_path / name
        run.mkdir()
        lines = [
            json.dumps(
                {"kind": "eval", "step": step, "train_time_s": seconds, "metrics": {"ppl": 10.0 - step}}
            )
            for step, seconds in run_times
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(run)
    return runs


@pytest.mark.parametrize("x", ["step", "tokens", "time"])
def test_plot_compare_draws_each_run_against_steps_tokens_or_time(tmp_path, monkeypatch, x):
    from comera.train import plots

    runs = _eval_runs(tmp_path, {"dense": [(2, 5.0), (4, 9.5)], "comera": [(2, 1.5), (4, 3.0)]})
    saved = saved_figures(monkeypatch)
    plots.plot_comparison(runs, "ppl", tmp_path / "p.png", x=x, tokens_per_step={"dense": 64, "comera": 128})
    want = {
        "step": {"dense": [2, 4], "comera": [2, 4]},
        "tokens": {"dense": [128, 256], "comera": [256, 512]},
        "time": {"dense": [5.0, 9.5], "comera": [1.5, 3.0]},
    }[x]
    (drawn,) = saved
    assert {name: drawn["lines"][name] for name in want} == want
    assert drawn["xlabel"] == {"step": "step", "tokens": "tokens trained on", "time": "training time (s)"}[x]


def test_plot_compare_refuses_an_unknown_axis_and_missing_inputs_naming_the_run(tmp_path):
    from comera.train import plots

    runs = _eval_runs(tmp_path, {"dense": [(2, 5.0)], "comera": [(2, 1.5)]})
    with pytest.raises(ValueError, match=r"x must be one of \('step', 'tokens', 'time'\), got 'epoch'"):
        plots.plot_comparison(runs, "ppl", tmp_path / "p.png", x="epoch")
    with pytest.raises(ValueError, match=r"comera: x='tokens' needs its tokens_per_step"):
        plots.plot_comparison(runs, "ppl", tmp_path / "p.png", x="tokens", tokens_per_step={"dense": 8})
    (runs[1] / "metrics.jsonl").write_text('{"kind": "eval", "step": 2, "metrics": {"ppl": 3.0}}\n')
    with pytest.raises(ValueError, match=r"comera: its evaluation records have no train_time_s"):
        plots.plot_comparison(runs, "ppl", tmp_path / "p.png", x="time")


def test_a_ctrl_c_that_escapes_a_command_ends_it_with_130_and_no_traceback(monkeypatch):
    """A second Ctrl-C while a command reports the first (or while what it stopped unwinds) reaches the
    ``comera`` entry point: status 130, as for the first, instead of a traceback."""
    import comera.cli.commands.train as train_command

    def interrupted_twice(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_command, "main", interrupted_twice)
    try:
        code = main(["train", "nli"])
    except KeyboardInterrupt:
        code = "KeyboardInterrupt escaped"
    assert code == 130


@pytest.mark.parametrize(("rank", "printed"), [(None, True), ("0", True), ("1", False)])
def test_a_warning_is_printed_once_under_torchrun(monkeypatch, capsys, rank, printed):
    from comera.cli.commands.train import _show_warning

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    _show_warning(UserWarning("resume: no checkpoint"), UserWarning, "x.py", 1)
    expected = "comera train: warning: resume: no checkpoint\n" if printed else ""
    assert capsys.readouterr().err == expected


def test_update_section_makes_no_folder_for_its_file(tmp_path):
    target = tmp_path / "no" / "dir" / "x.md"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"its folder {tmp_path / 'no' / 'dir'} does not exist")
    ):
        update_section(target, "layers", "body")
    assert not (tmp_path / "no").exists()


WRITING = ["layers", "embedding", "inference", "trainer", "transformer", "attention", "dlrm", "mlm"]
WRITING += ["paper", "scaling", "gpu", "llm", "hf_llama"]


@pytest.mark.parametrize("name", WRITING)
def test_a_write_into_a_missing_folder_is_refused_before_the_benchmark_runs(tmp_path, capsys, name):
    """``--write /missing/dir/x.md``: argparse's one-line error naming the folder, exit status 2, and no
    folder made (the benchmark would have made the whole path, at the file system's root for /nonexistent)."""
    import importlib

    from comera.bench import BENCHMARKS

    target = tmp_path / "nonexistent" / "dir" / "x.md"
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(BENCHMARKS[name]).main(["--write", str(target)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert f"--write: {target}: its folder {target.parent} does not exist" in error
    assert not (tmp_path / "nonexistent").exists()


def test_the_package_s_main_is_the_command_also_after_its_module_is_imported(tmp_path, capsys):
    """``comera.cli.main`` stays the function once the module behind it has been imported (a submodule of
    the same name would replace it as the package's attribute)."""
    import comera.cli
    import comera.cli.command  # noqa: F401

    assert comera.cli.main(["report", str(tmp_path)]) == 2
    assert "neither a saved model" in capsys.readouterr().err
