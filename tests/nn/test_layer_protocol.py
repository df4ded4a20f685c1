"""The layer protocol, generically over every layer type and constructor attribute.

Every round trip is compared in float64 with the dense module it started from (an independent reference):
dense -> comera (TT-SVD at full rank) -> dense, save -> load, prune (dead entries and a dead bond) -> save ->
load -> dense. Attributes of the dense modules (``padding_idx``, ``mode``, ``include_last_offset``,
``sparse``, bias) must survive every step.
"""

import pytest
import torch
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from torch import nn

from comera import load_pretrained, prune_, save_pretrained, tensorize_, untensorize_
from comera.nn.layer import is_layer, layer_kinds, layer_type

FULL_RANK = 10_000
DENSE_ATTRIBUTES = (
    "in_features",
    "out_features",
    "num_embeddings",
    "embedding_dim",
    "padding_idx",
    "mode",
    "include_last_offset",
    "sparse",
    "max_norm",
    "scale_grad_by_freq",
)


class Holder(nn.Module):
    """One dense module ``body`` (and, for ``tied``, a linear head sharing an embedding's weight)."""

    def __init__(self, body: nn.Module, tied: bool = False):
        super().__init__()
        self.body = body
        if tied:
            self.head = nn.Linear(body.embedding_dim, body.num_embeddings, dtype=torch.float64)
            self.head.weight = body.weight

    def forward(self, *inputs, **options):
        out = self.body(*inputs, **options)
        return self.head(out) if hasattr(self, "head") else out


def _dense_cases():
    double = {"dtype": torch.float64}
    cases = {}
    for bias in (True, False):
        cases[f"linear-bias{bias}"] = lambda bias=bias: nn.Linear(12, 10, bias=bias, **double)
    for padding in (None, 3, -1):
        for sparse in (False, True):
            cases[f"embedding-pad{padding}-sparse{sparse}"] = lambda p=padding, s=sparse: nn.Embedding(
                30, 8, padding_idx=p, sparse=s, **double
            )
    for mode in ("sum", "mean", "max"):
        for last in (False, True):
            for padding in (None, 2):
                cases[f"bag-{mode}-last{last}-pad{padding}"] = lambda m=mode, la=last, p=padding: (
                    nn.EmbeddingBag(30, 8, mode=m, include_last_offset=la, padding_idx=p, **double)
                )
    cases["bag-sparse"] = lambda: nn.EmbeddingBag(30, 8, mode="sum", sparse=True, **double)
    return cases


CASES = _dense_cases()


def _inputs(module: nn.Module, generator: torch.Generator) -> tuple[tuple, dict]:
    """Random inputs for ``module``: features, or ids that include the padding row and (for a bag) an
    empty bag, with ``per_sample_weights`` in sum mode."""
    if isinstance(module, nn.Linear):
        return (torch.randn(5, module.in_features, generator=generator, dtype=torch.float64),), {}
    ids = torch.randint(0, module.num_embeddings, (11,), generator=generator)
    if module.padding_idx is not None:
        ids[[1, 6]] = module.padding_idx
    if isinstance(module, nn.Embedding):
        return (ids.reshape(1, 11),), {}
    offsets = torch.tensor([0, 3, 3, 7])
    if module.include_last_offset:
        offsets = torch.cat([offsets, torch.tensor([11])])
    options = {}
    if module.mode == "sum":
        options["per_sample_weights"] = torch.rand(11, generator=generator, dtype=torch.float64)
    return (ids, offsets), options


def _dense_description(module: nn.Module) -> dict:
    described = {key: getattr(module, key) for key in DENSE_ATTRIBUTES if hasattr(module, key)}
    described["type"] = type(module)
    described["bias"] = getattr(module, "bias", None) is not None
    return described


def _build(name: str, tied: bool = False) -> Holder:
    torch.manual_seed(0)
    return Holder(CASES[name](), tied=tied)


def _tensorize(model: Holder, fmt: str = "tt") -> Holder:
    embeddings = not isinstance(model.body, nn.Linear)
    return tensorize_(
        model, rank=FULL_RANK, init="tt_svd", embeddings=embeddings, format=fmt, target_modules=["body"]
    )


def _kill(model: nn.Module, dead_bond: bool) -> None:
    """Zero some gate entries of every layer; with ``dead_bond``, a whole bond of the first one."""
    with torch.no_grad():
        for index, layer in enumerate(m for m in model.modules() if hasattr(m, "gates")):
            layer.gates[0][0] = 0.0
            if dead_bond and index == 0:
                layer.gates[-1].zero_()


CASE_FORMATS = [
    (name, fmt)
    for name in sorted(CASES)
    for fmt in (("tt", "ttm") if name.startswith("linear") else ("ttm",))
]


@pytest.mark.parametrize("name, fmt", CASE_FORMATS)
def test_dense_to_comera_to_dense_keeps_function_and_attributes(name, fmt):
    model = _build(name)
    described = _dense_description(model.body)
    args, options = _inputs(model.body, torch.Generator().manual_seed(1))
    reference = model(*args, **options)
    _tensorize(model, fmt)
    assert is_layer(model.body)
    torch.testing.assert_close(model(*args, **options), reference, rtol=1e-9, atol=1e-9)
    untensorize_(model)
    assert _dense_description(model.body) == described
    torch.testing.assert_close(model(*args, **options), reference, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dead_bond", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_save_load_and_prune_save_load_reproduce_outputs(name, dead_bond, tmp_path):
    model = _tensorize(_build(name))
    args, options = _inputs(CASES[name](), torch.Generator().manual_seed(2))
    save_pretrained(model, tmp_path / "full")
    loaded = load_pretrained(tmp_path / "full", base_model=_build(name))
    assert torch.equal(loaded(*args, **options), model(*args, **options))
    assert loaded.body.spec() == model.body.spec()
    _kill(model, dead_bond)
    before = model(*args, **options)
    prune_(model)
    torch.testing.assert_close(model(*args, **options), before, rtol=1e-12, atol=1e-12)
    assert is_layer(model.body) and (model.body.report_format == "removed") == dead_bond
    save_pretrained(model, tmp_path / "pruned")
    loaded = load_pretrained(tmp_path / "pruned", base_model=_build(name))
    assert loaded.body.spec() == model.body.spec()
    assert torch.equal(loaded(*args, **options), model(*args, **options))
    described = _dense_description(CASES[name]())
    untensorize_(loaded)
    assert _dense_description(loaded.body) == described
    torch.testing.assert_close(loaded(*args, **options), before, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dead_bond", [False, True])
def test_tied_head_round_trips(dead_bond, tmp_path):
    name = "embedding-pad3-sparseFalse"
    model = _tensorize(_build(name, tied=True))
    assert model.head.kind == "TTMTiedHead" and model.head.references() == (model.body,)
    ids = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(3))
    _kill(model, dead_bond)
    before = model(ids)
    prune_(model)
    assert model.head.kind == ("RemovedLinear" if dead_bond else "TTMTiedHead")
    torch.testing.assert_close(model(ids), before, rtol=1e-12, atol=1e-12)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, base_model=_build(name, tied=True))
    assert torch.equal(loaded(ids), model(ids))
    untensorize_(loaded)
    assert type(loaded.head) is nn.Linear
    assert (loaded.head.weight is loaded.body.weight) != dead_bond
    torch.testing.assert_close(loaded(ids), before, rtol=1e-9, atol=1e-9)


def _non_default_layers() -> dict[str, nn.Module]:
    """One layer of every registered kind, with every constructor attribute away from its default."""
    options = {"tau": 0.05, "rank": (2, 3), "dtype": torch.float64}
    long_train = {**options, "rank": (2, 3, 2)}
    table = layer_type("TTMEmbedding")(
        30, 8, padding_idx=4, row_shape=(2, 3, 5), col_shape=(2, 2, 2), lookup="naive", **options
    )
    table.sparse = True
    layers = {
        "TTLinear": layer_type("TTLinear")(
            12, 10, bias=False, in_shape=(3, 4), out_shape=(2, 5), order="sequential", **long_train
        ),
        "TTMLinear": layer_type("TTMLinear")(
            12, 10, bias=False, in_shape=(3, 2, 2), out_shape=(1, 2, 5), order="merge", **options
        ),
        "TTMEmbedding": table,
        "TTMEmbeddingBag": layer_type("TTMEmbeddingBag")(
            30,
            8,
            mode="max",
            include_last_offset=True,
            padding_idx=0,
            row_shape=(5, 6, 1),
            col_shape=(2, 2, 2),
            lookup="split",
            **options,
        ),
        "RemovedLinear": layer_type("RemovedLinear")(7, 3, bias=False, dtype=torch.float64),
        "RemovedEmbedding": layer_type("RemovedEmbedding")(9, 4, padding_idx=2, sparse=True),
        "RemovedEmbeddingBag": layer_type("RemovedEmbeddingBag")(
            9, 4, mode="sum", include_last_offset=True, padding_idx=1, sparse=True
        ),
    }
    layers["TTMTiedHead"] = layer_type("TTMTiedHead")(table, bias=False, order="dense")
    return layers


def test_every_kind_rebuilds_from_its_spec_with_every_attribute():
    layers = _non_default_layers()
    assert set(layers) == set(layer_kinds())
    names = {id(layer): name for name, layer in layers.items()}

    def name_of(module):
        return names[id(module)]

    for kind, layer in layers.items():
        spec = layer.spec(name_of)
        assert spec["kind"] == kind
        rebuilt = layer_type(kind).from_spec(spec, dtype=torch.float64, resolve=layers.__getitem__)
        assert rebuilt.spec(name_of) == spec
        assert rebuilt.dense_mismatch(layer.to_dense_module(lambda module: None)) is None


@settings(max_examples=12, deadline=None, derandomize=True)
@seed(0)
@given(
    in_modes=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    out_modes=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    rank=st.integers(1, 5),
    ttm=st.booleans(),
    bias=st.booleans(),
)
def test_linear_shapes_and_ranks_round_trip(in_modes, out_modes, rank, ttm, bias):
    if ttm:
        out_modes = (out_modes * 3)[: len(in_modes)]
    cls = layer_type("TTMLinear" if ttm else "TTLinear")
    in_features, out_features = int(torch.tensor(in_modes).prod()), int(torch.tensor(out_modes).prod())
    torch.manual_seed(0)
    layer = cls(
        in_features,
        out_features,
        bias=bias,
        in_shape=in_modes,
        out_shape=out_modes,
        rank=rank,
        dtype=torch.float64,
    )
    dense = layer.to_dense_module()
    x = torch.randn(3, in_features, dtype=torch.float64)
    torch.testing.assert_close(dense(x), layer(x), rtol=1e-10, atol=1e-10)
    back = cls.from_dense(dense, in_shape=in_modes, out_shape=out_modes, rank=FULL_RANK)
    torch.testing.assert_close(back(x), layer(x), rtol=1e-9, atol=1e-9)
    rebuilt = cls.from_spec(layer.spec(), dtype=torch.float64)
    rebuilt.load_state_dict(layer.state_dict())
    assert torch.equal(rebuilt(x), layer(x))


@settings(max_examples=10, deadline=None, derandomize=True)
@seed(0)
@given(
    rows=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    cols=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    rank=st.integers(1, 4),
    bag=st.booleans(),
    mode=st.sampled_from(["sum", "mean", "max"]),
    last=st.booleans(),
    pad=st.booleans(),
)
def test_table_shapes_and_ranks_round_trip(rows, cols, rank, bag, mode, last, pad):
    cols = (cols * 3)[: len(rows)]
    size, dim = int(torch.tensor(rows).prod()), int(torch.tensor(cols).prod())
    options = {"padding_idx": size - 1 if pad else None, "row_shape": rows, "col_shape": cols, "rank": rank}
    torch.manual_seed(0)
    if bag:
        layer = layer_type("TTMEmbeddingBag")(
            size, dim, mode=mode, include_last_offset=last, dtype=torch.float64, **options
        )
    else:
        layer = layer_type("TTMEmbedding")(size, dim, dtype=torch.float64, **options)
    dense = layer.to_dense_module()
    args, kwargs = _inputs(dense, torch.Generator().manual_seed(4))
    torch.testing.assert_close(dense(*args, **kwargs), layer(*args, **kwargs), rtol=1e-10, atol=1e-10)
    back = type(layer).from_dense(dense, row_shape=rows, col_shape=cols, rank=FULL_RANK)
    torch.testing.assert_close(back(*args, **kwargs), layer(*args, **kwargs), rtol=1e-9, atol=1e-9)
    assert back.spec()["padding_idx"] == layer.padding_idx


def test_untensorize_of_a_bag_keeps_padding_idx_and_include_last_offset():
    """untensorize_ of a TTMEmbeddingBag used to drop padding_idx and include_last_offset."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "bag": nn.EmbeddingBag(
                20, 6, mode="sum", include_last_offset=True, padding_idx=5, dtype=torch.float64
            )
        }
    )
    ids = torch.tensor([5, 1, 2, 5, 7, 9, 5])
    offsets = torch.tensor([0, 2, 4, 7])
    weights = torch.rand(7, dtype=torch.float64)
    reference = model["bag"](ids, offsets, per_sample_weights=weights)
    tensorize_(model, embeddings=True, rank=FULL_RANK, init="tt_svd")
    untensorize_(model)
    assert model["bag"].padding_idx == 5 and model["bag"].include_last_offset
    restored = model["bag"](ids, offsets, per_sample_weights=weights)
    torch.testing.assert_close(restored, reference, rtol=1e-9, atol=1e-9)
