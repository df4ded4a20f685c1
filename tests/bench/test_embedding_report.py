"""The embedding benchmark report: ratios come from the measured times; methods run only where they apply."""

from __future__ import annotations

import torch

from comera.bench.embedding import applies, format_report, layout_batch


def entry(method, ms, peak, table="paper", count=10_000):
    return {
        "table": table,
        "method": method,
        "distribution": "uniform",
        "count": count,
        "ms": ms,
        "peak_mb": peak,
        "distinct": 9000,
        "parameters": 1000,
    }


def test_report_ratios_come_from_the_times():
    results = [
        entry("nn.Embedding", 20.0, 100.0),
        entry("naive", 900.0, 1000.0),
        entry("optimized", 90.0, 50.0),
        entry("auto", 60.0, 40.0),
        entry("published", 240.0, 400.0),
        entry("published+unique", 150.0, 300.0),
    ]
    report = format_report(results, "comera bench embedding")
    assert "smallest time ratio 10.0x (target 5x), smallest memory ratio 20.0x" in report
    assert "| 10000 | 240.0 | 150.0 | 60.0 | 4.0x | 2.5x | 262 | 128 |" in report
    assert "published order-4 lookup (same run): 4.0x at 10000." in report
    assert "with its unique step (same run): 2.5x at 10000 (target 1.5x at every batch: met)" in report


def test_report_flags_a_time_that_falls_as_the_batch_grows():
    results = [
        entry("auto", 60.0, 40.0, count=10_000),
        entry("published+unique", 80.0, 300.0, count=10_000),
        entry("auto", 50.0, 40.0, count=20_000),
        entry("published+unique", 160.0, 300.0, count=20_000),
        entry("auto", 90.0, 40.0, count=40_000),
    ]
    report = format_report(results, "comera bench embedding")
    assert (
        "paper, uniform ids: the default lookup's time falls: 10000 -> 20000 ids: 60.0 -> 50.0 ms." in report
    )
    assert "1.3x at 10000, 3.2x at 20000 (target 1.5x at every batch: missed)" in report
    rising = [entry("auto", 60.0 + count / 1000, 40.0, count=count) for count in (10_000, 20_000, 40_000)]
    assert "the default lookup's time never falls as the batch grows" in format_report(rising, "c")


def test_published_order_needs_an_order_4_table():
    assert applies("paper", "published") and applies("paper", "published+unique")
    assert not applies("dlrm", "published")
    assert applies("dlrm", "auto")


def test_layouts_give_the_ids_and_gradients_they_name():
    indices = torch.arange(300)
    ids, grad = layout_batch(indices, 4, "contiguous")
    assert ids is indices and grad.shape == (300, 4) and grad.is_contiguous()
    assert layout_batch(indices, 4, "broadcast") == (indices, None)
    ids, grad = layout_batch(indices, 4, "column-major")
    assert ids is indices and grad.shape == (300, 4) and grad.stride() == (1, 300)
    ids, grad = layout_batch(indices, 4, "sequence-first")
    assert torch.equal(ids, indices.reshape(100, 3).t()) and ids.stride() == (1, 3)
    assert grad.shape == (3, 100, 4) and grad.stride() == (4, 12, 1)


def test_report_lists_the_layouts_and_their_targets():
    auto = entry("auto", 60.0, 40.0)
    auto["layout_ms"] = {"contiguous": 60.0, "broadcast": 66.0, "column-major": 78.0}
    results = [auto, entry("published+unique", 150.0, 300.0)]
    report = format_report(results, "comera bench embedding --layouts")
    assert "| paper | uniform | 10000 | auto | 60.0 (1.00) | 66.0 (1.10) | 78.0 (1.30) | 1.9x |" in report
    assert "within 1.2x of contiguous: missed; >= 1.5x faster than published+unique: met." in report
