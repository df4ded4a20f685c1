"""DLRM: the interaction against a loop over pairs, the forward against a direct computation, bags, the
tensorized model against its dense reconstruction, presets and save/load."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional

from comera import (
    TTMEmbeddingBag,
    compression_report,
    load_pretrained,
    save_pretrained,
    tensorize_,
    untensorize_,
)
from comera.workloads.dlrm.model import (
    CRITEO_KAGGLE_CARDINALITIES,
    DLRM,
    DotInteraction,
    dlrm_preset,
)
from comera.workloads.dlrm.presets import TENSORIZE_PRESETS, dlrm_tensorize_config

CARDINALITIES = (50, 7, 300, 3, 120)
BOTTOM, TOP = (13, 12, 4), (10, 1)


def _model(dtype=torch.float64) -> DLRM:
    torch.manual_seed(0)
    return DLRM(CARDINALITIES, BOTTOM, TOP).to(dtype)


def _inputs(batch: int, cardinalities=CARDINALITIES, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)
    dense = torch.rand(batch, 13, generator=generator, dtype=dtype)
    ids = torch.stack([torch.randint(0, rows, (batch,), generator=generator) for rows in cardinalities])
    return dense, ids


def test_interaction_equals_loop_over_pairs():
    torch.manual_seed(0)
    bottom, embedded = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    out = DotInteraction(5)(bottom, embedded)
    vectors = [bottom] + [embedded[:, f] for f in range(5)]
    pairs = [(vectors[i] * vectors[j]).sum(1) for i in range(6) for j in range(i + 1, 6)]
    expected = torch.cat([bottom, torch.stack(pairs, dim=1)], dim=1)
    assert out.shape == (3, 4 + 15)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_reference_sizes():
    model = DLRM((3,) * 26)
    assert model.interaction.num_outputs == 351
    assert model.top[0].in_features == 367
    assert [m.out_features for m in model.bottom if isinstance(m, nn.Linear)] == [512, 256, 64, 16]
    assert [m.out_features for m in model.top if isinstance(m, nn.Linear)] == [512, 256, 1]
    assert isinstance(model.top[-1], nn.Linear)
    assert all(table.mode == "sum" for table in model.tables)
    assert dlrm_preset("paper")["cardinalities"] == CRITEO_KAGGLE_CARDINALITIES
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26 and sum(CRITEO_KAGGLE_CARDINALITIES) == 33_762_577


def test_forward_equals_direct_computation():
    model = _model()
    dense, ids = _inputs(6)
    linears = [m for m in model.bottom if isinstance(m, nn.Linear)]
    x = dense
    for linear in linears:
        x = torch.relu(x @ linear.weight.T + linear.bias)
    vectors = [x] + [model.tables[f].weight[ids[f]] for f in range(len(CARDINALITIES))]
    pairs = [(vectors[i] * vectors[j]).sum(1) for i in range(6) for j in range(i + 1, 6)]
    z = torch.cat([x, torch.stack(pairs, 1)], 1)
    top = [m for m in model.top if isinstance(m, nn.Linear)]
    z = torch.relu(z @ top[0].weight.T + top[0].bias) @ top[1].weight.T + top[1].bias
    torch.testing.assert_close(model(dense, ids), z.squeeze(1), rtol=1e-12, atol=1e-12)


def test_bags_with_offsets_sum_rows():
    model = _model()
    dense, ids = _inputs(4)
    # sample 0 of every field gets a bag of two ids (its own and sample 1's); the others one id each
    per_field = [torch.cat([ids[f, :1], ids[f, 1:2], ids[f, 1:]]) for f in range(len(CARDINALITIES))]
    offsets = torch.tensor([[0, 2, 3, 4]] * len(CARDINALITIES))
    out = model(dense, per_field, offsets)
    single = model(dense, ids)
    embedded = model.embed(ids, None)
    embedded[0] = embedded[0] + embedded[1]
    expected = model.top(model.interaction(model.bottom(dense), embedded)).squeeze(1)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1:], single[1:], rtol=1e-12, atol=1e-12)
    fixed = model(dense, torch.stack([ids, ids], dim=2))
    embedded = 2 * model.embed(ids, None)
    torch.testing.assert_close(fixed, model.top(model.interaction(model.bottom(dense), embedded)).squeeze(1))


def test_dense_backward_reaches_every_parameter():
    model = _model(torch.float32)
    dense, ids = _inputs(8, dtype=torch.float32)
    labels = (torch.arange(8) % 2).float()
    functional.binary_cross_entropy_with_logits(model(dense, ids), labels).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def _tensorized(dtype=torch.float64) -> DLRM:
    model = _model(dtype)
    config = dlrm_tensorize_config(CARDINALITIES, 4, min_rows=100, rank=3, order=2)
    return tensorize_(model, config)


def test_tensorize_converts_only_large_tables_and_matches_dense_reconstruction():
    model = _tensorized()
    kinds = [type(table) for table in model.tables]
    assert kinds == [nn.EmbeddingBag, nn.EmbeddingBag, TTMEmbeddingBag, nn.EmbeddingBag, TTMEmbeddingBag]
    assert model.tables[2].row_shape == (15, 20) and model.tables[2].col_shape == (2, 2)
    assert all(isinstance(m, (nn.Linear, nn.ReLU)) for m in [*model.bottom, *model.top])
    dense_copy = untensorize_(copy.deepcopy(model))
    assert type(dense_copy.tables[2]) is nn.EmbeddingBag
    dense, ids = _inputs(16)
    torch.testing.assert_close(model(dense, ids), dense_copy(dense, ids), rtol=1e-10, atol=1e-12)


def test_tensorized_backward_matches_dense_reconstruction_gradient():
    model = _tensorized()
    dense, ids = _inputs(16)
    labels = (torch.arange(16) % 3 == 0).double()
    functional.binary_cross_entropy_with_logits(model(dense, ids), labels).backward()
    table = model.tables[2]
    assert all(core.grad is not None and core.grad.abs().sum() > 0 for core in table.cores)
    # gradient of the loss with respect to the reconstructed table, chained to the cores by autograd
    weight = table.to_dense()
    reference = copy.deepcopy(model)
    reference.tables[2] = nn.EmbeddingBag(300, 4, mode="sum").double()
    reference.tables[2].weight = nn.Parameter(weight.detach().clone())
    functional.binary_cross_entropy_with_logits(reference(dense, ids), labels).backward()
    cores = list(table.cores)
    expected = torch.autograd.grad(table.to_dense(), cores, reference.tables[2].weight.grad)
    for core, grad in zip(cores, expected):
        torch.testing.assert_close(core.grad, grad, rtol=1e-9, atol=1e-12)


def test_named_presets_select_tables_above_threshold():
    paper = TENSORIZE_PRESETS["dlrm-paper"]
    large = [f"tables.{i}" for i, rows in enumerate(CRITEO_KAGGLE_CARDINALITIES) if rows > 100_000]
    assert list(paper.target_modules) == large and len(large) == 7
    assert paper.rank == 32
    assert paper.shapes_for("tables.2")["col_shape"] == (2, 2, 2, 2)
    model = DLRM.from_preset("smoke")
    tensorize_(model, TENSORIZE_PRESETS["dlrm-smoke"])
    converted = {i for i, t in enumerate(model.tables) if isinstance(t, TTMEmbeddingBag)}
    assert converted == {i for i, rows in enumerate(dlrm_preset("smoke")["cardinalities"]) if rows > 500}
    report = compression_report(model)
    dense_rows = sum(dlrm_preset("smoke")["cardinalities"][i] for i in converted)
    assert report.tensorized_dense_params == dense_rows * 8


def test_small_preset_compresses_its_tables_over_50x():
    model = DLRM.from_preset("small")
    tensorize_(model, TENSORIZE_PRESETS["dlrm-small"])
    assert compression_report(model).tensorized_ratio > 50


def test_save_and_load_rebuild_the_tensorized_model(tmp_path):
    model = _tensorized(torch.float32)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded, DLRM) and isinstance(loaded.tables[4], TTMEmbeddingBag)
    dense, ids = _inputs(5, dtype=torch.float32)
    torch.testing.assert_close(loaded(dense, ids), model(dense, ids))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_mlp must end in 1"):
        DLRM((4, 4), (13, 4), (8, 2))
    with pytest.raises(ValueError, match="cardinalities must be"):
        DLRM((4, 0), (13, 4), (1,))
    with pytest.raises(ValueError, match="unknown DLRM preset"):
        dlrm_preset("huge")
    with pytest.raises(ValueError, match="min_rows must be below"):
        dlrm_tensorize_config((4, 5), 4, min_rows=10, rank=2)
    model = _model()
    dense, ids = _inputs(3)
    with pytest.raises(ValueError, match=r"ids must have shape \(5, B\)"):
        model(dense, ids[:4])
    with pytest.raises(ValueError, match=r"dense must have shape \(B, 13\)"):
        model(dense[:, :5], ids)
    with pytest.raises(ValueError, match="batch sizes differ"):
        model(dense[:2], ids)
