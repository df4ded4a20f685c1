"""What the run plots show: the series on each axis, labels, titles, events, the rank heat map, errors.

The figures are captured where :mod:`comera.train.plots` saves them (``Figure.savefig`` is patched), and the
drawn artists are compared with values computed by hand from a small ``metrics.jsonl``.
"""

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from comera.train.plots import plot_comparison, plot_run, rank_history

pytest.importorskip("matplotlib")

from matplotlib import rc_context  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

RED, GRAY = to_hex("tab:red"), to_hex("tab:gray")

# Four training records (layer b is removed at step 40), three evaluations (ppl missing at step 30), two
# prunes and a late-stage switch (drawn), a resume event (not drawn).
RECORDS = [
    {"kind": "train", "step": 10, "loss": 2.5, "ratio": 1.0, "ranks": {"a": [4, 3], "b": [2]}},
    {"kind": "event", "step": 15, "event": "prune"},
    {"kind": "train", "step": 20, "loss": 2.0, "ratio": 0.8, "ranks": {"a": [3, 3], "b": [2]}},
    {"kind": "eval", "step": 20, "metrics": {"acc": 0.5, "ppl": 9.0}},
    {"kind": "event", "step": 25, "event": "late_stage"},
    {"kind": "event", "step": 27, "event": "resume"},
    {"kind": "train", "step": 30, "loss": 1.5, "ratio": 0.6, "ranks": {"a": [2, 1], "b": [1]}},
    {"kind": "eval", "step": 30, "metrics": {"acc": 0.6}},
    {"kind": "event", "step": 35, "event": "prune"},
    {"kind": "train", "step": 40, "loss": 1.25, "ratio": 0.5, "ranks": {"a": [2, 1]}},
    {"kind": "eval", "step": 40, "metrics": {"acc": 0.7, "ppl": 6.0}},
]
# The events drawn: (step, colour, legend label); the second prune repeats no legend entry.
EVENTS = [(15, GRAY, "prune"), (25, RED, "late stage"), (35, GRAY, None)]


def _write(run_dir: Path, records: list) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


@pytest.fixture
def figures(monkeypatch):
    """``{file name: Figure}`` of every figure the plots save (nothing is written)."""
    saved = {}

    def capture(figure, fname, **kwargs):
        saved[Path(fname).name] = figure

    monkeypatch.setattr(Figure, "savefig", capture)
    return saved


def _event_lines(axis) -> list:
    """``(step, colour, label or None)`` of the vertical lines (``axvline``) on ``axis``."""
    found = []
    for line in axis.get_lines():
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        if len(xs) == 2 and xs[0] == xs[1] and ys == [0, 1]:
            label = line.get_label()
            found.append((xs[0], to_hex(line.get_color()), None if label.startswith("_") else label))
    return found


def _legend(axis) -> list[str]:
    return [text.get_text() for text in axis.get_legend().get_texts()]


def test_rank_history_is_an_integer_matrix():
    """rank_history returns the ranks as an integer matrix (rows layer[bond], columns steps)."""
    labels, steps, matrix = rank_history(RECORDS)
    assert labels == ["a[0]", "a[1]", "b[0]"] and steps == [10, 20, 30, 40]
    assert matrix.dtype == np.int64
    assert matrix.tolist() == [[4, 3, 2, 2], [3, 3, 1, 1], [2, 2, 1, 0]]


def test_loss_panel_shows_the_training_loss_against_the_step(tmp_path, figures):
    """loss.png, left panel: the loss series against the logged steps, its labels, title and legend."""
    plot_run(_write(tmp_path / "run", RECORDS))
    figure = figures["loss.png"]
    assert len(figure.axes) == 2
    assert tuple(figure.get_size_inches()) == (11, 4)
    axis = figure.axes[0]
    loss = axis.get_lines()[0]
    assert list(loss.get_xdata()) == [10, 20, 30, 40]
    assert list(loss.get_ydata()) == [2.5, 2.0, 1.5, 1.25]
    assert (axis.get_xlabel(), axis.get_ylabel(), axis.get_title()) == ("step", "task loss", "training loss")
    assert _legend(axis) == ["train loss", "prune", "late stage"]


def test_events_are_dashed_vertical_lines_at_their_steps(tmp_path, figures):
    """Prunes (gray) and the late-stage switch (red) are dashed vertical lines at their steps on the loss,
    evaluation and ratio axes, each kind named once in the legend; other events are not drawn."""
    plot_run(_write(tmp_path / "run", RECORDS))
    axes = [*figures["loss.png"].axes, figures["ratio.png"].axes[0]]
    for axis in axes:
        assert _event_lines(axis) == EVENTS
        assert [line.get_linestyle() for line in axis.get_lines()[-3:]] == ["--"] * 3


def test_evaluation_panel_shows_each_metric_at_its_evaluations(tmp_path, figures):
    """loss.png, right panel: one marked series per metric (sorted by name), only at the evaluations that
    have it, with its name in the legend."""
    plot_run(_write(tmp_path / "run", RECORDS))
    axis = figures["loss.png"].axes[1]
    acc, ppl = axis.get_lines()[:2]
    assert (list(acc.get_xdata()), list(acc.get_ydata())) == ([20, 30, 40], [0.5, 0.6, 0.7])
    assert (list(ppl.get_xdata()), list(ppl.get_ydata())) == ([20, 40], [9.0, 6.0])
    assert acc.get_marker() == ppl.get_marker() == "o"
    assert (axis.get_xlabel(), axis.get_title()) == ("step", "evaluation")
    assert _legend(axis) == ["acc", "ppl", "prune", "late stage"]


def test_ratio_plot_shows_the_compression_ratio_from_zero(tmp_path, figures):
    """ratio.png: the ratio series against the steps, its labels and title, the y axis starting at 0."""
    plot_run(_write(tmp_path / "run", RECORDS))
    axis = figures["ratio.png"].axes[0]
    ratio = axis.get_lines()[0]
    assert list(ratio.get_xdata()) == [10, 20, 30, 40]
    assert list(ratio.get_ydata()) == [1.0, 0.8, 0.6, 0.5]
    assert axis.get_xlabel() == "step" and axis.get_ylabel() == "size / initial size"
    assert axis.get_title() == "compression ratio"
    assert axis.get_ylim()[0] == 0
    assert _legend(axis) == ["prune", "late stage"]  # the dashed event lines are explained, in step order


def test_ratio_plot_without_events_has_no_legend(tmp_path, figures):
    """A run without stage switches or prunes draws the ratio alone, with no empty legend."""
    plot_run(_write(tmp_path / "run", [record for record in RECORDS if record["kind"] != "event"]))
    assert figures["ratio.png"].axes[0].get_legend() is None


def test_rank_heat_map_shows_the_rank_matrix(tmp_path, figures):
    """ranks.png: the rank matrix as nearest-cell image, rows named layer[bond], columns named by their
    step, its labels, and a colour bar labelled rank spanning the ranks; three rows keep the 3-inch minimum
    height."""
    plot_run(_write(tmp_path / "run", RECORDS))
    figure = figures["ranks.png"]
    assert tuple(figure.get_size_inches()) == (8, 3)
    axis = figure.axes[0]
    (image,) = axis.images
    assert image.get_array().tolist() == [[4, 3, 2, 2], [3, 3, 1, 1], [2, 2, 1, 0]]
    assert image.get_interpolation() == "nearest" and axis.get_aspect() == "auto"
    assert [tick.get_text() for tick in axis.get_yticklabels()] == ["a[0]", "a[1]", "b[0]"]
    assert list(axis.get_xticks()) == [0, 1, 2, 3]
    assert [tick.get_text() for tick in axis.get_xticklabels()] == ["10", "20", "30", "40"]
    assert (axis.get_xlabel(), axis.get_title()) == ("step", "active rank per layer bond")
    colorbar = image.colorbar
    assert colorbar is not None and colorbar.ax in figure.axes
    assert colorbar.ax.get_ylabel() == "rank" and colorbar.ax.get_ylim() == (0, 4)


def test_rank_heat_map_uses_viridis_whatever_the_style(tmp_path, figures):
    """The heat map's colour map is viridis even when the user's style sets another default."""
    with rc_context({"image.cmap": "gray"}):
        plot_run(_write(tmp_path / "run", RECORDS))
    assert figures["ranks.png"].axes[0].images[0].get_cmap().name == "viridis"


def test_rank_heat_map_of_many_steps_and_layers(tmp_path, figures):
    """Ten steps: eight x ticks spread from the first to the last step; twelve rows: 0.25 inch each plus
    1.5 inch."""
    records = [
        {
            "kind": "train",
            "step": 100 * (i + 1),
            "loss": 1.0,
            "ratio": 1.0,
            "ranks": {f"l{j}": [j] for j in range(12)},
        }
        for i in range(10)
    ]
    plot_run(_write(tmp_path / "run", records))
    figure = figures["ranks.png"]
    assert tuple(figure.get_size_inches()) == (8, 4.5)
    axis = figure.axes[0]
    # linspace(0, 9, 8) = 0, 1.29, 2.57, 3.86, 5.14, 6.43, 7.71, 9 rounded
    assert list(axis.get_xticks()) == [0, 1, 3, 4, 5, 6, 8, 9]
    labels = [tick.get_text() for tick in axis.get_xticklabels()]
    assert labels == ["100", "200", "400", "500", "600", "700", "900", "1000"]


def test_run_without_evaluations_or_ranks(tmp_path, figures):
    """Without evaluations the loss figure is one 6x4 panel; without ranks no heat map is written; records
    of other kinds and evaluations whose metrics are not an object are ignored."""
    records = [
        {"kind": "train", "step": 1, "loss": 3.0, "ratio": 1.0},
        {"kind": "note", "text": "not plotted"},
        {"step": 2},
        {"kind": "eval", "step": 2, "metrics": None},
        {"kind": "train", "step": 2, "loss": 2.0, "ratio": 0.9},
    ]
    run_dir = _write(tmp_path / "run", records)
    paths = plot_run(run_dir)
    assert paths == [run_dir / "plots" / "loss.png", run_dir / "plots" / "ratio.png"]
    assert set(figures) == {"loss.png", "ratio.png"}
    figure = figures["loss.png"]
    assert len(figure.axes) == 1 and tuple(figure.get_size_inches()) == (6, 4)
    assert list(figure.axes[0].get_lines()[0].get_ydata()) == [3.0, 2.0]


def test_plot_run_writes_into_a_new_nested_out_dir(tmp_path, figures):
    """out_dir, even several levels deep that do not exist yet, receives the plots."""
    out = tmp_path / "deep" / "er"
    paths = plot_run(_write(tmp_path / "run", RECORDS), out)
    assert paths == [out / "loss.png", out / "ratio.png", out / "ranks.png"]
    assert out.is_dir()


def test_plot_run_refuses_an_out_dir_that_is_a_file(tmp_path):
    """An out_dir that is a file is refused, named."""
    out = tmp_path / "plots.png"
    out.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"the plot folder {out} is a file")):
        plot_run(_write(tmp_path / "run", RECORDS), out)


def test_plot_run_names_a_record_that_is_not_an_object(tmp_path):
    """A record that is not a JSON object is refused with its line number (from 1) and type."""
    run_dir = _write(tmp_path / "run", [RECORDS[0], [1, 2]])
    message = f"{run_dir / 'metrics.jsonl'}: line 2 is a list, not a JSON object"
    with pytest.raises(ValueError, match=re.escape(message)):
        plot_run(run_dir)


def test_plot_run_names_a_record_lacking_a_key(tmp_path):
    """A record lacking a key its kind needs is refused with its number, kind and the missing keys."""
    run_dir = _write(tmp_path / "run", [RECORDS[0], {"kind": "train", "step": 20}])
    message = f"{run_dir / 'metrics.jsonl'}: record 2 (train) lacks ['loss', 'ratio']"
    with pytest.raises(ValueError, match=re.escape(message)):
        plot_run(run_dir)


def _png_size(path: Path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    return width, height


def test_pngs_are_100_dpi_whatever_the_style(tmp_path):
    """The PNGs are drawn at 100 dpi (a 6x4 inch figure is 600x400 pixels) even when the user's style sets
    another savefig dpi."""
    records = [{**record, "ranks": None} for record in RECORDS if record["kind"] == "train"]
    for record in records:
        del record["ranks"]
    with rc_context({"savefig.dpi": 50}):
        paths = plot_run(_write(tmp_path / "run", records))
    assert [_png_size(path) for path in paths] == [(600, 400), (600, 400)]


# Runs to compare on "ppl": dense (a resume event, not drawn; an evaluation without ppl), comera (a late-stage
# switch and a prune), other (a prune).
RUNS = {
    "dense": [
        {"kind": "train", "step": 10, "loss": 3.0, "ratio": 1.0},
        {"kind": "eval", "step": 10, "train_time_s": 1.0, "metrics": {"ppl": 30.0, "acc": 0.1}},
        {"kind": "event", "step": 12, "event": "resume"},
        {"kind": "eval", "step": 15, "train_time_s": 1.5, "metrics": {"acc": 0.2}},
        {"kind": "eval", "step": 20, "train_time_s": 2.0, "metrics": {"ppl": 20.0, "acc": 0.3}},
    ],
    "comera": [
        {"kind": "eval", "step": 10, "train_time_s": 1.5, "metrics": {"ppl": 28.0}},
        {"kind": "event", "step": 12, "event": "late_stage"},
        {"kind": "event", "step": 16, "event": "prune"},
        {"kind": "eval", "step": 20, "train_time_s": 3.5, "metrics": {"ppl": 18.0}},
    ],
    "other": [
        {"kind": "event", "step": 5, "event": "prune"},
        {"kind": "eval", "step": 10, "train_time_s": 0.5, "metrics": {"ppl": 40.0}},
        {"kind": "eval", "step": 20, "train_time_s": 0.9, "metrics": {"ppl": 35.0}},
    ],
}


def _runs(tmp_path: Path, names=("dense", "comera")) -> list[str]:
    return [str(_write(tmp_path / name, RUNS[name])) for name in names]


def _series(axis) -> dict:
    """``{label: (x, y, marker)}`` of the lines on ``axis`` that are not event lines."""
    events = {id(line) for line in axis.get_lines() if list(line.get_ydata()) == [0, 1]}
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()), line.get_marker())
        for line in axis.get_lines()
        if id(line) not in events
    }


def test_comparison_against_the_step_draws_the_events_of_the_first_run_with_any(tmp_path, figures):
    """Each run's metric against the step, marked and named; only the first run with drawn events (comera:
    dense has only a resume) has its events drawn, named after it; labels, title and size; a new nested
    folder for the PNG."""
    path = tmp_path / "out" / "deep" / "ppl.png"
    assert plot_comparison(_runs(tmp_path, ("dense", "comera", "other")), "ppl", str(path)) == path
    figure = figures["ppl.png"]
    assert tuple(figure.get_size_inches()) == (8.5, 4)
    (axis,) = figure.axes
    assert _series(axis) == {
        "dense": ([10, 20], [30.0, 20.0], "o"),
        "comera": ([10, 20], [28.0, 18.0], "o"),
        "other": ([10, 20], [40.0, 35.0], "o"),
    }
    assert _event_lines(axis) == [(12, RED, "comera: late stage"), (16, GRAY, "comera: prune")]
    assert (axis.get_xlabel(), axis.get_ylabel()) == ("step", "ppl")
    assert axis.get_title() == "ppl on the evaluation split"
    assert _legend(axis) == ["dense", "comera", "comera: late stage", "comera: prune", "other"]


@pytest.mark.parametrize(("names", "prefix"), [(("comera",), ""), (("dense", "comera"), "comera: ")])
def test_comparison_names_the_events_after_their_run_if_several(tmp_path, figures, names, prefix):
    """The event legend labels carry the run's name when several runs are compared, none for a single run."""
    plot_comparison(_runs(tmp_path, names), "ppl", tmp_path / "ppl.png")
    axis = figures["ppl.png"].axes[0]
    assert _event_lines(axis) == [(12, RED, prefix + "late stage"), (16, GRAY, prefix + "prune")]


@pytest.mark.parametrize(
    ("x", "label", "dense", "comera"),
    [
        ("tokens", "tokens trained on", [640, 1280], [1280, 2560]),
        ("time", "training time (s)", [1.0, 2.0], [1.5, 3.5]),
    ],
)
def test_comparison_against_tokens_or_time(tmp_path, figures, x, label, dense, comera):
    """Against tokens (step times the run's tokens per step) or the training time, without events."""
    plot_comparison(
        _runs(tmp_path), "ppl", tmp_path / "p.png", x=x, tokens_per_step={"dense": 64, "comera": 128}
    )
    axis = figures["p.png"].axes[0]
    assert _series(axis) == {"dense": (dense, [30.0, 20.0], "o"), "comera": (comera, [28.0, 18.0], "o")}
    assert _event_lines(axis) == []
    assert axis.get_xlabel() == label


def test_comparison_legend_sits_right_of_the_axes(tmp_path, figures):
    """The legend is outside the plot, its left edge a border pad (under 10 pixels) right of 1.01 axes widths,
    vertically centred on the axes."""
    plot_comparison(_runs(tmp_path), "ppl", tmp_path / "p.png")
    figure = figures["p.png"]
    figure.draw_without_rendering()
    axes_box = figure.axes[0].get_window_extent()
    legend_box = figure.axes[0].get_legend().get_window_extent()
    assert 0 < legend_box.x0 - (axes_box.x0 + 1.01 * axes_box.width) < 10
    assert (legend_box.y0 + legend_box.y1) / 2 == pytest.approx((axes_box.y0 + axes_box.y1) / 2, abs=1)


def test_comparison_refusals_name_the_run(tmp_path):
    """An unknown x, a run without tokens per step, without train_time_s or without the metric: refused, the
    run named."""
    dense, comera = _runs(tmp_path)
    out = tmp_path / "p.png"
    with pytest.raises(
        ValueError, match=re.escape("x must be one of ('step', 'tokens', 'time'), got 'epoch'")
    ):
        plot_comparison([dense, comera], "ppl", out, x="epoch")
    with pytest.raises(ValueError, match=re.escape(f"{comera}: x='tokens' needs its tokens_per_step")):
        plot_comparison([dense, comera], "ppl", out, x="tokens", tokens_per_step={"dense": 8})
    with pytest.raises(ValueError, match=re.escape(f"{comera}: no evaluation record has the metric 'acc'")):
        plot_comparison([dense, comera], "acc", out)
    _write(Path(comera), [{"kind": "eval", "step": 2, "metrics": {"ppl": 3.0}}])
    message = f"{comera}: its evaluation records have no train_time_s (a run from before it)"
    with pytest.raises(ValueError, match=re.escape(message)):
        plot_comparison([dense, comera], "ppl", out, x="time")


def _final_runs(tmp_path: Path, steps: dict) -> list[Path]:
    return [
        _write(
            tmp_path / name,
            [{"kind": "eval", "step": step, "train_time_s": step / 10, "metrics": {"ne": value}}],
        )
        for name, (step, value) in steps.items()
    ]


def test_comparison_of_runs_evaluated_once_shows_each_final_value(tmp_path, figures):
    """Runs evaluated once each: one unconnected marker per run (named on the x axis) labelled with its value
    8 points above, the step of that evaluation in the title, room above the markers; a new nested folder."""
    runs = _final_runs(tmp_path, {"dense": (251, 0.8612345), "comera": (251, 0.87)})
    path = tmp_path / "out" / "deep" / "ne.png"
    assert plot_comparison(runs, "ne", path) == path
    axis = figures["ne.png"].axes[0]
    (line,) = axis.get_lines()
    assert list(line.get_xdata()) == ["dense", "comera"] and list(line.get_ydata()) == [0.8612345, 0.87]
    assert line.get_marker() == "o" and line.get_linestyle() == "None"
    notes = [(text.get_text(), text.xy, text.xyann, text.anncoords) for text in axis.texts]
    assert notes == [
        ("0.8612", ("dense", 0.8612345), (0, 8), "offset points"),
        ("0.87", ("comera", 0.87), (0, 8), "offset points"),
    ]
    assert [text.get_horizontalalignment() for text in axis.texts] == ["center", "center"]
    assert axis.get_ylabel() == "ne" and axis.get_title() == "ne on the evaluation split at step 251"
    assert axis.margins()[1] == 0.2


@pytest.mark.parametrize(("steps", "x"), [((100, 251), "step"), ((251, 251), "time")])
def test_final_values_at_different_steps_or_times_say_the_last_evaluation(tmp_path, figures, steps, x):
    """Runs evaluated once at different steps, or against time: the title says at the last evaluation."""
    runs = _final_runs(tmp_path, {"dense": (steps[0], 0.5), "comera": (steps[1], 0.6)})
    plot_comparison(runs, "ne", tmp_path / "ne.png", x=x)
    axis = figures["ne.png"].axes[0]
    assert axis.get_title() == "ne on the evaluation split at the last evaluation"


@pytest.mark.parametrize("ranks", [None, "x", {"0": [1, "2"]}, "absent"])
def test_plot_run_names_a_train_record_without_usable_ranks(tmp_path, ranks):
    """When train records carry ranks, each must: a record without them, or with something else, is named."""
    broken = {"kind": "train", "step": 2, "loss": 0.4, "ratio": 0.9}
    if ranks != "absent":
        broken["ranks"] = ranks
    run_dir = _write(tmp_path / "run", [{**RECORDS[0], "ranks": {"0": [2, 2]}}, broken])
    with pytest.raises(ValueError, match=r"record 2 \(train\) has no ranks of its layers"):
        plot_run(run_dir)


@pytest.mark.parametrize(
    ("record", "held"),
    [
        ({"kind": "train", "step": 30, "loss": "0.5", "ratio": 0.8}, "loss='0.5'"),
        ({"kind": "train", "step": 30, "loss": 0.5, "ratio": None}, "ratio=None"),
        ({"kind": "train", "step": 30, "loss": [1], "ratio": 0.8}, "loss=[1]"),
    ],
)
def test_plot_run_names_a_record_whose_values_are_not_of_their_type(tmp_path, record, held):
    run_dir = _write(tmp_path / "run", [*RECORDS, record])
    with pytest.raises(ValueError, match=re.escape(f"holds {held}, not what its kind holds")):
        plot_run(run_dir)
