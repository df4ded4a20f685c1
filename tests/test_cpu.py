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


_FREE_AT_ONCE = """
import ctypes, ctypes.util, os
from comera.cpu import reuse_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
statm = os.open("/proc/self/statm", os.O_RDONLY)
def rss():
    return int(os.pread(statm, 200, 0).split()[1]) * 4096
rss()
assert reuse_freed_memory(1 << 30)
size = 400 << 20  # below the block threshold: from the heap
blocks = [libc.malloc(size) for _ in range(3)]
for block in blocks:
    libc.memset(block, 1, size)
before = rss()
for block in reversed(blocks):  # the top of the heap first: 1.2 GiB free at its top
    libc.free(block)
print(before - rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is a glibc interface")
def test_a_large_free_stays_mapped_for_reuse():
    """1.2 GiB freed at the top of the heap at once (more than the 1 GiB block threshold) stays resident:
    the heap is never trimmed. Plain mallocs in a fresh process, so nothing else lands above the blocks."""
    done = subprocess.run([sys.executable, "-c", _FREE_AT_ONCE], capture_output=True, text=True, check=True)
    assert int(done.stdout.strip()) < 64 << 20  # a trimmed heap gives back about 1.2 GiB
