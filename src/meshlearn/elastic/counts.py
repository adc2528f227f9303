"""A robust stage's counts: what each member sent beside its contribution, checked against the
row agreement (``dp.robust`` under ``elastic.membership = "control"``, where every member holds
every member's part).

Why: beside its gradients each member sends four counts (loss sum, loss count, contributing flag,
sequences trained). Summed as sent, one member with honest gradients and a sequence count off by
one (or NaN) would make its stage say no at every step (``rows.whole_batch``), unreported (its
gradients score as normal), and its loss sum would move the train loss every last stage shows.

Every member of the stage reads the same agreement (``Agreed.rows``), so what each member's
counts must be is known to all: a member whose row trains the step contributes (flag 1) its
row's share of the global batch, B / k sequences for k agreed rows, with one loss per microbatch
on a last stage and none elsewhere; every other member sends no contribution (flag 0, 0
sequences). A member of an agreed row that sends no contribution *withdrew* (its row broke during
the step, ``ElasticDriver.lost_partner``): honest, and the step may not commit (its row's share is
missing), as before. Any other value (a count off by one, NaN, a spectator claiming a share) is a
lie: the member is left out of the step's reduce and scored ∞, so the attribution ledger reports
it (``dp/attribution.py``). The stage's verdict is the agreement's: every agreed row's member of
the stage is present and did not withdraw, and somebody's contribution is reduced. The train loss
shown is the median of the contributors' mean losses, which one liar's loss sum cannot move past
an honest member's (from three contributors on).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from meshlearn.elastic.rows import Row
from meshlearn.mesh.topology import WorkerId

COUNTS = 4
"""The counts after a member's contribution: loss sum, loss count, contributing flag, sequences."""


@dataclass(frozen=True)
class CheckedCounts:
    """A stage's counts of one step, the same on every member. ``contributes``: per member (the
    gather's order), whether its part is reduced; ``liars``: the members whose counts the
    agreement contradicts; ``whole``: the agreement's verdict (the stage may say yes); ``loss``:
    the median of the contributors' mean losses (None: no contributor has a loss)."""

    contributes: list[bool]
    liars: list[WorkerId]
    whole: bool
    loss: float | None


def check_counts(sent: Sequence[Sequence[float]], members: Sequence[WorkerId], rows: tuple[Row, ...],
                 batch_size: int, microbatches: int, last_stage: bool) -> CheckedCounts:
    """Each member's ``sent`` counts (``COUNTS`` values, in ``members``' order) against the rows
    agreed for the step."""
    share = batch_size / len(rows) if rows else 0.0
    losses = microbatches if last_stage else 0
    contributes, liars, withdrew, means = [], [], False, []
    for wid, counts in zip(members, sent, strict=True):
        loss_sum, loss_count, flag, sequences = (float(c) for c in counts)
        trains = any(row[wid.stage] == wid.replica for row in rows)
        honest = (trains and flag == 1.0 and sequences == share and loss_count == losses
                  and (last_stage or loss_sum == 0.0))
        quiet = flag == 0.0 and sequences == 0.0  # no contribution (a spectator, or withdrawn)
        contributes.append(honest)
        if honest and losses:
            means.append(loss_sum / loss_count)
        if quiet:
            withdrew = withdrew or trains
        elif not honest:
            liars.append(wid)
    present = {w.replica for w in members}
    stage = members[0].stage if members else 0
    whole = (bool(rows) and all(row[stage] in present for row in rows) and not withdrew
             and any(contributes))
    return CheckedCounts(contributes, liars, whole, median_loss(means))


def median_loss(means: list[float]) -> float | None:
    """The median of the contributors' mean losses, NaN ones left out (NaN if all are)."""
    if not means:
        return None
    finite = [m for m in means if not math.isnan(m)]
    return statistics.median(finite) if finite else math.nan
