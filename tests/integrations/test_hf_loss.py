"""``chunked_causal_lm_loss`` against the loss of the whole logits: Hugging Face's own ``ForCausalLMLoss`` in
fp32 and an independent float64 cross-entropy; a dense and a tensorized head, ignored targets, chunk sizes
that divide the tokens or not, ``num_items_in_batch``, gradcheck, and the chunk bound on the logits."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from comera import TTLinear  # noqa: E402
from comera.integrations.hf_loss import chunked_causal_lm_loss  # noqa: E402

BATCH, SEQ, WIDTH, VOCAB = 3, 7, 16, 24  # 21 tokens


def heads():
    torch.manual_seed(0)
    return {"dense": nn.Linear(WIDTH, VOCAB).double(), "tensorized": TTLinear(WIDTH, VOCAB, rank=3).double()}


def case(seed=1):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, WIDTH, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, 2] = labels[1, 5] = labels[2, 1] = -100  # ignored targets
    return hidden, labels


def reference_loss(hidden, head, labels, num_items=None):
    """float64 next-token cross-entropy of the whole logits: positions 0..seq-2 predict labels 1..seq-1."""
    logits = head(hidden)[:, :-1].reshape(-1, VOCAB)
    targets = labels[:, 1:].reshape(-1)
    total = nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return total / ((targets != -100).sum() if num_items is None else num_items)


def gradients(loss, hidden, head):
    return torch.autograd.grad(loss, [hidden, *head.parameters()])


@pytest.mark.parametrize("kind", ["dense", "tensorized"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 20, 21, 1000])
def test_loss_and_gradients_equal_the_whole_logits(kind, chunk_size):
    head = heads()[kind]
    hidden, labels = case()
    want = reference_loss(hidden, head, labels)
    got = chunked_causal_lm_loss(hidden, head, labels, chunk_size=chunk_size)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(gradients(got, hidden, head), gradients(want, hidden, head), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["dense", "tensorized"])
@pytest.mark.parametrize("num_items", [None, 11, "tensor"])
def test_it_is_hugging_faces_loss_in_fp32(kind, num_items):
    head = heads()[kind].float()
    hidden, labels = case()
    hidden = hidden.detach().float().requires_grad_(True)
    items = torch.tensor(11) if num_items == "tensor" else num_items
    want = ForCausalLMLoss(head(hidden), labels, VOCAB, num_items_in_batch=items)
    got = chunked_causal_lm_loss(hidden, head, labels, chunk_size=5, num_items_in_batch=items)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(gradients(got, hidden, head), gradients(want, hidden, head), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_num_items_in_batch_divides_the_sum():
    head = heads()["dense"]
    hidden, labels = case()
    want = reference_loss(hidden, head, labels, num_items=40)
    got = chunked_causal_lm_loss(hidden, head, labels, chunk_size=6, num_items_in_batch=40)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, reference_loss(hidden, head, labels))


def test_shift_labels_are_taken_as_given():
    head = heads()["dense"]
    hidden, labels = case()
    shifted = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    got = chunked_causal_lm_loss(hidden, head, shift_labels=shifted, chunk_size=4)
    torch.testing.assert_close(got, reference_loss(hidden, head, labels), rtol=1e-12, atol=1e-12)


def test_gradcheck_in_float64():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(5, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.tensor([[1, 4, -100, 0], [2, 2, 3, -100]])

    def loss(hidden, weight):
        return chunked_causal_lm_loss(hidden, lambda rows: rows @ weight.T, labels, chunk_size=3)

    assert torch.autograd.gradcheck(loss, (hidden, weight))


def test_no_more_than_a_chunk_of_logits_exists_forward_or_backward():
    """The head sees at most ``chunk_size`` rows at a time, in the forward and in the backward's
    recomputation (21 tokens in chunks of 5: 5 calls each way, none of them of the whole logits)."""
    head = heads()["dense"]
    rows = []
    head.register_forward_hook(lambda module, args, output: rows.append(output.shape[0]))
    hidden, labels = case()
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=5)
    assert rows == [5, 5, 5, 5, 1]
    loss.backward()
    assert rows[5:] == [1, 5, 5, 5, 5]  # recomputed last chunk first


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None, "8"])
def test_a_bad_chunk_size_is_refused_naming_it(bad):
    head = heads()["dense"]
    hidden, labels = case()
    with pytest.raises(ValueError, match=r"chunk_size must be an integer >= 1 \(tokens per chunk\), got"):
        chunked_causal_lm_loss(hidden, head, labels, chunk_size=bad)


def test_labels_of_another_shape_are_refused():
    head = heads()["dense"]
    hidden, labels = case()
    with pytest.raises(ValueError, match=r"labels must have hidden_states' shape .*\(3, 7\), got \(3, 6\)"):
        chunked_causal_lm_loss(hidden, head, labels[:, 1:])
    with pytest.raises(ValueError, match="needs labels or shift_labels"):
        chunked_causal_lm_loss(hidden, head)
