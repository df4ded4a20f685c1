"""The output pool: a storage is handed out again only when nothing refers to it; results never change."""

import threading

import numpy as np
import pytest
import torch

from comera import TTLinear
from comera.tt.contract import low_rank_linear
from comera.tt.recycle import OutputPool, output_pool


@pytest.fixture
def pool_for_small_outputs():
    """The process pool with every output size pooled, restored afterwards."""
    pool = output_pool()
    before = (pool.min_bytes, pool.max_bytes)
    pool.configure(0, 1 << 20)
    pool.release()
    yield pool
    pool.release()
    pool.configure(*before)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_dropped_output_is_reused_and_a_held_one_is_not():
    pool = OutputPool(min_bytes=0, max_bytes=1 << 20)
    like = torch.zeros(1)
    first = pool.take((8, 4), like)
    held = _storage(first)
    second = pool.take((8, 4), like)
    assert _storage(second) != held and pool.allocations == 2
    del first
    third = pool.take((4, 8), like)  # same size, another shape
    assert _storage(third) == held and third.shape == (4, 8) and pool.reuses == 1
    assert not third._is_view() and third.is_contiguous()


@pytest.mark.parametrize(
    "keep",
    [
        lambda t: t[1:],  # a view
        lambda t: t.numpy(),  # an exported array
        lambda t: t.untyped_storage(),  # the storage object itself
        lambda t: t.view(-1).unsqueeze(0),  # a view of a view
    ],
    ids=["view", "numpy", "storage", "view-of-view"],
)
def test_anything_that_still_refers_to_the_storage_blocks_reuse(keep):
    pool = OutputPool(min_bytes=0, max_bytes=1 << 20)
    like = torch.zeros(1)
    out = pool.take((8, 4), like)
    held, kept = _storage(out), keep(out)
    del out
    assert _storage(pool.take((8, 4), like)) != held
    del kept
    assert _storage(pool.take((8, 4), like)) == held


def test_limits_and_their_validation():
    like = torch.zeros(1)
    pool = OutputPool(min_bytes=64, max_bytes=256)
    small = pool.take((4,), like)  # 16 bytes: below min_bytes, never held
    assert pool.nbytes() == 0 and small.shape == (4,)
    outs = [pool.take((16,), like) for _ in range(6)]  # 64 bytes each: four fit
    assert pool.nbytes() == 256 and len({_storage(t) for t in outs}) == 6
    del outs
    pool.configure(0, 128)  # shrinking drops buffers beyond the new limit
    assert pool.nbytes() <= 128
    assert pool.free_nbytes() == pool.nbytes()
    pool.release()
    assert pool.nbytes() == 0
    for bad in ({"min_bytes": -1, "max_bytes": 8}, {"min_bytes": 0, "max_bytes": 1.5}):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            OutputPool(**bad)
    empty = pool.take((0, 3), like)  # an empty batch: a plain empty tensor
    assert empty.shape == (0, 3) and pool.nbytes() == 0
    off = OutputPool(min_bytes=0, max_bytes=0)
    off.take((4,), like)
    assert off.nbytes() == 0


def test_a_full_pool_makes_room_by_dropping_free_buffers_only():
    like = torch.zeros(1)
    pool = OutputPool(min_bytes=0, max_bytes=128)
    in_use = pool.take((16,), like)
    freed = pool.take((16,), like)
    del freed
    too_big = pool.take((32,), like)  # 128 bytes cannot fit beside the used 64: nothing is dropped
    assert pool.nbytes() == 128 and pool.free_nbytes() == 64
    del too_big
    other = pool.take((8,), like)  # 32 bytes: fits once the free 64-byte buffer is dropped
    assert pool.nbytes() == 64 + 32 and pool.free_nbytes() == 0
    assert _storage(pool.take((16,), like)) != _storage(in_use)
    del other


def test_tt_layer_outputs_and_gradients_stay_right_when_outputs_are_kept_or_dropped(pool_for_small_outputs):
    torch.manual_seed(0)
    layer = TTLinear(48, 40, rank=5, order="merge")
    weight, bias = layer.to_dense().double(), layer.bias.detach().double()
    inputs = [torch.randn(16, 48) for _ in range(4)]
    kept = []
    for step, x in enumerate(inputs):
        x.requires_grad_(True)
        y = layer(x)
        if step % 2 == 0:
            kept.append((x, y.detach()))  # some outputs stay alive while others are dropped
        torch.testing.assert_close(y.double(), x.double() @ weight.t() + bias, rtol=1e-5, atol=1e-5)
        upstream = torch.randn_like(y)
        y.backward(upstream)
        torch.testing.assert_close(x.grad.double(), upstream.double() @ weight, rtol=1e-5, atol=1e-5)
    for x, y in kept:
        torch.testing.assert_close(y.double(), x.detach().double() @ weight.t() + bias, rtol=1e-5, atol=1e-5)
    assert pool_for_small_outputs.reuses > 0
    assert layer(torch.randn(0, 48, requires_grad=True)).shape == (0, 40)  # an empty batch


def test_an_accumulated_input_gradient_is_never_overwritten(pool_for_small_outputs):
    torch.manual_seed(1)
    layer = TTLinear(48, 40, rank=5, order="merge")
    x = torch.randn(16, 48, requires_grad=True)
    upstream = torch.randn(16, 40)
    for _ in range(3):  # x.grad holds the first gradient's storage; later ones must add to it
        layer(x).backward(upstream)
    expected = 3 * (upstream.double() @ layer.to_dense().double())
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_an_output_saved_by_a_later_op_survives_other_calls(pool_for_small_outputs):
    torch.manual_seed(2)
    left, right = torch.randn(48, 6, requires_grad=True), torch.randn(6, 40)
    x = torch.randn(16, 48)
    y = low_rank_linear(x, left, right)
    loss = (y * y).sum()  # saves y for backward
    del y
    for _ in range(3):  # more calls of the same size while the graph holds y: reusing it would overwrite y
        low_rank_linear(torch.randn(16, 48), left.detach(), right)
    loss.backward()
    y_ref = x.double() @ left.detach().double() @ right.double()
    expected = x.double().t() @ (2 * y_ref) @ right.double().t()
    torch.testing.assert_close(
        left.grad.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max())
    )


def test_threads_never_share_a_live_output():
    pool = OutputPool(min_bytes=0, max_bytes=1 << 20)
    like = torch.zeros(1)
    clashes = []

    def work(mark: float) -> None:
        for _ in range(300):
            out = pool.take((64,), like)
            out.fill_(mark)
            if not bool((out == mark).all()):
                clashes.append(mark)

    threads = [threading.Thread(target=work, args=(float(k),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not clashes


def test_default_pool_leaves_small_and_non_cpu_outputs_alone():
    pool = output_pool()
    assert pool.min_bytes == 4 << 20 and pool.max_bytes == 64 << 20
    before = pool.allocations
    y = low_rank_linear(torch.randn(8, 16), torch.randn(16, 2), torch.randn(2, 8))
    assert pool.allocations == before and y.shape == (8, 8)
    assert np.isfinite(y.numpy()).all()


def test_a_large_tt_layer_reuses_its_outputs_by_default():
    pool = output_pool()
    pool.release()
    torch.manual_seed(3)
    layer = TTLinear(256, 256, rank=4, order="merge")
    x = torch.randn(4096, 256, requires_grad=True)  # output and input gradient: 4 MiB each
    upstream = torch.randn(4096, 256)
    reference = x.detach().double() @ layer.to_dense().double().t() + layer.bias.detach().double()
    reuses = pool.reuses
    for _ in range(3):
        x.grad = None
        y = layer(x)
        torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5)
        y.backward(upstream)
        del y
    assert pool.reuses - reuses >= 4  # both buffers, in each of the last two calls
    assert pool.nbytes() == 2 * (4 << 20)
    pool.release()
