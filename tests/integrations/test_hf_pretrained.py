"""``comera.from_pretrained``: a tiny tensorized ``LlamaForCausalLM`` trained and pruned by ``CoMERATrainer``,
saved, loaded back in one call; its logits, its ranks, ``generate`` with and without the KV cache against a
greedy decode by full forwards, ``transformers.pipeline``; and the refusals."""

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
from hf_tiny import RepeatingTokens, arguments, llama_config, tiny_llama, tiny_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, pipeline  # noqa: E402

import comera  # noqa: E402
from comera.integrations.hf_trainer import CoMERATrainer  # noqa: E402
from comera.methods.comera import CoMERASettings  # noqa: E402
from comera.rank.size import gated_trains  # noqa: E402

STEPS = 12  # early 8; the late stage's trim and the end prune shrink the model
PROMPT = RepeatingTokens(size=2, seed=1).ids[:, :6]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The trained, pruned trainer; its model saved by ``save_model`` and a checkpoint at the last step."""
    out = tmp_path_factory.mktemp("hf-pretrained")
    args = arguments(out, max_steps=STEPS, save_strategy="steps", save_steps=STEPS)
    settings = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.5)
    trainer = CoMERATrainer(
        tiny_llama(),
        args,
        train_dataset=RepeatingTokens(),
        processing_class=tiny_tokenizer(),
        settings=settings,
        early=8,
    )
    trainer.train()
    assert any(event["event"] == "prune" for event in trainer.comera_callback.events)
    trainer.save_model(str(out / "model"))
    trainer.model.eval()
    return trainer


def saved(run, which: str) -> str:
    return run.args.output_dir + ("/model" if which == "saved" else f"/checkpoint-{STEPS}")


def greedy_by_full_forwards(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference decode: ``steps`` times the whole sequence through the model, the last position's
    argmax appended (no cache, no ``generate``)."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("which", ["saved", "checkpoint"])
def test_the_loaded_model_is_the_trained_one_at_its_pruned_ranks(run, which):
    loaded = comera.from_pretrained(saved(run, which))
    assert type(loaded) is LlamaForCausalLM and not loaded.training
    ranks = {name: train.max_ranks for name, train in gated_trains(loaded)}
    assert ranks == {name: train.max_ranks for name, train in gated_trains(run.model)}
    initial = {name: train.max_ranks for name, train in gated_trains(tiny_llama())}
    assert any(ranks[name] != initial[name] for name in ranks)  # the prune shrank some layers
    assert all(param.device.type == "cpu" for param in loaded.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=PROMPT).logits, run.model(input_ids=PROMPT).logits)


def test_generate_with_the_kv_cache_gives_the_tokens_of_full_forwards(run):
    loaded = comera.from_pretrained(saved(run, "saved"))
    expected = greedy_by_full_forwards(run.model, PROMPT, NEW_TOKENS)
    assert not torch.equal(expected[:, -NEW_TOKENS:], expected[:, :NEW_TOKENS])  # not the prompt echoed
    cached = loaded.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    uncached = loaded.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
    trained = run.model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(cached, expected)
    assert torch.equal(uncached, expected)
    assert torch.equal(trained, expected)


def test_a_text_generation_pipeline_generates_with_the_saved_tokenizer(run):
    folder = saved(run, "saved")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generator = pipeline("text-generation", model=comera.from_pretrained(folder), tokenizer=tokenizer)
    prompt = " ".join(f"w{int(i)}" for i in PROMPT[0])
    (out,) = generator(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)
    expected = greedy_by_full_forwards(run.model, PROMPT[:1], NEW_TOKENS)
    assert out["generated_text"] == tokenizer.decode(expected[0, -NEW_TOKENS:])


def test_dtype_device_and_config_overrides(run):
    loaded = comera.from_pretrained(saved(run, "saved"), dtype=torch.bfloat16, device="cpu", use_cache=False)
    assert {param.dtype for param in loaded.parameters()} == {torch.bfloat16}
    assert loaded.config.use_cache is False
    with torch.no_grad():
        got = loaded(input_ids=PROMPT).logits.float()
        torch.testing.assert_close(got, run.model(input_ids=PROMPT).logits, rtol=0.05, atol=0.1)


def test_transformers_own_loader_does_not_load_the_folder(run):
    """What docs/training.md says: ``AutoModelForCausalLM.from_pretrained`` builds dense layers, takes the
    cores as unexpected and initialises the dense weights at random."""
    model, info = AutoModelForCausalLM.from_pretrained(saved(run, "saved"), output_loading_info=True)
    assert any(".cores." in key for key in info["unexpected_keys"])
    assert "model.layers.0.self_attn.q_proj.weight" in info["missing_keys"]
    with torch.no_grad():
        assert not torch.allclose(model.eval()(input_ids=PROMPT).logits, run.model(input_ids=PROMPT).logits)


def copy_of(run, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(saved(run, "saved"), folder)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_missing_folder_is_refused_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        comera.from_pretrained(tmp_path / "nowhere")


def test_a_dense_hugging_face_folder_is_refused_as_not_a_comera_save(tmp_path):
    LlamaForCausalLM(llama_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"not a comera save \(no comera_config.json\)"):
        comera.from_pretrained(tmp_path)


def test_a_comera_save_without_config_json_is_refused_naming_the_file(tmp_path):
    comera.save_pretrained(tiny_llama(), tmp_path)
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        comera.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("architectures", "message"),
    [
        (["NoSuchModelForCausalLM"], "'NoSuchModelForCausalLM', which is not a model class"),
        (None, "expected one"),
    ],
)
def test_an_architecture_transformers_does_not_have_is_refused(run, tmp_path, architectures, message):
    folder = copy_of(run, tmp_path)
    edit_config(folder, architectures=architectures)
    with pytest.raises(ValueError, match=f"'architectures'.*{message}"):
        comera.from_pretrained(folder)


def test_an_unknown_model_type_is_refused_naming_the_file(run, tmp_path):
    folder = copy_of(run, tmp_path)
    edit_config(folder, model_type="no-such-model")
    with pytest.raises(ValueError, match=r"config\.json: not a transformers model config"):
        comera.from_pretrained(folder)


def test_an_override_the_config_does_not_take_and_a_bad_dtype_are_refused(run):
    with pytest.raises(ValueError, match="'no_such_setting', which is not an attribute of LlamaConfig"):
        comera.from_pretrained(saved(run, "saved"), no_such_setting=3)
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        comera.from_pretrained(saved(run, "saved"), dtype=torch.int8)
