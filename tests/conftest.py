"""Shared test settings: deterministic seeds and the hypothesis profiles (see docs/testing.md).

``ci`` (the default): derandomized, so every run draws the same examples, and no example database, so a
failure found on one machine does not change what another runs. ``dev``: random draws, more examples and
the local example database; pick it with ``HYPOTHESIS_PROFILE=dev``.
"""

import os
import warnings
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis loads its own "ci" profile when it sees a CI environment: both profiles start from the
# library's plain defaults so that the environment does not leak into "dev".
_DEFAULTS = settings.get_profile("default")
settings.register_profile(
    "ci",
    parent=_DEFAULTS,
    derandomize=True,
    database=None,
    max_examples=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    parent=_DEFAULTS,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Autotuning off in every process the tests start (comera.tt.autotune): a run in a fresh process then makes
# the same choices as the test's own process, so resumed and compared runs can be checked bit for bit.
os.environ["COMERA_AUTOTUNE"] = "0"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def layer_registry(monkeypatch):
    """``register_layer`` on a copy of the layer registry that the test's end discards, so a layer type a
    test registers does not outlive it (the registry is process-wide)."""
    from comera.nn import layer

    monkeypatch.setattr(layer, "_LAYER_TYPES", dict(layer._LAYER_TYPES))
    return layer.register_layer


@pytest.fixture
def threads():
    """``torch.set_num_threads`` for the test; the thread count before it is restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def one_thread(threads):
    """One intra-op thread for the test: many small kernels on a shared CPU run faster and steadier so."""
    threads(1)


@pytest.fixture(autouse=True)
def _estimated_choices():
    """Autotuning off (comera.tt.autotune): every choice comes from the estimates, so a test's bits and
    routes never depend on the machine's timings; tests of autotuning turn it on themselves."""
    from comera.tt.autotune import autotune, clear_autotune_cache

    clear_autotune_cache()
    with autotune(False):
        yield
    clear_autotune_cache()


@pytest.fixture
def deadline():
    """``deadline(seconds)``: a ``TimeoutError`` in the test after that many seconds (SIGALRM), so a call
    that would block forever (reading a pipe) fails the test instead of hanging the suite."""
    import signal

    def expire(signum, frame):
        raise TimeoutError("the test waited past its deadline: something blocks")

    previous = signal.signal(signal.SIGALRM, expire)
    yield signal.alarm
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


class CacheDamage:
    """Damages a file of a cache entry in one way, ``how``, and checks the warning of its rebuild."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __call__(self, file) -> None:
        """Cut ``file`` to half its length, replace its bytes by bytes of another kind, empty it, or put a
        pipe in its place (reading it would wait forever)."""
        if self.how == "pipe":
            file.unlink()
            os.mkfifo(file)
            return
        data = file.read_bytes()
        damaged = {"truncated": data[: len(data) // 2], "garbage": b"\x89garbage\x00\xff" * 3, "empty": b""}
        file.write_bytes(damaged[self.how])

    @contextmanager
    def rebuilt(self, file):
        """Check that the block warns once, with a ``RuntimeWarning`` naming ``file`` and its rebuild."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        messages = [str(warning.message) for warning in caught if warning.category is RuntimeWarning]
        assert len(messages) == 1, messages
        assert str(file) in messages[0] and "is rebuilt" in messages[0], messages


@pytest.fixture(params=["truncated", "garbage", "empty", "pipe"])
def cache_damage(request) -> CacheDamage:
    """A :class:`CacheDamage` of each kind: a test using it runs once per kind."""
    return CacheDamage(request.param)


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group (FSDP's and DDP's modules imported first), torn down after the module
    when this fixture started it."""
    import torch.distributed as dist
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401 (imported here, once, rather than in the first test)

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if started:
        dist.destroy_process_group()
