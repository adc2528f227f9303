"""Given on PYTHONPATH to a test's ``meshlearn train`` (``test_speculative_vote.py``), this is loaded
by every Python process of the run; in the worker ``VOTE_FAULT`` names (``r1s1:3:after``) the peer
vote's first round of that step (0-based) fails as a lost stream would: ``after`` its verdict went
out and every other came in (the others complete the round), ``before`` it sent anything."""

import os

FAULT = os.environ.get("VOTE_FAULT")
if FAULT:
    from meshlearn.distributed.collectives import Lost
    from meshlearn.elastic.peer_vote import PeerVote

    WORKER, STEP, WHEN = FAULT.split(":")
    REAL = PeerVote._verdicts

    def _verdicts(self, framed, step, ok, steady):
        if str(self.me) != WORKER or step != int(STEP):
            return REAL(self, framed, step, ok, steady)
        if WHEN == "after":
            REAL(self, framed, step, ok, steady)
        raise Lost(0, "while receiving (injected by the test)")

    PeerVote._verdicts = _verdicts
