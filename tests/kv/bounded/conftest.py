"""The bounded KV manager's tests run their tiny tensors on one thread (``one_thread``); the
oracle and scenario driver they share are in tests/helpers.py."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
