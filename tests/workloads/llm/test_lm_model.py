"""The LLaMA-style decoder of the language-model workload against independent float64 references."""

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comera
from comera.nn.layer import is_layer
from comera.tensorize_config import tensorize_preset
from comera.workloads.llm.model import (
    MODEL_PRESETS,
    LlamaLM,
    LMConfig,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    next_token_loss,
    rotary_tables,
)


def smoke(dtype=torch.float64, **overrides) -> LlamaLM:
    torch.manual_seed(0)
    return LlamaLM.from_preset("smoke", **overrides).to(dtype).eval()


def tensorized_smoke(dtype=torch.float64, **overrides) -> LlamaLM:
    model = smoke(torch.float32, **overrides)
    comera.tensorize_(model, tensorize_preset("llm-smoke"))
    return model.to(dtype).eval()


def ids(batch=2, length=12, vocab=96, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("vocab_size", 1, "vocab_size must be an int >= 2"),
        ("hidden_size", 0, "hidden_size must be an int >= 1"),
        ("n_layers", 1.5, "n_layers must be an int >= 1"),
        ("n_heads", 3, r"hidden_size \(32\) must be n_heads \(3\) times an even head size"),
        ("n_heads", 32, r"hidden_size \(32\) must be n_heads \(32\) times an even head size"),
        ("intermediate_size", -1, "intermediate_size must be an int >= 1"),
        ("max_seq_len", 0, "max_seq_len must be an int >= 1"),
        ("rope_theta", 0.0, r"rope_theta must be a finite number in \(0.0, inf\)"),
        ("norm_eps", -1e-6, "norm_eps must be a finite number"),
        ("initializer_range", math.nan, "initializer_range must be a finite number"),
        ("tie_embeddings", 1, "tie_embeddings must be True or False"),
        ("pad_token_id", 96, r"pad_token_id must be an int in \[0, 95\]"),
    ],
)
def test_config_errors_name_the_field_and_the_valid_range(field, value, match):
    with pytest.raises(ValueError, match=match):
        LMConfig(**{**MODEL_PRESETS["smoke"], field: value})


def test_unknown_arguments_and_presets_are_named():
    with pytest.raises(ValueError, match=r"unknown LlamaLM argument\(s\) \['width'\]"):
        LlamaLM(width=3)
    with pytest.raises(
        ValueError, match=r"unknown LM preset 'huge'; valid presets: \['paper', 'small', 'smoke'\]"
    ):
        LlamaLM.from_preset("huge")


def test_logits_have_the_contracted_shape_and_long_inputs_are_refused():
    model = smoke()
    assert model(ids(3, 7)).shape == (3, 7, 96)
    with pytest.raises(ValueError, match=r"1 <= T <= max_seq_len \(32\)"):
        model(ids(1, 33))


@settings(max_examples=12)
@given(position=st.integers(0, 15), new_token=st.integers(0, 95), seed=st.integers(0, 2**16))
def test_changing_token_t_leaves_every_earlier_logit_unchanged(position, new_token, seed):
    model = smoke()
    tokens = ids(2, 16, seed=seed)
    changed = tokens.clone()
    changed[:, position] = new_token
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :position], before[:, :position], rtol=0, atol=0)
    if not torch.equal(tokens[:, position], changed[:, position]):
        assert not torch.allclose(after[:, position:], before[:, position:])


def test_rms_norm_matches_a_numpy_reference():
    norm = RMSNorm(24, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 24, dtype=torch.float64))
    x = np.random.default_rng(0).normal(size=(3, 5, 24)) * 4.0
    expected = x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + 1e-5) * np.linspace(0.5, 1.5, 24)
    torch.testing.assert_close(norm(torch.from_numpy(x)), torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


def rotary_reference(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotary positions as complex multiplication: ``z_i = x_i + j x_{i + d/2}`` times ``e^{j t w_i}``."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    w = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    turned = z * np.exp(1j * np.outer(np.arange(x.shape[-2]), w))
    return np.concatenate([turned.real, turned.imag], axis=-1)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rotary_matches_complex_multiplication(theta):
    x = np.random.default_rng(1).normal(size=(2, 3, 9, 16))
    cos, sin = rotary_tables(9, 16, theta, dtype=torch.float64)
    got = apply_rotary(torch.from_numpy(x), cos, sin)
    torch.testing.assert_close(got, torch.from_numpy(rotary_reference(x, theta)), rtol=1e-12, atol=1e-12)


@given(shift=st.integers(0, 40), m=st.integers(0, 20), n=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_rotary_scores_depend_on_the_relative_position_only(shift, m, n, seed):
    rng = np.random.default_rng(seed)
    q, k = (torch.from_numpy(rng.normal(size=(1, 1, 1, 8))) for _ in range(2))
    cos, sin = rotary_tables(64, 8, 10000.0, dtype=torch.float64)

    def score(i, j):
        return (
            apply_rotary(q, cos[i : i + 1], sin[i : i + 1]) * apply_rotary(k, cos[j : j + 1], sin[j : j + 1])
        ).sum()

    torch.testing.assert_close(score(m + shift, n + shift), score(m, n), rtol=1e-9, atol=1e-9)
    turned = apply_rotary(q, cos[m : m + 1], sin[m : m + 1])
    torch.testing.assert_close(turned.norm(), q.norm(), rtol=1e-12, atol=1e-12)


def test_swiglu_matches_a_numpy_reference():
    torch.manual_seed(0)
    mlp = SwiGLU(8, 22).double()
    x = np.random.default_rng(2).normal(size=(4, 8))
    gate, up, down = (layer.weight.detach().numpy() for layer in (mlp.gate, mlp.up, mlp.down))
    g = x @ gate.T
    expected = (g / (1.0 + np.exp(-g)) * (x @ up.T)) @ down.T
    torch.testing.assert_close(mlp(torch.from_numpy(x)), torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_hugging_face_llama_with_the_same_weights(tie):
    transformers = pytest.importorskip("transformers")
    model = smoke(tie_embeddings=tie, rope_theta=500.0)
    config = model.config
    reference_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=tie,
    )
    reference = transformers.LlamaForCausalLM(reference_config).double().eval()
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    state["lm_head.weight"] = model.lm_head.weight
    names = {
        "attention_norm": "input_layernorm",
        "attention.q": "self_attn.q_proj",
        "attention.k": "self_attn.k_proj",
        "attention.v": "self_attn.v_proj",
        "attention.o": "self_attn.o_proj",
        "mlp_norm": "post_attention_layernorm",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
    }
    for index, block in enumerate(model.blocks):
        for ours, theirs in names.items():
            state[f"model.layers.{index}.{theirs}.weight"] = block.get_submodule(ours).weight
    reference.load_state_dict({key: value.detach() for key, value in state.items()}, strict=True)
    tokens = ids(2, 20)
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    # transformers computes the rotary angles and the RMS norms in float32 even in a float64 model: 1e-6
    # bounds that rounding, while a wrong rotary pairing or mask would differ by ~1e-1.
    assert ours.abs().max() > 1e-2
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_next_token_loss_matches_a_hand_computation():
    logits = torch.randn(2, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([[1, 2, 0, 4], [3, -100, 2, 0]])
    terms = []
    for row, column in [(0, 0), (0, 2), (1, 1)]:  # targets 2, 4, 2: the -100 and the pad id 0 are skipped
        target = labels[row, column + 1]
        log_z = math.log(sum(math.exp(v) for v in logits[row, column].tolist()))
        terms.append(log_z - logits[row, column, target].item())
    got = next_token_loss(logits, labels, pad_token_id=0)
    assert got.item() == pytest.approx(sum(terms) / 3, rel=1e-12)
    assert next_token_loss(logits, torch.full((2, 4), -100)).item() == 0.0
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\) and labels \(B, T\)"):
        next_token_loss(logits, labels[:, :3])


def test_tensorized_forward_equals_its_dense_reconstruction_in_float64():
    model = tensorized_smoke()
    assert {type(m).__name__ for m in model.modules()} >= {"TTLinear", "TTMEmbedding"}
    dense = comera.untensorize_(copy.deepcopy(model))
    assert not any(is_layer(m) for m in dense.modules())
    tokens = ids(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), dense(tokens), rtol=1e-10, atol=1e-10)


def test_a_tied_head_stays_tied_after_tensorize_and_after_save_and_load(tmp_path):
    model = tensorized_smoke(torch.float32, tie_embeddings=True)
    assert isinstance(model.lm_head, comera.TTMTiedHead) and model.lm_head.embedding is model.embed
    with torch.no_grad():
        table = model.embed.to_dense()
        hidden = torch.randn(5, 32)
        torch.testing.assert_close(model.lm_head(hidden), hidden @ table.T)
    comera.save_pretrained(model, tmp_path)
    loaded = comera.load_pretrained(tmp_path).eval()
    assert isinstance(loaded, LlamaLM) and loaded.config == model.config
    assert loaded.lm_head.embedding is loaded.embed
    tokens = ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("tensorized", [False, True])
def test_save_and_load_round_trip_rebuilds_the_model_by_name(tmp_path, tensorized):
    model = tensorized_smoke(torch.float32) if tensorized else smoke(torch.float32)
    comera.save_pretrained(model, tmp_path)
    loaded = comera.load_pretrained(tmp_path).eval()
    assert loaded.comera_model == {"name": "llama-lm", "kwargs": {**MODEL_PRESETS["smoke"], **_defaults()}}
    tokens = ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def _defaults() -> dict:
    return {
        "rope_theta": 10000.0,
        "norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_embeddings": False,
        "pad_token_id": None,
    }


@pytest.mark.parametrize("tensorized", [False, True])
def test_a_few_steps_lower_the_loss_on_a_repeating_sequence(tensorized):
    model = (tensorized_smoke if tensorized else smoke)(torch.float32).train()
    tokens = torch.arange(8).repeat(4)[None, :].repeat(4, 1)  # 0..7 four times: predictable after one period
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(15):
        loss = model.loss(tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(96), rel=0.1)  # near-uniform at the start
    assert losses[-1] < 0.5 * losses[0]


def test_paper_preset_has_the_parameter_count_of_the_60m_configuration():
    with torch.device("meta"):
        model = LlamaLM.from_preset("paper")
    vocab, width, layers, inner = 32000, 512, 8, 1376
    per_block = 4 * width * width + 3 * width * inner + 2 * width  # q, k, v, o; gate, up, down; two norms
    expected = 2 * vocab * width + layers * per_block + width  # embedding, untied head, blocks, final norm
    assert expected == 58_073_600
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.config.max_seq_len == 256 and model.config.n_heads == 8


def test_a_meta_built_model_is_initialised_like_one_built_for_real():
    with torch.device("meta"):
        model = LlamaLM.from_preset("smoke", vocab_size=4096, tie_embeddings=True)
    comera.tensorize_(model, tensorize_preset("llm-smoke", shape_pattern={}, rank_pattern={}, rank=8))
    comera.materialize_(model)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    torch.testing.assert_close(model.norm.weight, torch.ones(32))
    for layer in (model.embed, model.blocks[0].mlp.up):
        assert layer.to_dense().double().std().item() == pytest.approx(0.02, rel=0.15)
    assert model.loss(ids(2, 16, vocab=4096)).item() == pytest.approx(math.log(4096), rel=0.05)
