"""``resize_token_embeddings`` of a tensorized Hugging Face model: refused with ``NotImplementedError`` naming
the call and what to do while an embedding is a comera layer (after tensorize_ and after load_pretrained),
and working again after untensorize_, or when only the model's inner linears were converted."""

import copy
import re

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_tiny import llama_config, tiny_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import comera  # noqa: E402

MESSAGE = re.escape(
    "resize_token_embeddings cannot resize a tensorized model: its input embeddings (TTMEmbedding) and "
    "output embeddings (TTLinear) hold tensor-train cores"
)


def test_resizing_tensorized_embeddings_is_refused_naming_the_call_and_the_way_out(tmp_path):
    model = tiny_llama()
    with pytest.raises(NotImplementedError, match=MESSAGE + r".*call comera\.untensorize_\(model\), resize"):
        model.resize_token_embeddings(100)
    assert model.get_input_embeddings().num_embeddings == 96  # nothing changed
    comera.save_pretrained(model, tmp_path / "saved")
    loaded = comera.load_pretrained(tmp_path / "saved", base_model=LlamaForCausalLM(llama_config()))
    with pytest.raises(NotImplementedError, match=MESSAGE):
        loaded.resize_token_embeddings(100)
    copied = copy.deepcopy(model)
    with pytest.raises(NotImplementedError, match=MESSAGE):
        copied.resize_token_embeddings(100)


def test_after_untensorize_the_model_resizes_as_a_dense_one():
    model = comera.untensorize_(tiny_llama())
    table = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(100)
    assert model.get_input_embeddings().weight.shape == (100, 32)
    assert model.get_output_embeddings().weight.shape == (100, 32)
    torch.testing.assert_close(model.get_input_embeddings().weight[:96], table)


def test_a_model_whose_embeddings_stay_dense_resizes_as_its_dense_twin():
    torch.manual_seed(0)
    dense = LlamaForCausalLM(llama_config())
    model = comera.tensorize_(copy.deepcopy(dense), target_modules="all-linear", rank=4)
    assert not isinstance(model.get_input_embeddings(), comera.TTMEmbedding)
    dense.resize_token_embeddings(100, mean_resizing=False)
    model.resize_token_embeddings(100, mean_resizing=False)
    assert model.get_input_embeddings().weight.shape == dense.get_input_embeddings().weight.shape == (100, 32)
    torch.testing.assert_close(
        model.get_input_embeddings().weight[:96], dense.get_input_embeddings().weight[:96]
    )
