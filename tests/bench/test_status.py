"""The shared reader of ``/proc/self/status`` that the benchmarks take their memory figures from."""

import math
import mmap
import sys

import pytest

from comera.measure import status_kib, status_mib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_resident_size_is_read_in_kib_and_mib():
    before = status_kib("VmRSS")
    # A fresh anonymous mapping: a heap allocation could reuse pages already resident from earlier tests.
    block = mmap.mmap(-1, 64 * 2**20)
    block[::4096] = b"\1" * len(block[::4096])
    after = status_mib("VmRSS")
    block.close()
    assert before > 0 and after * 1024 - before >= 60 * 1024
    assert status_kib("VmHWM") >= status_kib("VmRSS") - 1024


def test_a_missing_field_gives_the_missing_value():
    assert status_kib("NoSuchField") is None
    assert status_mib("NoSuchField") is None
    assert math.isnan(status_mib("NoSuchField", missing=float("nan")))
