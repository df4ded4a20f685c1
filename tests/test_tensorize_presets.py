import subprocess
import sys

import pytest

import comera
from comera.tensorize_config import TensorizeConfig, preset_names, register_preset, tensorize_preset


def test_registered_preset_comes_back_with_overrides():
    config = TensorizeConfig(rank=7, format="ttm")
    register_preset("test-rank7", config)
    assert tensorize_preset("test-rank7") == config
    assert tensorize_preset("test-rank7", rank=3) == TensorizeConfig(rank=3, format="ttm")
    assert "test-rank7" in preset_names()
    assert comera.tensorize_preset("test-rank7") is config


def test_unknown_preset_names_the_registered_ones():
    register_preset("test-known", TensorizeConfig())
    with pytest.raises(ValueError, match="test-known"):
        tensorize_preset("test-unknown")


def test_a_name_cannot_be_taken_twice_with_another_config():
    register_preset("test-twice", TensorizeConfig(rank=2))
    register_preset("test-twice", TensorizeConfig(rank=2))
    with pytest.raises(ValueError, match="already registered"):
        register_preset("test-twice", TensorizeConfig(rank=3))
    register_preset("test-twice", TensorizeConfig(rank=3), replace=True)
    assert tensorize_preset("test-twice").rank == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="preset name"):
        register_preset("", TensorizeConfig())
    with pytest.raises(TypeError, match="config"):
        register_preset("x", {"rank": 2})


def test_a_builtin_preset_resolves_in_a_process_that_imported_only_comera():
    code = (
        "import comera\n"
        "from comera.tensorize_config import preset_names\n"
        "print(comera.tensorize_preset('nli-smoke', rank=3).rank)\n"
        "print(comera.tensorize_preset('dlrm-small').format)\n"
        "print(all(f'{w}-smoke' in preset_names() for w in ('nli', 'dlrm', 'mlm', 'llm')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "tt", "True"]
