"""Verifier math runs on tiny tensors, where intra-op threads only add wake-up latency (tens of ms per
op on a busy machine); one thread keeps these tests fast and is restored afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
