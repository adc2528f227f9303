"""What a worker does with the pipeline messages it refuses: count them, attribute them, bound them.

A refused pipeline message takes its slot as a quarantined stand-in (``mesh.standin``) and the run
goes on, as in the simulator. Each refusal is logged in one line (the ``wire_reject`` record) and
counted as ``message_refused`` in the process's ``Counters``, under the identity that sent it (the
stream's authenticated peer in a cluster run; nobody's on plain streams), which is how it reaches
its host's security.json and the run's summary.json (``cluster/refusals.py``).

Why a bound: a stand-in is a microbatch that moves no weight. A sender whose messages are all
refused would otherwise make its receiver train on nothing from it for the rest of the run, and
without a verifier nobody bans it. So a link whose last ``MAX_REFUSED`` messages were all refused
(the DP links' rule, ``collectives.MAX_REFUSED``) ends the run naming its sender; one accepted
message starts the count again. The simulator has no such bound: a dist run refuses what the
simulator refuses, and stops where the simulator would go on only after ``MAX_REFUSED`` refusals
in a row on one link.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Mapping

from meshlearn.compress.wire_checks import Rejection
from meshlearn.distributed.collectives import MAX_REFUSED
from meshlearn.distributed.groups import Link
from meshlearn.distributed.health import Health, WorkerFailure
from meshlearn.net.counters import Counters

REASON = "message_refused"  # the counter's name in the records


def sender_of(end: object) -> str | None:
    """The authenticated identity at the other end of a link's connection (None: unauthenticated)."""
    return getattr(getattr(end, "peer", None), "name", None)


class PipelineRefusals:
    """One worker's refusals on its incoming pipeline links. ``senders``: per link, the identity
    its refusals are attributed to; ``counters``: the process's record (``groups.Groups.counters``)."""

    def __init__(self, me: str, health: Health, counters: Counters, senders: Mapping[Link, str | None]):
        self.me = me
        self.health = health
        self.counters = counters
        self.senders = dict(senders)
        self.in_a_row: Counter[Link] = Counter()
        self.total = 0

    def refused(self, link: Link, rejection: Rejection) -> None:
        """Log and count one refusal on ``link``; the run ends once ``MAX_REFUSED`` are in a row."""
        self.total += 1
        record = rejection.record()
        print(f"meshlearn worker {self.me}: rejected {json.dumps(record)}", file=sys.stderr, flush=True)
        sender = self.senders.get(link)
        self.counters.add(REASON, f"{link[0]}->{link[1]}{f' (host {sender})' if sender else ''}, "
                                  f"{record['message']} {record['microbatch']} of step {record['step']}: "
                                  f"{record['reason']}", sender=sender)
        self.in_a_row[link] += 1
        if self.in_a_row[link] >= MAX_REFUSED:
            raise WorkerFailure(self.health.abort(
                f"worker {link[0]} sent {MAX_REFUSED} pipeline messages in a row that were refused (the "
                f"last: {rejection.reason}); a run without a verifier does not train on stand-ins for "
                f"ever (noticed by {self.me})"))

    def accepted(self, link: Link) -> None:
        self.in_a_row[link] = 0
