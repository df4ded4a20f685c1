"""tensorize_ on a model built on the meta device, and materialize_ for the modules left dense."""

import math

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, BertModel

from comera import TTLinear, TTMEmbedding, TTMTiedHead, materialize_, tensorize_
from comera.tensorize import meta_init_std

TINY_BERT = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.05,
)
WORD_EMBEDDING_SHAPES = {"word_embeddings": {"row_shape": (10, 10, 10), "col_shape": (4, 4, 4)}}


def meta_tensors(model: nn.Module) -> list[str]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [name for name, tensor in named if tensor.is_meta]


class Net(nn.Module):
    """Linears to convert, and a LayerNorm (parameters) and a BatchNorm (buffers) that stay dense."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.norm = nn.LayerNorm(256)
        self.batch_norm = nn.BatchNorm1d(256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.batch_norm(self.norm(self.up(x)))))


def meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def tiny_bert_on_meta(cls=BertModel, **extra):
    config = BertConfig(**TINY_BERT, **extra)
    with torch.device("meta"):
        return cls(config), config


def test_no_meta_tensor_left_in_a_plain_model():
    model = meta_net()
    tensorize_(model, init="random", rank=8)
    assert meta_tensors(model)  # the dense LayerNorm / BatchNorm wait for materialize_
    materialize_(model)
    assert meta_tensors(model) == []
    assert isinstance(model.up, TTLinear) and isinstance(model.down, TTLinear)
    torch.testing.assert_close(model.norm.weight, torch.ones(256))
    torch.testing.assert_close(model.batch_norm.running_var, torch.ones(256))
    assert int(model.batch_norm.num_batches_tracked) == 0


def test_no_meta_tensor_left_in_a_hugging_face_bert():
    model, config = tiny_bert_on_meta()
    tensorize_(
        model, init="random", rank=8, embeddings=("word_embeddings",), shape_pattern=WORD_EMBEDDING_SHAPES
    )
    materialize_(model)
    assert meta_tensors(model) == []
    reference = BertModel(config)  # built for real: Hugging Face's own initialisation
    embeddings = model.embeddings
    torch.testing.assert_close(embeddings.position_ids, reference.embeddings.position_ids)
    torch.testing.assert_close(embeddings.token_type_ids, reference.embeddings.token_type_ids)
    torch.testing.assert_close(embeddings.LayerNorm.weight, torch.ones(64))
    dense_std = embeddings.position_embeddings.weight.detach().double().std().item()
    assert dense_std == pytest.approx(config.initializer_range, rel=0.05)


def test_reconstructed_std_matches_the_nn_linear_default():
    model = meta_net()
    tensorize_(model, init="random", rank=8)
    for name, in_features in (("up", 64), ("down", 256)):
        target = 1.0 / math.sqrt(3 * in_features)
        measured = getattr(model, name).to_dense().detach().double().std().item()
        torch.manual_seed(0)
        dense = Net()  # independent reference: torch's own init of the same layer
        reference = getattr(dense, name).weight.detach().double().std().item()
        assert reference == pytest.approx(target, rel=0.05)
        assert measured == pytest.approx(target, rel=0.1)
        assert meta_init_std(dense, getattr(dense, name)) == pytest.approx(target)


def test_reconstructed_std_matches_the_hugging_face_initializer_range():
    model, config = tiny_bert_on_meta()
    tensorize_(
        model, init="random", rank=8, embeddings=("word_embeddings",), shape_pattern=WORD_EMBEDDING_SHAPES
    )
    layers = [module for module in model.modules() if isinstance(module, (TTLinear, TTMEmbedding))]
    assert len(layers) == 2 * 6 + 1 + 1  # 6 linears per layer, the pooler, the word embedding
    torch.manual_seed(0)
    reference = BertModel(config)
    reference_std = reference.encoder.layer[0].attention.self.query.weight.detach().double().std().item()
    assert reference_std == pytest.approx(config.initializer_range, rel=0.05)
    for layer in layers:
        measured = layer.to_dense().detach().double().std().item()
        assert measured == pytest.approx(config.initializer_range, rel=0.1)
        if isinstance(layer, TTLinear):
            torch.testing.assert_close(layer.bias, torch.zeros_like(layer.bias))


def test_reconstruction_rms_is_the_rms_of_the_dense_train():
    torch.manual_seed(0)
    layer = TTLinear(64, 256, in_shape=(8, 8), out_shape=(16, 16), rank=8)
    with torch.no_grad():
        layer.gates[1][:3] = 0.0  # dead entries count as zeros in the reconstruction
    dense = layer.to_dense().detach().double()
    assert layer.reconstruction_rms() == pytest.approx(dense.pow(2).mean().sqrt().item(), rel=1e-6)
    table = TTMEmbedding(1000, 64, row_shape=(10, 10, 10), col_shape=(4, 4, 4), rank=6)
    table.scale_to_std_(0.3)
    assert table.to_dense().detach().double().pow(2).mean().sqrt().item() == pytest.approx(0.3, rel=1e-6)


@pytest.mark.parametrize("std", [0.0, -1.0, math.inf, True])
def test_scale_to_std_refuses_a_bad_std(std):
    layer = TTLinear(16, 16, rank=4)
    with pytest.raises(ValueError, match="std must be a finite float > 0"):
        layer.scale_to_std_(std)


def test_tt_svd_on_a_meta_model_is_refused():
    model = meta_net()
    with pytest.raises(ValueError, match=r"init='tt_svd'.*meta device.*nothing to decompose"):
        tensorize_(model, init="tt_svd", rank=8)
    assert isinstance(model.up, nn.Linear) and model.up.weight.is_meta  # unchanged


@pytest.mark.parametrize("device", ["meta", "nowhere"])
def test_a_bad_device_is_refused(device):
    with pytest.raises((ValueError, RuntimeError), match="device"):
        tensorize_(meta_net(), init="random", rank=8, device=device)


def fit(model: nn.Module, steps: int = 80) -> tuple[float, float]:
    """Loss before and after ``steps`` Adam steps on a fixed regression batch."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=generator)
    y = torch.tanh(x @ torch.randn(64, 64, generator=generator) / 8)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_training_a_meta_built_model_lowers_the_loss_like_a_dense_built_one():
    torch.manual_seed(0)
    meta_model = materialize_(tensorize_(meta_net(), init="random", rank=8))
    torch.manual_seed(0)
    dense_model = tensorize_(Net(), init="random", rank=8)
    meta_start, meta_end = fit(meta_model)
    dense_start, dense_end = fit(dense_model)
    assert meta_start == pytest.approx(dense_start, rel=0.5)
    assert meta_end < 0.5 * meta_start and dense_end < 0.5 * dense_start
    assert meta_end / meta_start == pytest.approx(dense_end / dense_start, rel=0.25)


def test_materialize_keeps_tied_weights_tied_and_uses_reset_parameters():
    with torch.device("meta"):
        model = nn.ModuleDict(
            {"embed": nn.Embedding(50, 8), "head": nn.Linear(8, 50), "norm": nn.LayerNorm(8)}
        )
    model["head"].weight = model["embed"].weight
    torch.manual_seed(0)
    materialize_(model)
    assert meta_tensors(model) == []
    assert model["head"].weight is model["embed"].weight
    torch.testing.assert_close(model["norm"].bias, torch.zeros(8))
    bound = 1.0 / math.sqrt(8)
    assert model["head"].bias.abs().max().item() <= bound
    assert model["head"].bias.std().item() > 0.3 * bound


def test_a_tied_head_of_a_meta_model_becomes_a_ttm_tied_head():
    with torch.device("meta"):
        model = nn.ModuleDict({"embed": nn.Embedding(64, 16), "head": nn.Linear(16, 64)})
    model["head"].weight = model["embed"].weight
    tensorize_(model, init="random", rank=4, target_modules=("embed",))
    materialize_(model)
    assert meta_tensors(model) == []
    head = model["head"]
    assert isinstance(head, TTMTiedHead) and head.embedding is model["embed"]
    torch.testing.assert_close(head.bias, torch.zeros(64))
    assert model["embed"].to_dense().detach().double().std().item() == pytest.approx(1.0, rel=0.15)


def test_materialize_names_a_module_it_cannot_initialise():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"\['1'\].*reset_parameters"):
        materialize_(model)
    assert model[0].weight.is_meta  # nothing changed


def test_a_tiny_bert_classifier_built_on_meta_gives_finite_outputs_and_trains():
    torch.manual_seed(0)
    model, _ = tiny_bert_on_meta(BertForSequenceClassification, num_labels=3)
    tensorize_(
        model, init="random", rank=8, embeddings=("word_embeddings",), shape_pattern=WORD_EMBEDDING_SHAPES
    )
    materialize_(model)
    assert meta_tensors(model) == []
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 1000, (8, 16), generator=generator)
    labels = torch.randint(0, 3, (8,), generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(12):
        output = model(input_ids=ids, labels=labels)
        assert torch.isfinite(output.logits).all()
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(output.loss.item())
    assert losses[0] == pytest.approx(math.log(3), rel=0.2)
    assert losses[-1] < 0.5 * losses[0]
