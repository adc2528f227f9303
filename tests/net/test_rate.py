"""The control service's per-host rate (``net/rate.py``): a burst passes at once, then each
request waits its turn at the rate; idle time refills the bucket up to the burst, never beyond."""

from __future__ import annotations

import pytest

from meshlearn.net.rate import TokenBucket


def test_a_burst_passes_then_each_request_waits_its_turn() -> None:
    now = [0.0]
    bucket = TokenBucket(per_s=10.0, burst=3, clock=lambda: now[0])
    assert [bucket.delay() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.delay() == pytest.approx(0.1)  # one in debt: a tenth of a second
    assert bucket.delay() == pytest.approx(0.2)  # two in debt
    now[0] = 0.2  # the debt is paid
    assert bucket.delay() == pytest.approx(0.1)
    now[0] = 100.0  # a long idle refills the burst, not more
    assert [bucket.delay() for _ in range(3)] == [0.0, 0.0, 0.0] and bucket.delay() > 0


def test_a_rate_that_is_no_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="the rate must be > 0"):
        TokenBucket(per_s=0.0, burst=5)
