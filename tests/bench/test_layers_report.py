"""The layer benchmark's checks: order-choice violators and the B=4096, r=30 targets, from given times."""

from comera.bench.layers import checks_report, order_violations


def row(shape, batch, rank, picks, merge, sequential, dense, auto, published, linear):
    return {
        "shape": shape,
        "batch": batch,
        "rank": rank,
        "auto picks": picks,
        "tt:merge": merge,
        "tt:sequential": sequential,
        "tt:dense": dense,
        "tt:factors": 2 * max(merge, sequential, dense),
        "tt:auto": auto,
        "tt:published": published,
        "nn.Linear": linear,
    }


def test_violators_are_picks_more_than_ten_percent_slower_than_the_fastest_order():
    rows = [
        row("768->768", 1, 8, "sequential", 1.0, 1.09, 2.0, 1.1, 1.0, 0.5),  # 9 % slower: within
        row("768->768", 128, 8, "merge", 1.2, 1.0, 3.0, 1.2, 1.3, 2.0),  # 20 % slower: violator
        row("768->768", 4096, 30, "merge", 10.0, 40.0, 30.0, 10.0, 13.0, 60.0),
    ]
    assert order_violations(rows) == [rows[1]]
    report = checks_report(rows)
    assert "within 10% of the fastest order measured in this run in 2 of 3 cases" in report
    assert "- 768->768, B=128, r=8: picked merge (1.200 ms), fastest sequential (1.000 ms), 1.20x" in report
    assert (
        "- 768->768: 6.00x faster than nn.Linear (target 5x, met); 1.30x faster than the published" in report
    )
    assert "(target 1.2x, met)" in report


def test_missed_targets_are_named():
    rows = [row("3072->768", 4096, 30, "merge", 10.0, 40.0, 30.0, 10.0, 11.0, 45.0)]
    report = checks_report(rows)
    assert "4.50x faster than nn.Linear (target 5x, missed)" in report
    assert "1.10x faster than the published TT layer (target 1.2x, missed)" in report


def test_the_small_batch_target_against_the_published_layer_is_reported():
    rows = [
        row("768->768", 128, 30, "merge", 1.0, 2.0, 3.0, 1.05, 1.0, 3.0),
        row("768->3072", 128, 30, "merge", 1.0, 2.0, 3.0, 1.0, 1.1, 3.0),
        row("768->3072", 128, 8, "merge", 1.0, 2.0, 3.0, 1.0, 1.1, 3.0),  # another rank: not a target
    ]
    report = checks_report(rows)
    assert "Target at B=128, r=30 (TT auto against the published TT layer):" in report
    assert "- 768->768: 0.95x (target 1x, missed)" in report
    assert "- 768->3072: 1.10x (target 1x, met)" in report
    assert report.count("(target 1x,") == 2
    assert "Targets at B=4096" not in report


def test_no_output_pool_turns_the_pool_off_and_says_so(tmp_path, capsys):
    from comera.bench.layers import main
    from comera.tt.recycle import configure_output_pool, output_pool

    target = tmp_path / "bench.md"
    target.write_text("<!-- bench:layers:start -->\n<!-- bench:layers:end -->\n")
    try:
        args = ["--shapes", "16x12", "--batches", "4", "--ranks", "2", "--repeats", "1"]
        args += ["--memory", "default"]
        assert main([*args, "--no-output-pool", "--write", str(target)]) == 0
        assert output_pool().max_bytes == 0
        assert "(allocation: glibc default; output pool off)" in target.read_text()
    finally:
        configure_output_pool()
    assert output_pool().max_bytes == 64 << 20
    capsys.readouterr()


def test_table_times_the_merge_order_with_and_without_row_blocks(capsys):
    from comera.bench.layers import format_table, run_layer_benchmark

    rows = run_layer_benchmark([(16, 12)], [4], [2], repeats=1)
    assert {"tt:merge", "tt:merge-one-gemm"} <= set(rows[0])
    header, rule, line = format_table(rows).splitlines()
    assert "| TT merge | TT merge, one GEMM |" in header
    assert header.count("|") == rule.count("|") == line.count("|")
    capsys.readouterr()


def test_layout_tensors_have_the_layouts_they_name():
    from comera.bench.layer_layouts import LAYOUTS, layout_tensors

    for layout in LAYOUTS:
        x, grad = layout_tensors(256, 6, 4, layout)
        assert x.shape == (2, 128, 6) and x.requires_grad
        transposed_input = layout in ("input transposed", "sequence-first")
        assert x.stride() == (
            (6, 12, 1) if transposed_input else (0, 6, 1) if layout == "input broadcast" else (768, 6, 1)
        )
        if layout == "gradient broadcast":
            assert grad is None
        else:
            transposed_grad = layout in ("gradient transposed", "sequence-first")
            assert grad.shape == (2, 128, 4) and grad.stride() == (
                (4, 8, 1) if transposed_grad else (512, 4, 1)
            )
    assert layout_tensors(7, 6, 4, "contiguous")[0].shape == (7, 1, 6)  # 128 does not divide 7


def test_layout_report_names_the_layers_more_than_1_2x_behind():
    from comera.bench.layer_layouts import format_layouts, layout_checks

    layouts = ("contiguous", "gradient broadcast")
    rows = [
        {"layer": "nn.Linear 8->8", "batch": 4, "contiguous": 1.0, "gradient broadcast": 2.0},
        {"layer": "TTLinear 8->8 r=2", "batch": 4, "contiguous": 1.0, "gradient broadcast": 1.1},
        {"layer": "TTMLinear 8->8 r=2", "batch": 4, "contiguous": 1.0, "gradient broadcast": 1.5},
    ]
    assert "| TTMLinear 8->8 r=2 | 4 | 1.00 (1.00) | 1.50 (1.50) | 1.50x |" in format_layouts(rows, layouts)
    checks = layout_checks(rows, layouts)
    assert "1 of 2 compressed layers have every layout within 1.2x" in checks
    assert "- TTMLinear 8->8 r=2, B=4: gradient broadcast 1.50x" in checks
