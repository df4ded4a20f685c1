"""Rank tests run many small optimizer steps: one intra-op thread avoids oversubscribing a shared CPU."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
