"""Shared test settings: deterministic seeds and a hypothesis profile that fits the CPU budget."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "comera",
    deadline=None,
    max_examples=int(os.environ.get("COMERA_HYPOTHESIS_EXAMPLES", "30")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("comera")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
