"""The CPU allocation setting: argument checks and that it applies on glibc."""

import platform
import subprocess
import sys

import pytest

from comera.cpu import reuse_freed_memory


@pytest.mark.parametrize("bad", [0, 1024, 1 << 31, 2.5, True])
def test_threshold_is_checked(bad):
    with pytest.raises(ValueError, match="threshold_bytes"):
        reuse_freed_memory(bad)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is a glibc interface")
def test_applies_on_glibc():
    assert reuse_freed_memory(64 << 20) is True


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is a glibc interface")
def test_a_large_free_stays_mapped_for_reuse():
    """Over 1 GiB freed at once (more than the block threshold) stays mapped: allocating it again faults
    in almost no page. Run in a fresh process, which keeps that memory until it exits."""
    script = (
        "import resource, torch\n"
        "from comera.cpu import reuse_freed_memory\n"
        "assert reuse_freed_memory(1 << 30)\n"
        "blocks = [torch.ones(100 << 20) for _ in range(3)]\n"  # 3 x 400 MiB, each below the threshold
        "del blocks\n"
        "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "blocks = [torch.ones(100 << 20) for _ in range(3)]\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(done.stdout.strip()) < 10_000  # 1.2 GiB faulted in again would be about 300,000
