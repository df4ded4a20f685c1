"""tensorize_ / untensorize_: target grammar, patterns, inits, loud errors, wrappers, Hugging Face models."""

import copy
import re

import pytest
import torch
from torch import nn

from comera import (
    TensorizeConfig,
    TensorizeError,
    TensorizeWarning,
    TTLinear,
    TTMEmbedding,
    TTMLinear,
    TTMTiedHead,
    tensorize_,
    untensorize_,
)
from comera.tensorize import tensorize_configs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(16, 16)
        self.value = nn.Linear(16, 16, bias=False)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.query(x) + self.value(x))


class TinyLM(nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.embed = nn.Embedding(40, 16, padding_idx=0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 40)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _types(model):
    return {name: type(module).__name__ for name, module in model.named_modules() if name}


def test_all_linear_skips_the_tied_output_head():
    model = tensorize_(TinyLM(), rank=4)
    kinds = _types(model)
    assert kinds["blocks.0.query"] == kinds["blocks.1.value"] == "TTLinear"
    assert kinds["head"] == "Linear" and kinds["embed"] == "Embedding"
    assert model.head.weight is model.embed.weight


def test_list_targets_match_dotted_suffixes_and_regex_matches_full_names():
    model = tensorize_(TinyLM(), target_modules=["query"], format="ttm", rank=3)
    kinds = _types(model)
    assert kinds["blocks.0.query"] == kinds["blocks.1.query"] == "TTMLinear"
    assert kinds["blocks.0.value"] == "Linear"
    model = tensorize_(TinyLM(), target_modules=r"blocks\.1\..*", rank=3)
    kinds = _types(model)
    assert kinds["blocks.1.query"] == kinds["blocks.1.value"] == "TTLinear"
    assert kinds["blocks.0.query"] == "Linear"


def test_exclusions_and_patterns():
    config = TensorizeConfig(
        exclude_modules=["blocks.0.value"],
        rank=4,
        rank_pattern={r"blocks\.1\.query": 2},
        shape_pattern={"value": {"in_shape": [2, 8], "out_shape": [8, 2]}},
    )
    model = tensorize_(TinyLM(), config)
    assert isinstance(model.blocks[0].value, nn.Linear)
    assert model.blocks[1].query.max_ranks == (2,)
    assert model.blocks[0].query.max_ranks == (4,)
    assert model.blocks[1].value.in_shape == (2, 8) and model.blocks[1].value.out_shape == (8, 2)
    assert tensorize_configs(model) == (config,)


def test_tt_svd_at_full_rank_reproduces_the_dense_model():
    torch.manual_seed(0)
    model = TinyLM().double()
    ids = torch.randint(0, 40, (3, 5))
    before = model(ids)
    tensorize_(model, rank=64, init="tt_svd", embeddings=True)
    assert isinstance(model.embed, TTMEmbedding) and isinstance(model.head, TTMTiedHead)
    torch.testing.assert_close(model(ids), before, rtol=1e-9, atol=1e-9)
    assert model.embed.padding_idx == 0


def test_random_init_keeps_biases_and_gives_fresh_cores():
    model = TinyLM()
    bias = model.blocks[0].query.bias.detach().clone()
    weight = model.blocks[0].query.weight.detach().clone()
    tensorize_(model, rank=4, init="random")
    torch.testing.assert_close(model.blocks[0].query.bias.detach(), bias)
    assert not torch.allclose(model.blocks[0].query.to_dense(), weight)
    assert model.blocks[0].query.to_dense().std().item() == pytest.approx(weight.std().item(), rel=1e-4)


def test_untied_head_when_asked():
    model = tensorize_(TinyLM(), rank=4, embeddings=True, tie_output_head=False)
    assert isinstance(model.head, nn.Linear) and isinstance(model.embed, TTMEmbedding)


def test_untensorize_restores_dense_modules_with_the_same_function():
    torch.manual_seed(0)
    model = tensorize_(TinyLM().double(), rank=3, embeddings=True)
    ids = torch.randint(0, 40, (2, 6))
    before = model(ids)
    untensorize_(model)
    assert {type(m) for m in model.modules()} <= {
        TinyLM,
        nn.ModuleList,
        Block,
        nn.Linear,
        nn.LayerNorm,
        nn.Embedding,
    }
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model(ids), before, rtol=1e-10, atol=1e-10)
    assert tensorize_configs(model) == ()


def test_compiled_wrapper_is_looked_through():
    model = TinyLM()
    compiled = torch.compile(model, backend="eager")
    assert tensorize_(compiled, target_modules=["query"], rank=2) is compiled
    assert isinstance(model.blocks[0].query, TTLinear)


def test_unmatched_target_lists_close_names():
    with pytest.raises(ValueError, match=r"'qurey'.*blocks\.0\.query"):
        tensorize_(TinyLM(), target_modules=["qurey"])


def test_target_of_an_unsupported_type_says_so():
    with pytest.raises(ValueError, match="unsupported types.*norm"):
        tensorize_(TinyLM(), target_modules=["norm"])


def test_a_second_tensorize_names_the_layers_that_are_already_tensorized():
    model = TinyLM()
    tensorize_(model, rank=2)
    with pytest.raises(ValueError, match=r"already tensorized: 'blocks\.0\.query' \(TTLinear\)"):
        tensorize_(model, target_modules=["blocks.0.query"], rank=2)
    with pytest.raises(ValueError, match=r"the model is already tensorized \(\d+ comera layers, e\.g\. '"):
        tensorize_(model, rank=2)


@pytest.mark.parametrize(
    "overrides, match, error",
    [
        ({"exclude_modules": ["nothing_here"]}, "exclude_modules", TensorizeError),
        ({"target_modules": ["nothing_here"]}, "target_modules entry 'nothing_here'", TensorizeError),
        ({"rank_pattern": {"nothing_here": 2}}, "rank_pattern", TensorizeError),
        ({"shape_pattern": {"query": {"row_shape": [4, 4]}}}, "in_shape/out_shape", TensorizeError),
        ({"shape_pattern": {"query": {"in_shape": [3, 5]}}}, "blocks.0.query", TensorizeError),
        ({"rank": [2, 2, 2, 2, 2]}, "module 'blocks.0.query': rank", TensorizeError),
        ({"target_modules": ["query"], "exclude_modules": ["query"]}, "selects no module", TensorizeError),
        ({"rank_typo": 3}, "unknown TensorizeConfig field", ValueError),
    ],
)
def test_bad_settings_raise_before_changing_the_model(overrides, match, error):
    """A config that does not fit the model raises :class:`TensorizeError` (a ``ValueError``) naming the
    field or module; a config that is wrong in itself a plain ``ValueError``."""
    model = TinyLM()
    with pytest.raises(ValueError, match=match) as raised:
        tensorize_(model, **overrides)
    assert type(raised.value) is error
    assert not any(isinstance(m, (TTLinear, TTMLinear, TTMEmbedding)) for m in model.modules())


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"format": "cp"}, "format"),
        ({"rank": 0}, "rank"),
        ({"rank": [2, 0]}, "rank"),
        ({"init": "svd"}, "init"),
        ({"target_modules": "("}, "not a valid regular expression"),
        ({"target_modules": []}, "target_modules"),
        ({"tau": -1.0}, "tau"),
        ({"embeddings": "all-linear"}, "embeddings"),
        ({"shape_pattern": {"x": {"in_shape": [0, 2]}}}, "shape_pattern"),
    ],
)
def test_bad_configs_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        TensorizeConfig(**fields)


def test_config_json_round_trip():
    config = TensorizeConfig(
        target_modules=["query"], rank=(2, 3), rank_pattern={"q": 4}, embeddings=["embed"]
    )
    assert TensorizeConfig.from_dict(config.to_dict()) == config


def _train_one_step(model, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(**batch).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    optimizer.step()
    return loss, grads


def test_bert_for_sequence_classification_converts_and_trains():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=1000
    )
    model = transformers.BertForSequenceClassification(config)
    tensorize_(model, rank=8, embeddings=["word_embeddings"])
    assert isinstance(model.bert.encoder.layer[0].attention.self.query, TTLinear)
    assert isinstance(model.bert.embeddings.word_embeddings, TTMEmbedding)
    assert isinstance(model.bert.embeddings.position_embeddings, nn.Embedding)
    batch = {"input_ids": torch.randint(0, 1000, (4, 12)), "labels": torch.tensor([0, 1, 1, 0])}
    loss, grads = _train_one_step(model, batch)
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_roberta_for_masked_lm_keeps_its_head_tied():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=40,
    )
    model = transformers.RobertaForMaskedLM(config)
    tensorize_(model, rank=8, embeddings=["word_embeddings"], format="ttm")
    head = model.lm_head.decoder
    assert isinstance(head, TTMTiedHead) and head.embedding is model.roberta.embeddings.word_embeddings
    assert isinstance(model.lm_head.dense, TTMLinear)
    assert model.lm_head.bias is head.bias
    ids = torch.randint(3, 1000, (2, 10))
    loss, grads = _train_one_step(model, {"input_ids": ids, "labels": ids})
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)


class SharedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = self.a
        self.c = nn.Linear(16, 16)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x))))


def test_a_module_reachable_under_two_names_becomes_one_layer_under_both():
    torch.manual_seed(0)
    model = SharedModule().double()
    x = torch.randn(3, 16, dtype=torch.float64)
    before = model(x)
    tensorize_(model, rank=64, init="tt_svd")
    assert isinstance(model.a, TTLinear) and model.a is model.b
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)
    assert sum(isinstance(m, TTLinear) for m in model.modules()) == 2
    untensorize_(model)
    assert isinstance(model.a, nn.Linear) and model.a is model.b
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)


def test_selecting_one_name_of_a_shared_module_converts_it_everywhere():
    model = tensorize_(SharedModule(), target_modules=["b"], rank=2)
    assert isinstance(model.a, TTLinear) and model.a is model.b and isinstance(model.c, nn.Linear)


def test_excluding_one_name_of_a_shared_module_while_selecting_another_is_refused():
    model = SharedModule()
    with pytest.raises(ValueError, match=r"'a' is the same module as 'b'.*every name or none"):
        tensorize_(model, exclude_modules=["b"], rank=2)
    assert isinstance(model.a, nn.Linear)


def test_linears_sharing_a_weight_parameter_are_refused_naming_both():
    model = SharedModule()
    model.b = nn.Linear(16, 16)
    model.b.weight = model.a.weight
    with pytest.raises(ValueError, match=r"'a' shares its weight Parameter with 'b'"):
        tensorize_(model, rank=2)
    assert type(model.a) is type(model.b) is nn.Linear and model.a.weight is model.b.weight


def test_a_head_tied_to_an_unconverted_embedding_is_refused():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"'head' shares its weight Parameter with 'embed'"):
        tensorize_(model, target_modules=["head"], rank=2)
    assert model.head.weight is model.embed.weight


def _encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


def test_all_linear_leaves_out_multihead_attention_out_proj_and_the_encoder_still_runs():
    torch.manual_seed(0)
    dense = _encoder()
    with pytest.warns(
        TensorizeWarning, match=r"parent MultiheadAttention reads out_proj.bias and out_proj.weight"
    ):
        model = tensorize_(copy.deepcopy(dense), rank=64, init="tt_svd")
    layer = model.layers[0]
    assert type(layer.self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(layer.linear1, TTLinear) and isinstance(layer.linear2, TTLinear)
    x = torch.randn(3, 5, 32, requires_grad=True)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-4, atol=1e-4)
    model(x).sum().backward()
    assert layer.linear1.cores[0].grad is not None and x.grad is not None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore::comera.TensorizeWarning")
def test_a_converted_encoder_matches_the_dense_one_on_the_eval_fast_path():
    torch.manual_seed(0)
    dense = _encoder().eval()
    model = tensorize_(copy.deepcopy(dense), rank=64, init="tt_svd")
    x = torch.randn(3, 5, 32)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), rtol=1e-4, atol=1e-4)
        got = model(x, src_key_padding_mask=padding).masked_fill(padding[..., None], 0.0)
        want = dense(x, src_key_padding_mask=padding).masked_fill(padding[..., None], 0.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class PositionTable(nn.Module):
    """Reads its position table by attribute (``self.pos.weight``) and calls its token table."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(40, 16)
        self.pos = nn.Embedding(8, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, ids):
        return self.out(self.tok(ids) + self.pos.weight[: ids.shape[-1]])


def test_embeddings_true_leaves_out_a_table_its_parent_reads_by_attribute():
    model = tensorize_(PositionTable(), rank=4, embeddings=True)
    assert isinstance(model.tok, TTMEmbedding) and type(model.pos) is nn.Embedding
    assert model(torch.randint(0, 40, (2, 5))).shape == (2, 5, 16)


@pytest.mark.parametrize(
    ("build", "overrides", "name", "parent"),
    [
        (_encoder, {"target_modules": ["out_proj"]}, "layers.0.self_attn.out_proj", "MultiheadAttention"),
        (_encoder, {"target_modules": r".*\.(out_proj|linear1)"}, "layers.0.self_attn.out_proj", "Multihead"),
        (PositionTable, {"target_modules": ["out"], "embeddings": ["pos"]}, "pos", "PositionTable"),
    ],
)
def test_a_target_its_parent_reads_by_attribute_is_refused_by_name(build, overrides, name, parent):
    model = build()
    with pytest.raises(
        ValueError, match=rf"module '{re.escape(name)}' cannot be tensorized: its parent {parent}"
    ):
        tensorize_(model, rank=4, **overrides)
    assert not any(isinstance(module, TTLinear) for module in model.modules()), "the model is unchanged"


def test_a_target_with_no_close_name_lists_some_of_the_models_names_instead():
    """No module name resembles the target: the error lists names the model has, not an empty list."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"no module has a close name; some of the model's: \['0', '2'\]"):
        tensorize_(model, TensorizeConfig(target_modules=["query"]))
    with pytest.raises(ValueError, match=r"key 'query' matches no module being tensorized; they are: \['0'"):
        tensorize_(model, TensorizeConfig(rank_pattern={"query": 2}))


class _ReadsItsProjection(nn.Module):
    """A parent that calls ``proj`` and also reads ``proj.weight`` in its forward (as BLOOM's attention does
    on a branch its default config never takes)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.other = nn.Linear(16, 16)

    def forward(self, x):
        if self.proj.weight.dim() > 2:
            return x
        return self.other(self.proj(x))


class _Experts(nn.Module):
    """Stacked expert weights, ``[experts, out, in]``, beside a linear router."""

    def __init__(self, experts=4):
        super().__init__()
        self.router = nn.Linear(16, experts)
        self.weight = nn.Parameter(torch.randn(experts, 16, 16))

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        return torch.einsum("be,eoi,bi->bo", gate, self.weight, x)  # b batch, e expert, o out, i in


def test_all_linear_warns_naming_the_linears_it_leaves_dense_for_their_parent_unless_excluded(recwarn):
    """The default selection leaves a linear read by its parent dense: said in a TensorizeWarning naming it
    and the reason; naming it in exclude_modules says it is meant, and then nothing is said."""
    model = nn.Sequential(_ReadsItsProjection(), _ReadsItsProjection())
    with pytest.warns(TensorizeWarning, match=r"2 linear\(s\) stay dense .*'0.proj', '1.proj'.*_ReadsIts"):
        tensorize_(model, rank=4)
    assert type(model[0].proj) is nn.Linear and isinstance(model[0].other, TTLinear)
    quiet = nn.Sequential(_ReadsItsProjection())
    recwarn.clear()
    tensorize_(quiet, rank=4, exclude_modules=["proj"])
    assert not [w for w in recwarn if issubclass(w.category, TensorizeWarning)]


def test_all_linear_warns_about_stacked_expert_weights_with_their_share_and_not_about_convolutions(recwarn):
    """Parameters of three or more dimensions outside convolutions (a mixture of experts' stacked weights)
    are not converted: the warning names them with their share of the model's parameters. A convolution's
    4-D weight is not such a parameter."""
    model = nn.Sequential(_Experts(), nn.Linear(16, 16))
    share = 4 * 16 * 16 / sum(p.numel() for p in model.parameters())
    with pytest.warns(
        TensorizeWarning, match=rf"1 parameter\(s\) .* {share:.0%} of .*'0.weight \[4, 16, 16\]'"
    ):
        tensorize_(model, rank=4)
    recwarn.clear()
    convolutional = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 16))
    tensorize_(convolutional, rank=4)
    assert not [w for w in recwarn if issubclass(w.category, TensorizeWarning)]
    recwarn.clear()
    tensorize_(nn.Sequential(_Experts(), nn.Linear(16, 16)), rank=4, target_modules=["1"])
    assert not [w for w in recwarn if issubclass(w.category, TensorizeWarning)], "targets named: nothing said"
    in_two_calls = tensorize_(
        nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), rank=4, target_modules=["0"]
    )
    tensorize_(in_two_calls, rank=4)
    assert isinstance(in_two_calls[1], TTLinear)
    assert not [w for w in recwarn if issubclass(w.category, TensorizeWarning)], "the first call's cores"
