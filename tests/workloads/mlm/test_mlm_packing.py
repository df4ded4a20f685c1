"""Packing token ids into fixed-length blocks keeps every token once, in order."""

from hypothesis import given
from hypothesis import strategies as st

from comera.data.bpe import SpecialIds
from comera.workloads.mlm.packing import pack_documents

IDS = SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=4, vocab_size=1000)


@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=12),
    seq_len=st.integers(2, 17),
    tail=st.sampled_from(["pad", "drop"]),
)
def test_packing_keeps_every_token_exactly_once(lengths, seq_len, tail):
    counter = iter(range(5, 10_000))
    documents = [[next(counter) for _ in range(length)] for length in lengths]
    stream = [token for document in documents if document for token in [*document, IDS.eos]]
    packed = pack_documents(documents, seq_len, IDS, tail=tail)
    assert packed.tokens.shape == (len(packed), seq_len)
    assert (packed.tokens[:, 0] == IDS.bos).all()
    bodies = [packed.tokens[i, 1 : int(packed.lengths[i])].tolist() for i in range(len(packed))]
    flat = [token for body in bodies for token in body]
    rest = len(stream) % (seq_len - 1)
    if tail == "pad":
        assert flat == stream
        assert packed.dropped_tokens == 0
        assert (packed.tokens[packed.tokens == IDS.pad].numel()) == (seq_len - 1 - rest if rest else 0)
    else:
        assert flat == stream[: len(stream) - rest]
        assert packed.dropped_tokens == rest
        assert (packed.lengths == seq_len).all()
    assert packed.num_tokens == len(flat) + len(packed)
