"""A graph kept from before a prune must not impose the old shapes on the next backward, eager or compiled.

Autograd caches each leaf's gradient accumulator, shapes included, while a graph refers to it; ``prune_``
drops those caches. Every layer type is covered: TT and TTM linears, a TTM table with the head tied to it, a
TTM bag, and a layer removed by a dead bond (its stand-in). Gradients after the prune are compared with those
of a deep copy of the pruned model, which never had a graph.
"""

import copy

import pytest
import torch
from torch import nn

from comera import TTLinear, TTMEmbedding, TTMEmbeddingBag, TTMLinear, TTMTiedHead, prune_, tensorize_

VOCAB, WIDTH = 12, 8


class EveryLayer(nn.Module):
    """Token table (tied head) + bag of tokens -> TT linear -> TTM linear -> TT linear that dies -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = TTMEmbedding(VOCAB, WIDTH, row_shape=(3, 4), col_shape=(2, 4), rank=4)
        self.bag = TTMEmbeddingBag(VOCAB, WIDTH, row_shape=(4, 3), col_shape=(4, 2), rank=4)
        self.tt = TTLinear(WIDTH, WIDTH, in_shape=(2, 4), out_shape=(4, 2), rank=4)
        self.ttm = TTMLinear(WIDTH, WIDTH, in_shape=(2, 4), out_shape=(2, 4), rank=4)
        self.dying = TTLinear(WIDTH, WIDTH, in_shape=(2, 4), out_shape=(2, 4), rank=3)
        self.head = TTMTiedHead(self.table)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.table(tokens) + self.bag(tokens).unsqueeze(1)
        hidden = torch.tanh(self.ttm(torch.tanh(self.tt(hidden))))
        return self.head(hidden + self.dying(hidden)).logsumexp(-1).mean()


def _kill_gates(model: EveryLayer) -> None:
    with torch.no_grad():
        for layer in (model.table, model.bag, model.tt, model.ttm):
            for gate in layer.gates:
                gate[-1] = 0.0
        model.dying.gates[0].zero_()


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_backward_after_prune_with_a_graph_kept_from_before(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = EveryLayer()
    tokens = torch.randint(0, VOCAB, (3, 5))
    step = model if backend is None else torch.compile(model, backend=backend)
    kept = step(tokens)
    kept.backward(retain_graph=True)
    _kill_gates(model)
    result = prune_(model)
    assert {layer.name for layer in result.layers} == {"table", "bag", "tt", "ttm", "dying"}
    assert "dying" in result.removed
    reference = copy.deepcopy(model)
    got = _grads(model, step(tokens))
    want = _grads(reference, reference(tokens))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert kept.grad_fn is not None


def test_compiled_bert_step_after_pruning_its_word_embedding():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    tensorize_(model, target_modules=["word_embeddings"], rank=4)
    table = model.bert.embeddings.word_embeddings
    tokens = torch.randint(0, 60, (2, 5))
    torch._dynamo.reset()
    step = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend="aot_eager")
    kept = step(tokens)
    kept.backward()
    with torch.no_grad():
        table.gates[0][-1] = 0.0
    assert prune_(model).changed
    reference = copy.deepcopy(model)
    got = _grads(model, step(tokens))
    want = _grads(reference, reference(input_ids=tokens, labels=tokens).loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
