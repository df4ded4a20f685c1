"""GPT-2's projections are ``transformers`` ``Conv1D`` modules (transposed linears): ``tensorize_`` converts
them, and ``untensorize_``, save/load and pruning give ``Conv1D`` modules back. Outputs are compared in
float64 with the dense model's; a model whose matrix weights are of an unsupported type is refused naming it.
"""

import copy

import pytest
import torch
from torch import nn

from comera import TTLinear, load_pretrained, prune_, save_pretrained, tensorize_, untensorize_
from comera.nn.removed import RemovedLinear

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D
PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=12)
    return transformers.GPT2LMHeadModel(config).double().eval()


def _projections(model: nn.Module) -> dict[str, nn.Module]:
    block = model.transformer.h[0]
    return {name: block.get_submodule(name) for name in PROJECTIONS}


def test_gpt2_projections_convert_exactly_and_come_back_as_conv1d():
    model = _gpt2()
    dense = copy.deepcopy(model)
    ids = torch.randint(0, 40, (2, 9))
    tensorize_(model, rank=64, init="tt_svd")
    assert all(isinstance(layer, TTLinear) for layer in _projections(model).values())
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-10, atol=1e-10)
    untensorize_(model)
    for name, restored in _projections(model).items():
        original = _projections(dense)[name]
        assert type(restored) is Conv1D and restored.nf == original.nf and restored.nx == original.nx
        torch.testing.assert_close(restored.weight, original.weight, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(restored.bias, original.bias)


def test_a_saved_gpt2_loads_into_a_fresh_one(tmp_path):
    model = _gpt2()
    tensorize_(model, rank=3, format="ttm")
    save_pretrained(model, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved", base_model=_gpt2())
    ids = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    untensorize_(loaded)
    assert all(type(module) is Conv1D for module in _projections(loaded).values())


def test_a_pruned_away_projection_comes_back_as_a_conv1d_of_zeros(tmp_path):
    model = _gpt2()
    tensorize_(model, rank=3)
    layer = _projections(model)["mlp.c_fc"]
    bias = layer.bias.detach().clone()
    with torch.no_grad():
        layer.gates[0].zero_()
    assert prune_(model).removed == ("transformer.h.0.mlp.c_fc",)
    stand_in = _projections(model)["mlp.c_fc"]
    assert isinstance(stand_in, RemovedLinear) and stand_in.spec()["dense_kind"] == "conv1d"
    save_pretrained(model, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved", base_model=_gpt2())
    untensorize_(loaded)
    restored = _projections(loaded)["mlp.c_fc"]
    assert type(restored) is Conv1D and not restored.weight.any()
    torch.testing.assert_close(restored.bias, bias)


class Projection(nn.Module):
    """A linear map of a type tensorize_ does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_matrix_weights_of_unsupported_types_are_named():
    with pytest.raises(
        ValueError, match=r"found no nn.Linear or transformers Conv1D; .* types \['Projection'\]"
    ):
        tensorize_(nn.Sequential(Projection(), nn.ReLU(), Projection()))
