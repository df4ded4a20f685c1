"""The masked-LM step benchmark at smoke size, in this process."""

from comera.workloads.mlm.bench import format_report, make_batch, run_case
from comera.workloads.mlm.model import build_mlm_model


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
    assert results[0]["rank"] is None and results[1]["rank"] == 4  # the smoke preset's
    lower = run_case("smoke", "comera", 2, 16, 300, repeats=1, rank=2)
    assert lower["rank"] == 2 and lower["parameters"] < results[1]["parameters"]
    report = format_report([*results, lower], "comera bench mlm --preset smoke --ranks 2")
    assert f"| dense | - | {dense:,} | 1.00x |" in report
    assert f"| comera | 2 | {lower['parameters']:,} |" in report
    assert "dense / comera (rank 4): step time" in report
    assert "dense / comera (rank 2): step time" in report
