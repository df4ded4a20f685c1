"""TrainConfig: bad values are refused with the argument's name and range; the dict form round-trips; CoMERA's
settings are not among its keys."""

import pytest

from comera.train import TrainConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"early": -1}, "early must be an int >= 0"),
        ({"early": 0, "late": 0}, "early \\+ late must be >= 1"),
        ({"unit": "epochs"}, "unit must be one of"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"keep_checkpoints": 0}, "keep_checkpoints must be an int >= 1"),
        ({"run_dir": 3}, "run_dir must be a path"),
        ({"eval_every": 0}, "eval_every must be an int >= 1"),
        ({"precision": "fp16"}, "precision must be one of"),
        ({"compile": "yes"}, "compile must be True, False or 'auto'"),
        ({"cuda_graph": 1}, "cuda_graph must be True or False"),
        ({"reuse_cpu_memory": "yes"}, "reuse_cpu_memory must be True or False"),
        ({"cuda_graph": True, "compile": True}, "cuda_graph=True excludes compile=True"),
        (
            {"cuda_graph": True, "graph_buckets": (16, 8), "graph_pad": {"ids": 0}},
            "graph_buckets must be None or a strictly increasing tuple of ints >= 1",
        ),
        (
            {"cuda_graph": True, "graph_buckets": (8,), "graph_pad": {}},
            "graph_pad must be None or a non-empty",
        ),
        (
            {"cuda_graph": True, "graph_buckets": (8,), "graph_pad": {"ids": float("nan")}},
            "graph_pad must be",
        ),
        ({"cuda_graph": True, "graph_buckets": (8,), "graph_pad": {-1: 0}}, "graph_pad must be"),
        ({"cuda_graph": True, "graph_buckets": (8,)}, "graph_buckets and graph_pad go together"),
        ({"graph_buckets": (8,), "graph_pad": {"ids": 0}}, "used only with cuda_graph=True"),
        ({"graph_length_dim": -1}, "graph_length_dim must be an int >= 0"),
        ({"graph_warmup": 0}, "graph_warmup must be an int >= 1"),
    ],
)
def test_bad_values_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides)


def test_dict_round_trip_and_unknown_keys():
    config = TrainConfig(early=2, late=3, graph_buckets=None, lr_other=1e-3)
    values = config.to_dict()
    assert values["early"] == 2 and values["lr_other"] == 1e-3
    assert TrainConfig.from_dict(values) == config
    with pytest.raises(ValueError, match="unknown TrainConfig keys \\['epochs'\\]"):
        TrainConfig.from_dict({**values, "epochs": 3})


def test_graph_settings_round_trip():
    config = TrainConfig(
        cuda_graph=True, graph_buckets=[8, 16], graph_pad={"ids": 0, 2: -100}, graph_warmup=2
    )
    assert config.graph_buckets == (8, 16)
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_paths_are_accepted_as_path_objects(tmp_path):
    config = TrainConfig(run_dir=tmp_path / "run", checkpoint_dir=tmp_path / "ck")
    assert config.run_dir == str(tmp_path / "run") and config.checkpoint_dir == str(tmp_path / "ck")
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("key", ["gamma", "target_ratio", "prune_at", "lr_cores", "lr_gates", "tau"])
def test_comera_s_settings_are_not_train_settings(key):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{key}'"):
        TrainConfig(early=2, **{key: 0.5})
    with pytest.raises(ValueError, match=rf"unknown TrainConfig keys \['{key}'\]; valid keys"):
        TrainConfig.from_dict({**TrainConfig().to_dict(), key: 0.5})
