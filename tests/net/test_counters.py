"""What a run keeps of its refusals' details (``net/counters.py``): the newest few of each reason,
so one participant flooding one kind of refusal cannot push out the record of another's lies, in
a listener's counters or in a host's record that merges several."""

from __future__ import annotations

from meshlearn.net.counters import MAX_REASONS, RECENT, Counters, newest_per_reason

FLOOD = 1000


def test_a_flood_of_one_reason_keeps_the_others_details() -> None:
    counters = Counters()
    counters.add("authority", "host bob: may not set 'done/0'", sender="bob")
    for n in range(FLOOD):
        counters.add("rate_limited", f"host mallory: request {n}", sender="mallory")
    counters.add("hello_refused", "bob (host) claims r1s1, which alice runs", sender="bob")
    recent = counters.recent()
    assert recent[0] == "authority: host bob: may not set 'done/0'", recent[:2]
    assert recent[-1] == "hello_refused: bob (host) claims r1s1, which alice runs"
    assert recent[1:-1] == [f"rate_limited: host mallory: request {n}" for n in range(FLOOD - RECENT, FLOOD)]
    assert counters.as_dict() == {"authority": 1, "hello_refused": 1, "rate_limited": FLOOD}


def test_a_records_merged_details_are_bounded_per_reason() -> None:
    """What a host's security.json keeps of its port's and its processes' details (``hostport``)."""
    lines = ["contribution_refused: rank 2 (host bob), sum: a frame of 99 bytes"]
    lines += [f"rate_limited: host mallory: request {n}" for n in range(FLOOD)] + ["preamble_malformed"]
    kept = newest_per_reason(lines)
    assert kept == [lines[0], *lines[-RECENT - 1:]]
    many = [f"reason{n}: x" for n in range(2 * MAX_REASONS)]
    assert newest_per_reason(many) == many[-MAX_REASONS:]  # reasons too are bounded
    assert len(Counters().recent()) == 0
