"""Buckets, batch structure and static-buffer filling of :mod:`comera.train.padding` at their edges: a bucket
of 1, a padded entry exactly its buffer's length, entries after a non-tensor one, list and tuple batches, and
the exact errors for entries of the wrong kind or shape. Padded buffers are checked element by element
against the unpadded batch."""

from collections import namedtuple

import pytest
import torch

from comera.train.padding import check_buckets, entries, fill_static, pad_batch, rebuild


def test_a_bucket_of_one_is_accepted():
    """1 is the smallest valid bucket (the bound is ``>= 1``, not ``> 1``)."""
    assert check_buckets([1, 2]) == (1, 2)
    assert check_buckets((1,)) == (1,)


def test_a_single_int_is_refused_as_buckets_with_a_value_error():
    """``buckets=8`` (an int, not a list) gets the ValueError naming the setting, not a TypeError from
    iterating it."""
    with pytest.raises(ValueError, match=r"^buckets must be a strictly increasing list of ints >= 1, got 8$"):
        check_buckets(8)


def test_an_unreadable_batch_is_named_by_its_type():
    """The TypeError for a batch that is no tensor, dict, list or tuple names the batch's own type."""
    with pytest.raises(TypeError, match=r"dict, list or tuple of tensors, got int$"):
        entries(5)


def test_a_list_batch_stays_a_list_and_is_padded_entry_by_entry():
    """``pad_batch`` of a list returns a list (rebuilt from the list's own type); the padded entry holds the
    original values then the pad value, the other entry is passed through."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    labels = torch.tensor([7, 8])
    padded = pad_batch([ids, labels], {0: -1}, 5)
    assert type(padded) is list and len(padded) == 2
    assert padded[1] is labels
    assert padded[0].shape == (2, 5)
    for row in range(2):
        for col in range(5):
            want = ids[row, col].item() if col < 3 else -1
            assert padded[0][row, col].item() == want, (row, col)


def test_a_namedtuple_batch_is_rebuilt_as_the_same_namedtuple_and_other_tuples_as_plain_tuples():
    """A named tuple comes back of its own type (a loss reading ``batch.ids`` runs on the padded batch as on
    the eager one), its fields holding the new values in order; another tuple subclass comes back a plain
    tuple (its constructor's signature is unknown)."""
    Pair = namedtuple("Pair", ["ids", "mask"])
    first, second = torch.zeros(1), torch.ones(1)
    rebuilt = rebuild(Pair(torch.ones(1), torch.zeros(1)), [first, second])
    assert type(rebuilt) is Pair
    assert rebuilt.ids is first and rebuilt.mask is second

    class Marked(tuple):
        pass

    plain = rebuild(Marked((torch.ones(1), torch.zeros(1))), [first, second])
    assert type(plain) is tuple and plain[0] is first and plain[1] is second


def test_tensors_after_a_non_tensor_entry_are_still_copied():
    """A non-tensor entry equal to its captured value is skipped and the entries after it are filled (the
    loop goes on past it)."""
    static = {"tag": "a", "ids": torch.zeros(2, 3, dtype=torch.long), "weights": torch.zeros(2)}
    batch = {"tag": "a", "ids": torch.tensor([[1, 2, 3], [4, 5, 6]]), "weights": torch.tensor([0.5, 2.0])}
    fill_static(static, batch)
    assert static["tag"] == "a"
    assert torch.equal(static["ids"], batch["ids"])
    assert torch.equal(static["weights"], batch["weights"])


def test_a_non_tensor_where_a_tensor_was_captured_is_named_with_its_type():
    """A batch entry that is not a tensor where the graph captured one: ValueError naming the entry and the
    type it got."""
    static = {"ids": torch.zeros(1, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"^batch\['ids'\] must be a tensor like at capture, got list$"):
        fill_static(static, {"ids": [[1, 2, 3]]})


def test_a_padded_entry_exactly_as_long_as_its_buffer_fills_it():
    """Boundary: a padded entry whose length equals the buffer's (the bucket equals the batch length) is
    copied whole, with nothing left to pad."""
    static = {"ids": torch.full((2, 4), 9, dtype=torch.long)}
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    fill_static(static, {"ids": ids}, {"ids": 0})
    assert torch.equal(static["ids"], ids)


def test_a_shorter_padded_entry_is_copied_then_padded_along_the_length_dim():
    """Element by element along ``length_dim=2`` of a 3-dim entry: the batch's values first, then the pad
    value; the unpadded entry is copied exactly."""
    static = (torch.full((2, 3, 5), 4.0), torch.zeros(2))
    values = torch.arange(12.0).reshape(2, 3, 2)
    other = torch.tensor([1.5, -2.5])
    fill_static(static, (values, other), {0: -7.0}, length_dim=2)
    for index in range(2):
        for row in range(3):
            for col in range(5):
                want = values[index, row, col].item() if col < 2 else -7.0
                assert static[0][index, row, col].item() == want, (index, row, col)
    assert torch.equal(static[1], other)


def test_an_unpadded_entry_of_another_length_is_refused_with_the_whole_message():
    """An entry not named in ``pad`` must keep its captured shape even along ``length_dim`` (a length-1 entry
    would otherwise broadcast silently); the message names the entry, both shapes, and the two remedies,
    without the padded-entry wording."""
    static = {"ids": torch.zeros(2, 5, dtype=torch.long), "mask": torch.zeros(2, 5)}
    batch = {"ids": torch.ones(2, 3, dtype=torch.long), "mask": torch.ones(2, 1)}
    message = (
        r"^batch\['mask'\] has shape \(2, 1\), the captured graph expects \(2, 5\); "
        r"batch with drop_last=True, or pad this entry$"
    )
    with pytest.raises(ValueError, match=message):
        fill_static(static, batch, {"ids": 0})


def test_a_padded_entry_longer_than_its_buffer_is_refused_with_the_whole_message():
    """A padded entry longer than its buffer: the message says the shape is expected up to the padded
    length."""
    static = {"ids": torch.zeros(2, 6)}
    message = (
        r"^batch\['ids'\] has shape \(2, 7\), the captured graph expects \(2, 6\) up to the padded length; "
        r"batch with drop_last=True, or pad this entry$"
    )
    with pytest.raises(ValueError, match=message):
        fill_static(static, {"ids": torch.ones(2, 7)}, {"ids": 0})


def test_a_padded_entry_without_the_length_dim_is_refused_by_name():
    """Boundary ``value.dim() == length_dim``: a padded entry lacking the length dim is a shape error naming
    the entry, not an IndexError from reading its length."""
    static = {"ids": torch.zeros(2, 6)}
    message = r"^batch\['ids'\] has shape \(2,\), the captured graph expects \(2, 6\) up to the padded length"
    with pytest.raises(ValueError, match=message):
        fill_static(static, {"ids": torch.ones(2)}, {"ids": 0})
