"""One intra-op thread in the test process (the simulator reference runs here): on a busy 2-core
machine, OpenMP threads on tiny matrices only add spin-waiting (see tests/optim/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
