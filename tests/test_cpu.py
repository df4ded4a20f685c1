"""The CPU allocation setting: argument checks and that it applies on glibc."""

import platform

import pytest

from comera.cpu import reuse_freed_memory


@pytest.mark.parametrize("bad", [0, 1024, 1 << 31, 2.5, True])
def test_threshold_is_checked(bad):
    with pytest.raises(ValueError, match="threshold_bytes"):
        reuse_freed_memory(bad)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is a glibc interface")
def test_applies_on_glibc():
    assert reuse_freed_memory(64 << 20) is True
