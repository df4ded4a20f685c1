"""``comera frontier llm``: the sweep, the seeds, the iso-parameter and iso-memory controls, the table and the
plots, on the smoke preset (each run in this process)."""

import math

import pytest
import torch

from comera import load_pretrained
from comera.cli.commands.frontier import dense_width_settings, frontier, main, non_embedding_parameters
from comera.cli.commands.frontier_report import lower_envelope
from comera.recipes.run import SetupError
from comera.workloads.llm.model import LlamaLM


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier")
    points = frontier(
        preset="smoke",
        dense_widths=(16, 32),
        lr_factors=(1.0, 2.0),
        seeds=(0, 1),
        out=out / "grid",
        cache_dir=out / "cache",
        fresh_process=False,
        log=lambda line: None,
    )
    return out / "grid", points


def test_every_point_trains_and_the_best_rates_get_every_seed(finished):
    out, points = finished
    sweep = {point.name: point for point in points if point.role == "sweep"}
    assert set(sweep) == {
        "dense-w16-lr1",
        "dense-w16-lr2",
        "dense-w32-lr1",
        "dense-w32-lr2",
        "comera-lr1",
        "comera-lr2",
    }
    for prefix in ("dense-w16", "dense-w32", "comera"):
        group = [point for name, point in sweep.items() if name.startswith(f"{prefix}-lr")]
        best = min(group, key=lambda point: point.runs[0].results["perplexity"])
        assert [len(point.runs) for point in group if point is best] == [2]
        assert all(len(point.runs) == 1 for point in group if point is not best)
    assert all(run.results is not None for point in points for run in point.runs)
    assert (out / "frontier.md").is_file()
    assert (out / "frontier-memory.png").stat().st_size > 0 and (out / "frontier-time.png").stat().st_size > 0


def test_non_embedding_parameters_are_those_of_the_saved_model_outside_the_embedding_and_head(finished):
    out, points = finished
    comera = next(point for point in points if point.name == "comera-lr1")
    run_dir = comera.runs[0].run_dir
    model = load_pretrained(run_dir / "model")
    counted = {
        id(p): p.numel() for name, p in model.named_parameters() if not name.startswith(("embed", "lm_head"))
    }
    assert non_embedding_parameters(run_dir) == sum(counted.values())
    assert comera.runs[0].results["non_embedding_params"] == sum(counted.values())


def _dense_non_embedding(width: int) -> int:
    sizes = dict(
        item.split("=")
        for item in dense_width_settings(width, {"n_heads": 4, "hidden_size": 32, "intermediate_size": 88})
    )
    with torch.device("meta"):
        model = LlamaLM.from_preset(
            "smoke",
            hidden_size=width,
            intermediate_size=int(sizes["model.intermediate_size"]),
            vocab_size=300,
        )
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embed", "lm_head")))


def test_the_iso_parameter_control_is_the_dense_width_nearest_comeras_end_state(finished):
    _, points = finished
    control = next(point for point in points if "iso-params" in point.role)
    best = min((p for p in points if p.method == "comera"), key=lambda p: p.mean("perplexity"))
    target = best.runs[0].results["non_embedding_params"]
    width = int(control.name.rsplit("-w", 1)[1])
    nearest = min(range(8, 513, 8), key=lambda w: abs(_dense_non_embedding(w) - target))
    assert width == nearest
    assert control.runs[0].results["non_embedding_params"] == _dense_non_embedding(width)
    assert len(control.runs) == 2, "a control trains every seed"


def test_lower_envelope_keeps_the_points_no_other_point_beats():
    points = [(1.0, 50.0), (2.0, 40.0), (3.0, 45.0), (4.0, 30.0), (0.5, 60.0), (5.0, math.nan)]
    assert lower_envelope(points) == [(0.5, 60.0), (1.0, 50.0), (2.0, 40.0), (4.0, 30.0)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dense-widths", "20"], "--dense-widths: 20 must be a multiple of 2 x n_heads"),
        (["--lr-factors", "0"], "--lr-factors must be numbers > 0"),
        (["--seeds", "1", "2"], "--seeds must start with 0"),
        (["--set", "model.hidden_size=100"], r"model.hidden_size \(100\) must be n_heads"),
    ],
)
def test_bad_arguments_are_refused_before_anything_trains(tmp_path, capsys, argv, message):
    out = tmp_path / "never"
    assert main(["llm", "--preset", "smoke", "--out", str(out), *argv]) == 2
    assert message.replace("\\", "") in capsys.readouterr().err.replace("\\", "") or pytest.fail(message)
    assert not out.exists()


def test_bad_arguments_raise_setup_error_naming_them(tmp_path):
    with pytest.raises(SetupError, match="--dense-widths"):
        frontier(preset="smoke", dense_widths=(12,), out=tmp_path / "x", fresh_process=False)
