"""The ``refused`` block of a cluster run's summary.json (cluster/security.py): every host's counts
by reason (and by sender); a record another host sent that is not counts is left out and named,
never a traceback at the run's end (a list or a string where counts belong crashed the
coordinator after training, and summary.json never got its block). Who misbehaved (``by_sender``)
is what the coordinator's own processes observed; another host's attributions are its claims."""

from __future__ import annotations

import json

from meshlearn.cluster.security import MAX_RECORD_BYTES, collect_records, refused_block

HOSTS = ("alice", "bob", "carol", "mallory")


def test_the_block_sums_every_hosts_counts_by_reason():
    block = refused_block({"bob": {"refused": {"handshake_failed": 2}},
                           "alice": {"refused": {"handshake_failed": 1, "unknown_destination": 3}}},
                          "alice", HOSTS)
    assert block == {"total": 6, "by_reason": {"handshake_failed": 3, "unknown_destination": 3},
                     "by_sender": {}, "claims": {},
                     "by_host": {"alice": {"handshake_failed": 1, "unknown_destination": 3},
                                 "bob": {"handshake_failed": 2}}}


def test_a_record_that_is_not_counts_is_left_out_and_named():
    honest = {"refused": {"preamble_malformed": 4}}
    for bad in ([1], "x", {"refused": {"x": "y"}}, {"refused": [1]}, {"refused": {"x": -1}},
                {"refused": {"x": True}}, {"refused": {str(i): 1 for i in range(65)}},
                {"refused": {}, "by_sender": {"alice": "many"}}, {"refused": {}, "by_sender": [1]}):
        block = refused_block({"alice": honest, "mallory": bad}, "alice", HOSTS)
        assert block == {"total": 4, "by_reason": {"preamble_malformed": 4}, "by_sender": {}, "claims": {},
                         "by_host": {"alice": {"preamble_malformed": 4}}, "unreadable": ["mallory"]}, bad


def test_only_the_coordinators_own_observations_are_the_runs_finding():
    """mallory writes that the honest bob and carol misbehaved (and names nobody of the run, and
    itself): summary.json's ``by_sender`` holds only what alice's own processes saw (bob's valid
    joiner key knocking, say), mallory's word stays under its name in ``claims``, and the names
    mallory could not have met are dropped."""
    alice = {"refused": {"authority": 2, "identity_refused": 1}, "by_sender": {"mallory": 2, "joe": 1}}
    mallory = {"refused": {"hello_refused": 40}, "by_sender": {"bob": 30, "carol": 9, "ghost": 5,
                                                              "mallory": 1, "alice": 0}}
    bob = {"refused": {"contribution_refused": 1}, "by_sender": {"mallory": 1}}
    block = refused_block({"alice": alice, "mallory": mallory, "bob": bob}, "alice", HOSTS)
    assert block["by_sender"] == {"joe": 1, "mallory": 2}
    assert block["claims"] == {"bob": {"mallory": 1}, "mallory": {"bob": 30, "carol": 9}}
    assert block["total"] == 44 and block["by_host"]["mallory"] == {"hello_refused": 40}


class _Store:
    """The control service as the coordinator's launcher reads it: records by key; ``broken``:
    keys whose fetch fails (the service closing)."""

    def __init__(self, values: dict[str, bytes], broken: frozenset[str] = frozenset()):
        self.values, self.broken = values, broken

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values or k in self.broken for k in keys)

    def get(self, key: str) -> bytes:
        if key in self.broken:
            raise ConnectionError("the service is closing")
        return self.values[key]


def test_a_record_that_is_not_json_is_named_unreadable_not_dropped():
    """bob's record is not JSON, carol's is not UTF-8, dave's is beyond any record: each is named
    under ``unreadable`` (they were dropped without a word); erin left none and frank's could not be
    fetched: absent, as a host that sent nothing."""
    honest = {"refused": {"preamble_malformed": 1}, "by_sender": {}}
    store = _Store({"sec/alice": json.dumps(honest).encode(), "sec/bob": b'{"refused": {',
                    "sec/carol": b"\xff\xfe", "sec/dave": b" " * (MAX_RECORD_BYTES + 1)},
                   broken=frozenset({"sec/frank"}))
    hosts = ("alice", "bob", "carol", "dave", "erin", "frank")
    records = collect_records(store, "sec", hosts)
    assert records == {"alice": honest, "bob": None, "carol": None, "dave": None}
    block = refused_block(records, "alice", hosts)
    assert block["unreadable"] == ["bob", "carol", "dave"] and block["total"] == 1, block
