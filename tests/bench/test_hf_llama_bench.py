"""``comera bench hf_llama`` at its smoke size: what a case measures against what the shapes say (the
optimizer's state, the logits tensor), the tensorization of Hugging Face's module names, and the section it
writes."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import comera  # noqa: E402
from comera.bench import BENCHMARKS  # noqa: E402
from comera.bench.hf_llama import SIZES, hf_paper_config, llama_config, main, run_case, targets  # noqa: E402
from comera.workloads.llm.presets import TENSORIZE_PRESETS  # noqa: E402

TINY = SIZES["tiny"]


def test_it_is_a_registered_benchmark():
    assert BENCHMARKS["hf_llama"] == "comera.bench.hf_llama"


def test_the_60m_shape_is_the_llm_workloads():
    from comera.workloads.llm.model import LMConfig

    config, reference = llama_config("60m"), LMConfig()
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (32000, 512, 1376)
    assert (config.num_hidden_layers, config.num_attention_heads, config.max_position_embeddings) == (
        8,
        8,
        256,
    )
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        reference.vocab_size,
        reference.hidden_size,
        reference.intermediate_size,
    )
    assert not config.tie_word_embeddings and config.rms_norm_eps == reference.norm_eps


def test_the_hugging_face_names_get_the_workloads_layers_and_shapes():
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config("tiny"))
    comera.tensorize_(model, hf_paper_config("tiny"))
    smoke = TENSORIZE_PRESETS["llm-smoke"].shape_pattern
    layer = model.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        module = getattr(layer.self_attn, name)
        assert type(module).__name__ == "TTLinear"
        assert tuple(module.in_shape) == smoke[r"attention\.(q|k|v|o)"]["in_shape"]
    assert tuple(layer.mlp.gate_proj.out_shape) == smoke[r"mlp\.(gate|up)"]["out_shape"]
    assert tuple(layer.mlp.down_proj.in_shape) == smoke[r"mlp\.down"]["in_shape"]
    assert type(model.model.embed_tokens).__name__ == "TTMEmbedding"
    assert type(model.lm_head).__name__ == "TTLinear"


@pytest.mark.parametrize("method", ["adamw", "comera"])
def test_a_case_measures_what_the_shapes_say(method):
    result = run_case(method, 2, size="tiny", steps=2, warmup=1)
    params = result["params"]
    if method == "adamw":
        assert params == sum(p.numel() for p in LlamaForCausalLM(llama_config("tiny")).parameters())
        tensors = len(list(LlamaForCausalLM(llama_config("tiny")).parameters()))
        # fp32 weights, AdamW's two moments and a 0-dim fp32 step counter per parameter tensor
        assert result["weights_opt_mib"] * 2**20 == 12 * params + 4 * tensors
        assert result["optimizer"] == "torch.AdamW (fused)"
    else:
        assert params < 0.5 * sum(p.numel() for p in LlamaForCausalLM(llama_config("tiny")).parameters())
    assert result["logits_mib"] * 2**20 == 2 * TINY["seq"] * TINY["vocab"] * 4
    assert result["activations_mib"] > result["logits_mib"]
    # a tiny model trained in a process that freed larger blocks before may not raise its resident peak at all
    assert result["ms"] > 0 and result["training_mib"] >= 0 and result["peak_mib"] > result["training_mib"]


@pytest.mark.parametrize("method", ["adamw", "comera"])
def test_a_case_with_the_memory_savers_holds_a_chunk_of_logits_at_a_time(method):
    """Gradient checkpointing and the chunked loss of 16 tokens: the head returns 16 rows at most (the plain
    case's whole logits are 2 x 32 rows), the training's gradient checkpointing is on."""
    result = run_case(method, 2, size="tiny", steps=1, warmup=1, savers=True, loss_chunk=16)
    assert result["savers"] is True
    assert result["logits_mib"] * 2**20 == 16 * TINY["vocab"] * 4
    assert result["activations_mib"] > 0 and result["training_mib"] >= 0


def test_the_targets_are_met_or_missed_by_the_ratios():
    results = {
        ("comera", 1, False): {"ms": 100.0, "training_mib": 300.0},
        ("galore", 1, False): {"ms": 250.0, "training_mib": 1200.0},
        ("comera", 8, False): {"ms": 100.0, "training_mib": 900.0},
        ("galore", 8, False): {"ms": 150.0, "training_mib": 1800.0},
        ("comera", 8, True): {"ms": 100.0, "training_mib": 400.0},
        ("galore", 8, True): {"ms": 150.0, "training_mib": 1600.0},
    }
    lines = targets(results, [1, 8])
    assert [line.rsplit(", ", 1)[1] for line in lines] == ["met", "met", "missed", "missed"]
    assert "4.00x (300 vs 1200 MiB)" in lines[0] and "1.50x (100 vs 150 ms)" in lines[3]
    savers = targets(results, [8], (False, True))
    assert [line.rsplit(", ", 1)[1] for line in savers] == ["missed", "missed", "met", "missed"]
    assert (
        savers[2].startswith("- batch 8, both with the memory savers,")
        and "4.00x (400 vs 1600 MiB)" in savers[2]
    )


def test_the_section_is_written_with_a_row_per_case(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    argv = ["--size", "tiny", "--methods", "comera", "--batches", "1", "--steps", "1", "--warmup", "1"]
    assert main([*argv, "--threads", "1", "--write", str(page), "--label", "smoke"]) == 0
    text = page.read_text()
    assert "<!-- bench:hf-llama-smoke:start -->" in text and "<!-- bench:hf-llama-smoke:end -->" in text
    assert "1 threads)" in text.splitlines()[3]
    assert [line.split(" | ")[1] for line in text.splitlines() if line.startswith("| 1 |")] == ["comera"]


def test_the_memory_savers_add_a_row_per_case_beside_the_plain_one(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    argv = ["--size", "tiny", "--methods", "adamw", "--batches", "1", "--steps", "1", "--warmup", "1"]
    assert main([*argv, "--threads", "1", "--memory-savers", "--write", str(page)]) == 0
    text = page.read_text()
    rows = [line.split(" | ")[1:3] for line in text.splitlines() if line.startswith("| 1 |")]
    assert rows == [["adamw", "no"], ["adamw", "yes"]]
    assert "--memory-savers" in text and "`loss_chunk_size=256`" in text
