"""Models saved before Reshape 2 moved the workloads still load and give the outputs saved with them."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import comera

SAVED = Path(__file__).parent / "data" / "saved_v0"


def _output(name: str, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "nli":
        keys = ("input_ids", "token_type_ids", "attention_mask", "exact_match_ids")
        return model(*(inputs[key] for key in keys))
    if name == "dlrm":
        return model(inputs["dense"], inputs["ids"])
    return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


@pytest.mark.parametrize("name", ["nli", "dlrm", "mlm"])
def test_saved_before_the_move_loads_with_its_output(name):
    model = comera.load_pretrained(SAVED / name).eval()
    pair = load_file(str(SAVED / name / "io_pair.safetensors"))
    inputs = {key.removeprefix("input."): value for key, value in pair.items() if key.startswith("input.")}
    with torch.no_grad():
        output = _output(name, model, inputs)
    assert output.shape == pair["output"].shape
    torch.testing.assert_close(output, pair["output"], rtol=1e-5, atol=1e-6)
    report = comera.compression_report(model)
    assert report.layers and report.tensorized_params < report.tensorized_dense_params
