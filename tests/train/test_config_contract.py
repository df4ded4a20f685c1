"""TrainConfig contract: every documented boundary is accepted or refused exactly, and a refusal is a
ValueError whose whole message names the argument, the valid range and the value it got."""

import re
import types

import pytest

from comera.train import TrainConfig

GRAPH = {"cuda_graph": True, "graph_buckets": (8,), "graph_pad": {"ids": 0}}


def refuses(overrides: dict, message: str) -> None:
    """Assert TrainConfig(**overrides) raises ValueError with exactly ``message``."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TrainConfig(**overrides)


# (argument, smallest accepted value, extra settings) for every int setting with a documented lower bound.
INT_BOUNDS = [
    ("early", 0, {"late": 1}),
    ("late", 0, {"early": 5}),
    ("batch_size", 1, {}),
    ("log_every", 1, {}),
    ("eval_every", 1, {}),
    ("checkpoint_every", 1, {}),
    ("keep_checkpoints", 1, {}),
    ("max_nonfinite", 1, {}),
    ("max_rollbacks", 0, {}),
    ("graph_length_dim", 0, {}),
    ("graph_warmup", 1, {}),
]


@pytest.mark.parametrize(("name", "low", "extra"), INT_BOUNDS)
def test_int_setting_accepts_its_smallest_value(name, low, extra):
    """The documented lower bound of each int setting is accepted and stored unchanged."""
    config = TrainConfig(**extra, **{name: low})
    assert getattr(config, name) == low


@pytest.mark.parametrize(("name", "low", "extra"), INT_BOUNDS)
@pytest.mark.parametrize("below", [1, 7])
def test_int_setting_refuses_below_its_bound(name, low, extra, below):
    """A value under the lower bound raises a ValueError naming the argument, bound and value."""
    value = low - below
    refuses({**extra, name: value}, f"{name} must be an int >= {low}, got {value}")


@pytest.mark.parametrize(("name", "low", "extra"), INT_BOUNDS)
@pytest.mark.parametrize("value", [True, 2.0, "3"])
def test_int_setting_refuses_non_ints(name, low, extra, value):
    """Bools, floats and strings are not ints, whatever their value."""
    refuses({**extra, name: value}, f"{name} must be an int >= {low}, got {value!r}")


def test_the_seed_takes_every_int_the_generators_accept_and_names_its_range():
    """Seeds derived from ``seed`` are taken modulo 2**63 - 1; a larger one (a typo of 20 digits) would
    overflow ``torch.manual_seed`` with a message that names nothing."""
    from comera.train.config import MAX_SEED

    for value in (0, MAX_SEED):
        assert TrainConfig(seed=value).seed == value
    for value in (-1, MAX_SEED + 1, 10**20, True, 2.0):
        refuses({"seed": value}, f"seed must be an int in [0, {MAX_SEED}], got {value!r}")


@pytest.mark.parametrize("name", ["eval_every", "checkpoint_every"])
def test_optional_intervals_accept_none(name):
    """None for eval_every and checkpoint_every means every epoch end and is accepted."""
    assert getattr(TrainConfig(**{name: None}), name) is None


@pytest.mark.parametrize(("early", "late"), [(0, 1), (1, 0), (5, 0), (0, 5), (3, 4)])
def test_stage_lengths_with_steps_are_accepted(early, late):
    """Any early + late >= 1 is accepted."""
    config = TrainConfig(early=early, late=late)
    assert (config.early, config.late) == (early, late)


def test_run_without_steps_is_refused():
    """early = late = 0 is refused with the exact message."""
    refuses({"early": 0, "late": 0}, "early + late must be >= 1: the run has no steps")


@pytest.mark.parametrize("name", ["lr_other", "weight_decay"])
@pytest.mark.parametrize("value", [0.0, 0, 1e-300, 3.5])
def test_rate_and_decay_accept_zero_and_up(name, value):
    """lr_other and weight_decay accept every finite number >= 0."""
    assert getattr(TrainConfig(**{name: value}), name) == value


@pytest.mark.parametrize("name", ["lr_other", "weight_decay"])
@pytest.mark.parametrize("value", [-1e-300, -1.0, float("inf"), float("nan"), True, "0.1"])
def test_rate_and_decay_refuse_negative_and_non_numbers(name, value):
    """A negative, non-finite or non-number lr_other / weight_decay names the argument and [0, inf)."""
    refuses({name: value}, f"{name} must be a finite number in [0.0, inf), got {value!r}")


@pytest.mark.parametrize("value", [None, 1e-12, 1.0, 5])
def test_grad_clip_accepts_none_and_positive(value):
    """grad_clip is None (no clipping) or a number > 0."""
    assert TrainConfig(grad_clip=value).grad_clip == value


@pytest.mark.parametrize("value", [0.0, 0, -1.0, float("inf"), True])
def test_grad_clip_refuses_zero_and_below(value):
    """grad_clip = 0 and below is refused with the open interval (0, inf) in the message."""
    refuses({"grad_clip": value}, f"grad_clip must be a finite number in (0.0, inf), got {value!r}")


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_compile_accepts_its_three_values(value):
    """compile is True, False or 'auto'."""
    assert TrainConfig(compile=value).compile == value


@pytest.mark.parametrize("value", ["yes", None, "True", 2])
def test_compile_refuses_other_values(value):
    """Any other compile value is refused with the exact message."""
    refuses({"compile": value}, f"compile must be True, False or 'auto', got {value!r}")


@pytest.mark.parametrize("value", ["inductor", "eager", "aot_eager"])
def test_compile_backend_accepts_names(value):
    """A backend torch.compile knows is accepted."""
    assert TrainConfig(compile_backend=value).compile_backend == value


@pytest.mark.parametrize("value", ["", "x", "nosuch", 3, None, b"inductor"])
def test_compile_backend_refuses_names_torch_compile_does_not_know(value):
    """An unknown name (found when the first step compiled, after the data was read) or a value that is no
    name is refused when the settings are checked, with the names there are."""
    with pytest.raises(ValueError, match=r"compile_backend must be a torch.compile backend name \(one of \["):
        TrainConfig(compile_backend=value)
    with pytest.raises(ValueError, match=re.escape(f"got {value!r}")):
        TrainConfig(compile_backend=value)


@pytest.mark.parametrize("compile_", [False, "auto"])
def test_cuda_graph_accepts_compile_false_and_auto(compile_):
    """cuda_graph=True goes with compile=False or 'auto'."""
    config = TrainConfig(cuda_graph=True, compile=compile_)
    assert config.cuda_graph is True and config.compile == compile_


def test_cuda_graph_refuses_compile_true():
    """cuda_graph=True with compile=True is refused with the exact message naming the remedy."""
    refuses(
        {"cuda_graph": True, "compile": True},
        "cuda_graph=True excludes compile=True (the graph replays the eager step); "
        "set compile=False or 'auto'",
    )


def test_compile_true_is_fine_without_cuda_graph():
    """compile=True alone is accepted."""
    assert TrainConfig(cuda_graph=False, compile=True).compile is True


@pytest.mark.parametrize("buckets", [(16, 8), (8, 8), (0, 8), (), [True]])
def test_bad_graph_buckets_message_is_exact(buckets):
    """Bad graph_buckets are refused with the exact message and the value as given."""
    refuses(
        {**GRAPH, "graph_buckets": buckets},
        f"graph_buckets must be None or a strictly increasing tuple of ints >= 1, got {buckets!r}",
    )


@pytest.mark.parametrize("pad", [{}, {"ids": float("nan")}, {-1: 0}, {True: 0}, [("ids", 0)]])
def test_bad_graph_pad_message_is_exact(pad):
    """Bad graph_pad is refused with the exact message and the value as given."""
    refuses(
        {**GRAPH, "graph_pad": pad},
        "graph_pad must be None or a non-empty dict {batch key (str) or tuple index (int >= 0): "
        f"finite pad value}}, got {pad!r}",
    )


@pytest.mark.parametrize("pad", [{"ids": 0}, {0: -1.0}, {"ids": 0, 2: -100}])
def test_graph_pad_is_stored_as_its_own_dict(pad):
    """graph_pad is stored as a dict copy: changing the caller's dict later leaves the config unchanged."""
    given = dict(pad)
    config = TrainConfig(**{**GRAPH, "graph_pad": given})
    given["later"] = 1
    assert type(config.graph_pad) is dict and config.graph_pad == pad


def test_graph_pad_mapping_becomes_a_dict():
    """A read-only Mapping graph_pad is accepted and stored as a plain dict."""
    config = TrainConfig(**{**GRAPH, "graph_pad": types.MappingProxyType({"ids": 0})})
    assert type(config.graph_pad) is dict and config.graph_pad == {"ids": 0}


@pytest.mark.parametrize(
    "overrides",
    [{"graph_buckets": (8,)}, {"graph_pad": {"ids": 0}}],
)
def test_buckets_and_pad_go_together_message_is_exact(overrides):
    """graph_buckets without graph_pad (or the other way) is refused with the exact message."""
    refuses(
        {"cuda_graph": True, **overrides},
        "graph_buckets and graph_pad go together: give both (padded lengths) or neither (fixed shapes)",
    )


def test_buckets_without_cuda_graph_message_is_exact():
    """graph_buckets and graph_pad without cuda_graph are refused with the exact message."""
    refuses({**GRAPH, "cuda_graph": False}, "graph_buckets and graph_pad are used only with cuda_graph=True")
