"""The net tests' credentials: made once per session (Ed25519 keys take microseconds, but every
test reads the same two runs)."""

from __future__ import annotations

import pytest
from net_helpers import Keys, make_keys


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))
