"""Elastic runs need torchft (the `elastic` extra): without it these tests skip at collection
instead of each waiting out a start-up deadline before failing."""

import pytest

pytest.importorskip("torchft")
