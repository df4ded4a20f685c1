"""``comera bench attention`` at tiny shapes: variants compute what they claim; the table compares them."""

import pytest
import torch

from comera.bench.attention import VARIANTS, format_report, make_inputs, make_step, parse_shape, run_shape
from comera.bench.attention import main as bench_main


def test_shapes_parse_and_bad_ones_are_named():
    assert parse_shape("32x12x128x64") == (32, 12, 128, 64)
    for bad in ("32x12x128", "0x1x2x3", "axbxcxd", "1x2x3x-4"):
        with pytest.raises(ValueError, match="shape must be BxHxTxd with four positive integers"):
            parse_shape(bad)


@pytest.mark.parametrize("padding", [False, True])
def test_blocked_and_explicit_variants_are_the_same_computation(padding):
    """Same seed, same draws: the two dropout paths give the same q, k, v gradients; SDPA without dropout
    differs from both (it is a floor, not the same computation)."""
    inputs = make_inputs((2, 3, 8, 4), padding)
    grads = {}
    for variant in ("blocked", "explicit", "sdpa-no-dropout"):
        torch.manual_seed(4)
        make_step(inputs, variant, 0.3)()
        grads[variant] = torch.cat([inputs[name].grad for name in ("q", "k", "v")])
    torch.testing.assert_close(grads["blocked"], grads["explicit"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grads["blocked"], grads["sdpa-no-dropout"], atol=1e-4)


def test_run_shape_times_every_variant_and_the_report_compares_them_to_blocked():
    times = run_shape((2, 2, 8, 4), VARIANTS, 0.1, True, repeats=1)
    assert set(times) == set(VARIANTS) and all(ms > 0 for ms in times.values())
    results = [{"shape": "2x2x8x4", "ms": times, "mib": {"blocked": 1.5}, "memory": "reuse"}]
    report = format_report(results, "comera bench attention --shapes 2x2x8x4")
    assert "| 2x2x8x4 | blocked |" in report and "| 1.00x | 2 |" in report
    assert report.count("| 2x2x8x4 |") == len(VARIANTS)


def test_cli_rejects_bad_arguments_by_name(capsys):
    for argv, message in (
        (["--shapes", "1x2x3"], "--shapes: shape must be BxHxTxd"),
        (["--p", "0"], "--p must be in (0, 1)"),
        (["--repeats", "0"], "--repeats must be at least 1"),
    ):
        with pytest.raises(SystemExit):
            bench_main(argv)
        assert message in capsys.readouterr().err
