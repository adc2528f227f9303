"""One intra-op thread: these tests use tiny matrices, where OpenMP threads on a busy 2-core machine
only add spin-waiting (see tests/optim/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
