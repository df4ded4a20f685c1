"""Rank tests run many small optimizer steps: one intra-op thread avoids oversubscribing a shared CPU."""

import pytest


@pytest.fixture(autouse=True)
def _rank_tests_run_on_one_thread(one_thread):
    """Every rank test uses the shared ``one_thread`` fixture (tests/conftest.py)."""
