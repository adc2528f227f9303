"""The ``refused`` block of a cluster run's summary.json (cluster/security.py): every host's counts
by reason (and by sender); a record another host sent that is not counts is left out and named,
never a traceback at the run's end (a list or a string where counts belong crashed the
coordinator after training, and summary.json never got its block)."""

from __future__ import annotations

from meshlearn.cluster.security import refused_block


def test_the_block_sums_every_hosts_counts_by_reason():
    block = refused_block({"bob": {"refused": {"handshake_failed": 2}},
                           "alice": {"refused": {"handshake_failed": 1, "unknown_destination": 3}}})
    assert block == {"total": 6, "by_reason": {"handshake_failed": 3, "unknown_destination": 3},
                     "by_sender": {},
                     "by_host": {"alice": {"handshake_failed": 1, "unknown_destination": 3},
                                 "bob": {"handshake_failed": 2}}}


def test_a_record_that_is_not_counts_is_left_out_and_named():
    honest = {"refused": {"preamble_malformed": 4}}
    for bad in ([1], "x", {"refused": {"x": "y"}}, {"refused": [1]}, {"refused": {"x": -1}},
                {"refused": {"x": True}}, {"refused": {str(i): 1 for i in range(65)}},
                {"refused": {}, "by_sender": {"alice": "many"}}, {"refused": {}, "by_sender": [1]}):
        block = refused_block({"alice": honest, "mallory": bad})
        assert block == {"total": 4, "by_reason": {"preamble_malformed": 4}, "by_sender": {},
                         "by_host": {"alice": {"preamble_malformed": 4}}, "unreadable": ["mallory"]}, bad
