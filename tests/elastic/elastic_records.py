"""Checks on an elastic run's train records shared by its process tests."""

from __future__ import annotations


def assert_no_vote_rows_requests_unless_changed(rows: list[dict]) -> None:
    """Under ``"control"`` the commit vote runs over the members' streams and the rows agreed at
    one step are reused by the next unless it failed or its membership changed
    (``elastic/peer_vote.py``): a committed step after a committed one with an unchanged quorum
    asks the store nothing for either; the first step and each after a failed one agree on it."""
    assert rows[0]["vote_rows_requests"] > 0
    steady = [r for prev, r in zip(rows, rows[1:], strict=False) if prev["committed"] and r["committed"]
              and r["quorum_requests"] == 0 and prev["participants"] == r["participants"]]
    assert steady and all(r["vote_rows_requests"] == 0 for r in steady), rows
    assert all(r["vote_rows_requests"] > 0 for prev, r in zip(rows, rows[1:], strict=False)
               if not prev["committed"]), rows
