"""The masked-LM step benchmark at smoke size, in this process."""

from comera.bench.mlm import format_report, make_batch, run_case
from comera.models.mlm import build_mlm_model


def test_batch_is_masked_full_blocks():
    batch = make_batch(3, 16, 300)
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "input_ids": (3, 16),
        "attention_mask": (3, 16),
        "labels": (3, 16),
    }
    assert (batch["attention_mask"] == 1).all()
    chosen = batch["labels"] != -100
    assert chosen.any()
    assert (batch["input_ids"][:, 0] == 0).all() and not chosen[:, 0].any()


def test_cases_report_their_sizes_and_the_table_compares_them():
    results = [run_case("smoke", method, 2, 16, 300, repeats=1) for method in ("dense", "comera")]
    dense = sum(param.numel() for param in build_mlm_model("smoke", 300).parameters())
    assert results[0]["parameters"] == results[0]["dense_parameters"] == dense
    assert results[1]["dense_parameters"] == dense
    assert results[1]["parameters"] < dense / 4
    for result in results:
        assert result["ms"] > 0 and result["step_peak_mb"] is not None
    report = format_report(results, "comera bench mlm --preset smoke")
    assert f"| dense | {dense:,} | 1.00x |" in report
    assert "dense / comera: step time" in report
