"""Which linears the baselines act on: the tensorization's targets, never embeddings, heads left out."""

import copy

import pytest
import torch
from torch import nn

from comera.methods.targets import replace_targets, target_linears
from comera.tensorize_config import TensorizeConfig


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.block = nn.ModuleDict(
            {"query": nn.Linear(8, 8), "ffn": nn.Linear(8, 16), "out": nn.Linear(16, 8)}
        )
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.lm_head.weight = self.embed.weight
        self.classifier = nn.Linear(8, 3)

    def get_output_embeddings(self):
        return self.classifier


def test_all_linear_leaves_out_tied_and_declared_heads():
    chosen = target_linears(TinyLM(), TensorizeConfig())
    assert list(chosen) == ["block.query", "block.ffn", "block.out"]


def test_all_linear_leaves_out_a_scalar_output_but_an_explicit_target_keeps_it():
    model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 1))
    assert list(target_linears(model, TensorizeConfig())) == ["0", "2"]
    assert list(target_linears(model, TensorizeConfig(target_modules=["4"]))) == ["4"]


def test_explicit_targets_regex_and_exclusions():
    model = TinyLM()
    assert list(target_linears(model, TensorizeConfig(target_modules=["ffn", "classifier"]))) == [
        "block.ffn",
        "classifier",
    ]
    regex = TensorizeConfig(target_modules=r"block\..*", exclude_modules=["out"])
    assert list(target_linears(model, regex)) == ["block.query", "block.ffn"]
    with_embedding = TensorizeConfig(target_modules=["embed", "query"], embeddings=True)
    assert list(target_linears(model, with_embedding)) == ["block.query"], "embeddings are never targets"


def test_nothing_selected_names_the_linears():
    with pytest.raises(ValueError, match=r"selects no nn.Linear; the model's linears are \['block.ffn'"):
        target_linears(TinyLM(), TensorizeConfig(target_modules=["nothing"]))


def test_replace_targets_swaps_in_place_and_refuses_a_linear_its_parent_reads_by_attribute():
    model = TinyLM()
    replace_targets(model, TensorizeConfig(target_modules=["ffn"]), lambda linear: nn.Identity())
    assert isinstance(model.block["ffn"], nn.Identity) and isinstance(model.block["query"], nn.Linear)
    attention = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    named = TensorizeConfig(target_modules=["out_proj", "1"])
    with pytest.raises(
        ValueError, match=r"'0.out_proj' cannot be replaced: its parent MultiheadAttention reads"
    ):
        replace_targets(attention, named, lambda linear: nn.Identity())
    assert isinstance(attention[1], nn.Linear), "nothing is replaced"


def test_all_linear_leaves_out_a_linear_its_parent_reads_by_attribute():
    attention = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    assert list(target_linears(attention, TensorizeConfig())) == ["1"]
    replace_targets(attention, TensorizeConfig(), lambda linear: nn.Identity())
    assert isinstance(attention[1], nn.Identity) and type(attention[0].out_proj) is not nn.Identity


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_replaced_encoder_linears_are_called_on_the_eval_fast_path():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    dense = nn.TransformerEncoder(layer, 2).eval()
    model = replace_targets(copy.deepcopy(dense), TensorizeConfig(), lambda linear: nn.Sequential(linear))
    assert isinstance(model.layers[1].linear2, nn.Sequential)
    x = torch.randn(2, 4, 16)
    padding = torch.tensor([[False] * 4, [False, False, True, True]])
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x))
        got = model(x, src_key_padding_mask=padding).masked_fill(padding[..., None], 0.0)
        want = dense(x, src_key_padding_mask=padding).masked_fill(padding[..., None], 0.0)
    torch.testing.assert_close(got, want)
