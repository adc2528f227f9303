"""Reference capture at a budget of 0 bans, and the fallback when SENTINEL cannot tell who lies.

Flagged messages never update a boundary's reference (flags are inert, ``boundary.py``). With
three or more senders the reference is a median, so a minority cannot steer it. With two (the
demo's 2 replicas, where the ban budget is 0: there is no honest majority) it is their mean, and
once the honest sender is flagged for a step the reference follows the other one alone. A slow
drift then *becomes* the reference: measured (issue 31) a bias ramped from 0 to 2σ over 100 steps
at r1s2 got the honest r0s2 flagged on every message from step 78 to the end, 1,580 honest
messages quarantined against 345 malicious, val loss 3.85 against 3.27 without verification.

What can tell the two cases apart is where both senders last agreed. Each boundary keeps an
*anchor*: its reference after the last step in which every replica's sender was scored there and
none was flagged. A step is a **split** there when exactly two senders were scored, one flagged
by the reference's distances on a strict majority of its messages (never by a pair distance: the
sender's output against its own input concerns that sender alone, whatever the reference) and
the other not flagged at all. The split is **decided** when the flagged sender sits farther from
the anchor than the accepted one and the accepted one is still within a fence width of it: a
corruption, quarantined as before. Otherwise it is **undecided**: the reference may be following
the accepted sender alone, and with two senders nothing says which of them lies. Then the
reference restarts from both senders' messages of the step, the flagged sender's strikes there
are void, an alert says so, and the boundary *passes* fence flags on (still scored and counted,
delivered unchanged). Passing traffic is what no verification does, so an undecided boundary
costs at most that. Sanity failures (shape, non-finite, norm) concern one sender and are never
passed.

**How long it passes.** As long as the disagreement lasts (``still_split``): the passing ends at
the end of a step in which the sender the undecided split flagged sent messages there and a strict
majority of them was accepted (the two agree again), or when a split is decided. A step in which
that sender sent nothing there (its microbatches dropped upstream) says nothing and changes
nothing. Without an end, an attacker that caused one undecided split could then corrupt one
microbatch in four (flagged, never a majority, so never a split) and have every one delivered.
The rules tried instead and why they were rejected are in docs/sentinel.md ("Two replicas, slow
drift, non-identical data").
"""

from __future__ import annotations

import statistics
from itertools import permutations

from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.boundary import SANITY, BoundaryVerifier
from meshlearn.verify.distances import PAIR_DISTANCES
from meshlearn.verify.ledger import Scored

Key = tuple[int, str]


def fence_flag(e: Scored) -> bool:
    """Flagged by a fence (not a sanity failure, a ban, a warm-up suspension)."""
    return e.flagged and e.reason not in (*SANITY, "banned", "suspended")


def pair_flag(e: Scored) -> bool:
    """Flagged by a pair distance among others: the sender's own evidence."""
    return fence_flag(e) and any(m in PAIR_DISTANCES for m in e.reason.split(","))


def splits(scored: list[Scored]) -> dict[Key, tuple[WorkerId, WorkerId]]:
    """Boundaries with exactly two senders this step, one flagged by the reference's distances on a
    strict majority of its messages (and never by a pair distance), the other not flagged at all:
    (flagged sender, accepted sender)."""
    tallies: dict[Key, dict[WorkerId, list[int]]] = {}  # [messages, reference flags, flags, pair flags]
    for e in scored:
        if e.provisional:
            continue
        t = tallies.setdefault(e.verifier, {}).setdefault(e.src, [0, 0, 0, 0])
        pair = pair_flag(e)
        t[0] += 1
        t[1] += fence_flag(e) and not pair
        t[2] += e.flagged
        t[3] += pair
    out = {}
    for key, by_sender in tallies.items():
        if len(by_sender) != 2:
            continue
        for (bad, tb), (good, tg) in permutations(sorted(by_sender.items())):
            if 2 * tb[1] > tb[0] and tb[3] == 0 and tg[2] == 0:
                out[key] = (bad, good)
    return out


def undecided(verifier: BoundaryVerifier, step: int, flagged: WorkerId, accepted: WorkerId) -> bool:
    """Whether nothing says which one lies: the flagged sender's messages of ``step`` are no farther
    from the anchor than the accepted sender's (median over each one's messages), or the accepted
    sender itself left the consensus (more than a fence width from the anchor: the reference has
    been following it alone; measured on the ramp, the honest sender sat farther from the anchor
    than the attacker from the first split on, because the attacker's gradients had moved the
    shared weights, while the attacker's own distance grew past 1 within 23 steps)."""
    if verifier.anchor is None:
        return False
    by_replica = verifier.step_summaries(step)
    bad, good = by_replica.get(flagged.replica, []), by_replica.get(accepted.replica, [])
    if not bad or not good:
        return False
    far = statistics.median(verifier.anchor_score(s) for s in bad)
    near = statistics.median(verifier.anchor_score(s) for s in good)
    return far <= near or near > 1


def still_split(scored: list[Scored], key: Key, replica: int) -> bool:
    """Whether the passing of boundary ``key`` for ``replica`` (the sender its undecided split
    flagged) goes on after this step: that sender's messages there were mostly flagged again (the
    disagreement lasts, whatever flagged them), or it sent none there (no evidence either way).
    False ends the passing: a strict majority of its messages was accepted."""
    own = [e for e in scored if e.verifier == key and e.src.replica == replica]
    return not own or 2 * sum(e.flagged for e in own) > len(own)
