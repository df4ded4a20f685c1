"""Contract of ``metrics.jsonl`` reading and cutting, ``MetricsLog.drop_after``, ``StepWindow.add`` sums and
times, ``epoch_seed``'s value and the equal shards of ``EpochData``."""

import json
import math
import os
import re

import pytest
import torch

from comera.train import records
from comera.train.data import EpochData, epoch_seed
from comera.train.metrics import METRICS_NAME, MetricsLog, carries_ranks, read_metrics, record_problem
from comera.train.records import StepWindow


def _write(folder, text: str):
    path = folder / METRICS_NAME
    path.write_bytes(text.encode())
    return path


def test_read_metrics_reads_past_a_blank_line(tmp_path):
    """A blank line in the middle is skipped; the records after it are still read."""
    _write(tmp_path, '{"step": 1}\n\n   \n{"step": 2}\n')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]


def test_an_invalid_line_is_refused_even_when_the_last_line_has_no_newline(tmp_path):
    """Only an invalid *last* line without its newline is a torn tail; an earlier invalid line is named."""
    path = _write(tmp_path, 'oops\n{"step": 2}')
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}: line 1 is not valid JSON')}$"):
        read_metrics(path)


def test_an_invalid_last_line_with_its_newline_is_not_a_torn_tail(tmp_path):
    """A complete (newline-ended) last line that is not JSON is damage, named by its number."""
    path = _write(tmp_path, '{"step": 1}\noops\n')
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}: line 2 is not valid JSON')}$"):
        read_metrics(path)


def test_a_torn_tail_does_not_hide_an_earlier_invalid_line(tmp_path):
    """With a torn last line, an invalid line before it is still named."""
    path = _write(tmp_path, 'oops\n{"step": 2}\n{"step": 3, "lo')
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}: line 1 is not valid JSON')}$"):
        read_metrics(path)


def test_opening_a_log_cuts_only_the_torn_last_line_and_counts_its_bytes(tmp_path):
    """The bytes after the last newline are cut (and counted); every whole line stays as it was."""
    whole = '{"step": 1}\n{"step": 2}\n'
    path = _write(tmp_path, whole + '{"step": 3, "lo')
    log = MetricsLog(tmp_path)
    assert log.torn_bytes == len('{"step": 3, "lo') == 15
    assert path.read_bytes() == whole.encode()
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("text", ["", '{"step": 1}\n{"step": 2}\n'])
def test_opening_a_log_on_a_whole_or_empty_file_cuts_nothing(tmp_path, text):
    """A whole or empty file is left as it is and ``torn_bytes`` is 0."""
    path = _write(tmp_path, text)
    assert MetricsLog(tmp_path).torn_bytes == 0
    assert path.read_bytes() == text.encode()


def test_a_torn_tail_after_a_garbage_line_is_cut_whatever_its_bytes(tmp_path):
    """The torn tail is whatever follows the last newline, even when the file ends like ``XX\\nXX``."""
    path = _write(tmp_path, '{"step": 1}\nXX\nXX')
    assert MetricsLog(tmp_path).torn_bytes == 2
    assert path.read_bytes() == b'{"step": 1}\nXX\n'


def test_a_new_or_disabled_log_has_no_torn_bytes_and_drops_nothing(tmp_path):
    """No file yet (or no folder): ``torn_bytes`` is 0 and ``drop_after`` drops 0 lines."""
    log = MetricsLog(tmp_path / "run")
    assert log.torn_bytes == 0 and not log.path.exists()
    assert log.drop_after(3) == (0, 0)
    off = MetricsLog(None)
    assert off.torn_bytes == 0 and off.drop_after(3) == (0, 0)


def test_drop_after_keeps_records_without_a_step_and_history_events(tmp_path):
    """Records after ``step`` go, but for history events; a record of another kind without a step counts as
    step 0."""
    lines = [
        {"kind": "note"},
        {"kind": "train", "step": 2, "loss": 1.0, "ratio": 1.0},
        {"kind": "train", "step": 4, "loss": 2.0, "ratio": 1.0},
        {"kind": "event", "step": 5, "event": "resume", "from": 2},
        {"kind": "event", "step": 6, "event": "prune"},
    ]
    _write(tmp_path, "".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    log = MetricsLog(tmp_path)
    assert log.drop_after(2) == (1, 0)
    assert read_metrics(tmp_path) == [lines[0], lines[1], lines[3]]
    assert log.drop_after(0) == (0, 0)
    assert read_metrics(tmp_path) == [lines[0], lines[3]]


@pytest.mark.parametrize(
    "unreadable",
    [
        {"kind": "train", "step": 1, "ratio": 1.0},
        {"kind": "train", "step": 1, "loss": "0.5", "ratio": 1.0, "ranks": {"a": [2]}},
        {"kind": "train", "step": 1, "loss": 0.5, "ratio": True, "ranks": {"a": [2]}},
        {"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0, "ranks": None},
        {"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0, "ranks": {"a": ["2"]}},
        {"kind": "eval", "step": 1},
    ],
)
def test_drop_after_drops_records_that_cannot_be_read_and_counts_them(tmp_path, unreadable):
    """A record of the Trainer's kinds that lacks a key of its kind or holds a value of the wrong type is
    dropped with the lines that hold no record; a record of the same step that can be read stays."""
    good = [
        {"kind": "train", "step": 1, "loss": float("nan"), "ratio": 1, "ranks": {"a": [3]}},
        {"kind": "eval", "step": 1, "metrics": {"accuracy": 0.5}},
    ]
    _write(tmp_path, "".join(json.dumps(line) + "\n" for line in [good[0], unreadable, good[1]]))
    assert record_problem(unreadable, ranked=True) is not None
    assert MetricsLog(tmp_path).drop_after(5) == (1, 0)
    kept = read_metrics(tmp_path)
    assert len(kept) == 2 and kept[1] == good[1] and math.isnan(kept[0]["loss"])


def test_record_problem_asks_for_ranks_only_where_the_run_carries_them():
    """A train record without ranks is readable in a run whose train records carry none (a dense run)."""
    plain = {"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}
    assert record_problem(plain, ranked=False) is None
    assert "has no ranks" in record_problem(plain, ranked=True)
    assert carries_ranks([plain]) is False and carries_ranks([{**plain, "ranks": {}}]) is True


def test_drop_after_keeps_non_finite_numbers(tmp_path):
    """A record holding NaN or infinity is rewritten as it was written (``NaN``, ``Infinity``)."""
    log = MetricsLog(tmp_path)
    log.write({"kind": "train", "step": 1, "loss": float("nan"), "ratio": float("inf")})
    assert log.drop_after(1) == (0, 0)
    assert (
        tmp_path / METRICS_NAME
    ).read_text() == '{"kind": "train", "step": 1, "loss": NaN, "ratio": Infinity}\n'
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["loss"]) and record["ratio"] == math.inf


def test_step_window_sums_losses_objectives_steps_and_seconds(monkeypatch):
    """``add`` sums task and objective over applied steps, counts every step, adds each step's seconds."""
    monkeypatch.setattr(records.time, "perf_counter", lambda: 100.0)
    window = StepWindow()
    window.add(1.5, 2.0, True, started=97.5)
    window.add(9.0, 9.0, False, started=99.0)
    window.add(0.5, 3.0, True, started=99.5)
    assert (window.loss, window.objective, window.applied, window.steps) == (2.0, 5.0, 2, 3)
    assert window.seconds == 4.0 and window.step_time == 4.0 / 3


def test_epoch_seed_is_seed_times_1000003_plus_epoch_modulo_2_63_minus_1():
    """The data order's seed: ``(seed * 1_000_003 + epoch) mod (2**63 - 1)`` (fixed: a resume needs it)."""
    assert epoch_seed(0, 7) == 7 and epoch_seed(2, 3) == 2_000_009
    assert epoch_seed(2**63, 5) == 1_000_008  # 2**63 = 1 (mod 2**63 - 1)
    assert epoch_seed(2**62, 0) == 2**62 + 500_001  # 2**62 * (2 * 500_001 + 1) = 500_001 + 2**62
    assert 0 <= epoch_seed(2**70 + 3, 2**40) < 2**63 - 1


def test_equal_shards_cut_the_order_before_a_partial_batch(tmp_path):
    """Training shards: 5 samples on 2 ranks keep 4; rank 0's one partial batch is samples 0 and 2 only."""
    data = torch.utils.data.TensorDataset(torch.arange(5))
    shards = [
        EpochData(data, batch_size=3, shuffle=False, drop_last=False, seed=0, rank=rank, world_size=2)
        for rank in (0, 1)
    ]
    assert [[batch[0].tolist() for batch in shard.epoch(0)] for shard in shards] == [[[0, 2]], [[1, 3]]]


@pytest.mark.parametrize(("count", "world_size"), [(1, 1), (7, 2), (300_001, 2)])
def test_a_shuffled_epoch_is_the_int64_permutation_of_its_seed_held_in_int32(count, world_size):
    """The order of a shuffled epoch (held as int32 below 2**31 samples, half of int64's memory) is
    ``torch.randperm`` of the epoch's seed in int64, the order a run written with int64 resumes to; each
    rank takes every world_size-th entry of it."""
    data = torch.utils.data.TensorDataset(torch.arange(count))
    generator = torch.Generator().manual_seed(epoch_seed(11, 2))
    kept = torch.randperm(count, generator=generator, dtype=torch.int64)[: count - count % world_size]
    for rank in range(world_size):
        shard = EpochData(
            data, batch_size=64, shuffle=True, drop_last=False, seed=11, rank=rank, world_size=world_size
        )
        order = torch.cat([batch[0] for batch in shard.epoch(2)])
        assert torch.equal(order, kept[rank::world_size])


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"\xc5\x80\xff\xfe binary", "is not UTF-8"),
        (b"42", "is a int, not a JSON object"),
        (b'"text"', "is a str, not a JSON object"),
        (b"[1, 2]", "is a list, not a JSON object"),
        (b'{"kind": "train", "step": "x"}', "has a step that is not an integer ('x')"),
        (b'{"step": true}', "has a step that is not an integer (True)"),
    ],
)
def test_a_line_that_holds_no_record_is_named_on_reading_and_dropped_at_a_resume(tmp_path, line, why):
    """Bytes that are not UTF-8, JSON that is not an object, a step that is not an integer: read_metrics
    names the line; drop_after (a resume) drops it and counts it, keeping the records around it."""
    path = tmp_path / "metrics.jsonl"
    first, second = ({"kind": "train", "step": step, "loss": 0.5, "ratio": 1.0} for step in (1, 2))
    path.write_bytes(json.dumps(first).encode() + b"\n" + line + b"\n" + json.dumps(second).encode() + b"\n")
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}: line 2 {why}')}$"):
        read_metrics(path)
    assert MetricsLog(tmp_path).drop_after(5) == (1, 0)
    assert read_metrics(path) == [first, second]


def test_repeated_records_are_dropped_keeping_the_first(tmp_path):
    """Every line copied twice: drop_after keeps one train and one eval record per step and one copy of an
    event (the first, so the log stays in step order), keeps repeated history events (two resumes at one
    step are two resumes), and counts what it dropped."""
    lines = [
        {"kind": "train", "step": 1, "loss": 1.0, "ratio": 1.0},
        {"kind": "event", "step": 1, "event": "resume"},
        {"kind": "event", "step": 1, "event": "late_stage", "target_size": 3},
        {"kind": "train", "step": 2, "loss": 2.0, "ratio": 1.0},
        {"kind": "eval", "step": 2, "metrics": {"loss": 3.0}},
    ]
    twice = [*lines, *lines[:-1], {**lines[-1], "metrics": {"loss": 4.0}}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in twice))
    assert MetricsLog(tmp_path).drop_after(5) == (0, 4)
    assert read_metrics(path) == [*lines, lines[1]]


def test_a_folder_where_the_log_goes_is_refused_naming_it(tmp_path):
    (tmp_path / METRICS_NAME).mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / METRICS_NAME}: not a regular file")):
        MetricsLog(tmp_path)


@pytest.mark.parametrize("kind", ["train", "eval", "event"])
def test_a_record_of_the_trainers_kinds_without_a_step_holds_no_record(tmp_path, kind):
    path = _write(
        tmp_path,
        f'{{"kind": "{kind}", "loss": 0.5}}\n{{"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}}\n',
    )
    with pytest.raises(ValueError, match=f"line 1 is a record of kind '{kind}' without a step$"):
        read_metrics(path)
    assert MetricsLog(tmp_path).drop_after(3) == (1, 0)


@pytest.mark.parametrize(
    "line", ['{"kind": "event", "step": 2}', '{"kind": "event", "step": 2, "event": null}']
)
def test_an_event_without_a_name_holds_no_record(tmp_path, line):
    path = _write(tmp_path, f'{line}\n{{"kind": "train", "step": 1, "loss": 0.5, "ratio": 1.0}}\n')
    with pytest.raises(ValueError, match="line 1 is an event record without an event name$"):
        read_metrics(path)
    assert MetricsLog(tmp_path).drop_after(3) == (1, 0)


def test_a_metrics_path_that_is_a_pipe_is_named_as_such_not_as_missing(tmp_path):
    """A FIFO where ``metrics.jsonl`` goes holds no file to read: said so, without blocking on it."""
    os.mkfifo(tmp_path / METRICS_NAME)
    with pytest.raises(ValueError, match="metrics.jsonl: not a regular file"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics file not found"):
        read_metrics(tmp_path / "missing")
