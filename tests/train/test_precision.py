"""bf16 autocast: the forward really runs in bfloat16, master weights stay fp32, and training follows fp32."""

import pytest
import torch
from tiny import loss_fn, make_data, make_model, parameters_of

from comera.methods.comera import CoMERAObjective
from comera.train import TrainConfig, Trainer


class RecordingLoss:
    """``loss_fn`` that records the dtype of the model's output on every call."""

    def __init__(self):
        self.dtypes = []

    def __call__(self, model, batch):
        inputs, labels = batch
        logits = model(inputs)
        self.dtypes.append(logits.dtype)
        return torch.nn.functional.cross_entropy(logits.float(), labels)


def train(precision, order=None):
    model = make_model(dropout=0.0)
    if order is not None:
        for layer in model.modules():
            if hasattr(layer, "order"):
                layer.order = order
    recorder = RecordingLoss()
    config = TrainConfig(early=2, batch_size=16, precision=precision, lr_other=1e-2, eval_every=6)
    objective = CoMERAObjective(model, lr_cores=1e-2)
    result = Trainer(
        model, recorder, make_data(), eval_data=make_data(), config=config, objective=objective
    ).fit()
    return model, recorder.dtypes, result


def test_bf16_autocast_trains_like_fp32():
    bf16, bf16_dtypes, bf16_result = train("bf16")
    fp32, fp32_dtypes, fp32_result = train("fp32")
    assert set(bf16_dtypes[:6]) == {torch.bfloat16} and set(fp32_dtypes) == {torch.float32}
    assert bf16_dtypes[6:] == [torch.float32] * (len(bf16_dtypes) - 6), "evaluation should run in fp32"
    got, want = parameters_of(bf16), parameters_of(fp32)
    errors = {name: float((got[name] - want[name]).norm() / want[name].norm()) for name in want}
    assert all(got[name].dtype == torch.float32 for name in got)
    assert max(errors.values()) < 0.05, errors
    assert max(errors.values()) > 1e-4, "bf16 and fp32 runs are identical: autocast had no effect"
    initial = make_model(dropout=0.0)
    start_loss = float(loss_fn(initial, make_data().tensors).detach())
    assert bf16_result.eval["loss"] < start_loss
    assert abs(bf16_result.eval["loss"] - fp32_result.eval["loss"]) < 0.02


def test_fp8_precision_switches_tt_layers_to_fp8_gemms_and_trains():
    from comera import TTLinear
    from comera.tt.fp8 import fp8_supported

    if not fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm with FP8 is unavailable on this CPU build")
    # fp8 changes the merge order only; at this tiny size the cost model would pick another order
    fp8, _, fp8_result = train("fp8", order="merge")
    fp32, _, fp32_result = train("fp32", order="merge")
    layers = [m for m in fp8.modules() if isinstance(m, TTLinear)]
    assert layers and all(layer.gemm == "fp8" for layer in layers)
    assert all(layer.gemm == "fp32" for layer in fp32.modules() if isinstance(layer, TTLinear))
    got, want = parameters_of(fp8), parameters_of(fp32)
    errors = [float((got[name] - want[name]).norm() / want[name].norm()) for name in want]
    assert max(errors) > 1e-4, "fp8 and fp32 runs are identical: fp8 GEMMs had no effect"
    initial_loss = float(loss_fn(make_model(dropout=0.0), make_data().tensors).detach())
    assert fp8_result.eval["loss"] < initial_loss
    assert abs(fp8_result.eval["loss"] - fp32_result.eval["loss"]) < 0.1
