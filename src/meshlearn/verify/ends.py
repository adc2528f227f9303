"""Blame for the last stage's gradients, where the first and last stages are verified like any.

The last stage is the first sender of a microbatch's backward chain and has no pair distance (its
gradient is computed from the loss, not from a received gradient), so a flagged last-stage gradient
is explained upstream only when one of the activations it was computed on was suspect. One
corruption escapes that rule: the first stage can corrupt its data in a way no activation
statistic sees — a permutation of the microbatch's sequences keeps every per-position mean,
quantile and norm — and the honest last stage then computes honest gradients of a loss on inputs
that no longer match their labels. Nothing in a message tells that apart from a last stage that
lies (issue 31: the stage-0 permutation was blamed on an honest last-stage worker).

What the messages can show is the gradient's size. The cross-entropy gradient with respect to the
logits is softmax − one-hot; for a prediction that does not match its label it is larger. So a
last-stage sender whose gradients, in one step and boundary, are **larger** than its peers' (median
norm ≥ ``verify.ends_norm_ratio`` × the median of the other senders' norms) has its flags there
attributed to the data of its row (``explained_by = "r{R}s0 data"``): quarantined, no strike for
either end — the same evidence from a lying last stage that inflates its gradients must not ban
an honest first stage. A flagged last-stage gradient of ordinary size (flipped, zeroed, rotated,
noised at the same scale) is the last stage's own: an activation mismatch upstream does not
produce it. Repeated data-explained steps raise an ``ends`` alert for the row.
"""

from __future__ import annotations

import statistics
from collections import deque

from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.ledger import Alert, Ledger, Scored


def data_blame(wid: WorkerId) -> str:
    """The ``explained_by`` of a last-stage flag that its row's data explains."""
    return f"{WorkerId(wid.replica, 0)} data"


def data_explained(scored: list[Scored], stages: int, ratio: float) -> set[WorkerId]:
    """Mark the flagged last-stage gradients of senders whose gradients this step are larger than
    their peers' (module docstring) as explained by their row's data; those senders."""
    last = stages - 1
    norms: dict[WorkerId, list[float]] = {}
    for e in scored:
        if e.src.stage == last and e.kind == "grad" and not e.provisional and e.decision.norm > 0:
            norms.setdefault(e.src, []).append(e.decision.norm)
    larger: set[WorkerId] = set()
    for src, mine in norms.items():
        peers = [n for w, values in norms.items() if w != src for n in values]
        if peers and statistics.median(mine) >= ratio * statistics.median(peers):
            larger.add(src)
    for e in scored:
        if (e.src in larger and e.kind == "grad" and e.flagged and not e.own_fault
                and not e.decision.explained_by):
            e.decision.explained_by = data_blame(e.src)
    return larger


class EndsWatch:
    """Counts, per last-stage worker, the steps whose flags its row's data explained, and raises one
    ``ends`` alert at ``verify.strikes`` of them within ``verify.strike_history``: evidence that the
    row's first stage corrupts its data, or that its last stage inflates its gradients."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.history: dict[WorkerId, deque[int]] = {}

    def enter(self, step: int, scored: list[Scored], larger: set[WorkerId]) -> list[Alert]:
        cfg = self.ledger.cfg
        flagged = {e.src for e in scored
                   if e.src in larger and e.decision.explained_by == data_blame(e.src)}
        last = self.ledger.mesh.stages - 1
        senders = {e.src for e in scored if e.src.stage == last and e.kind == "grad"}
        alerts = []
        for src in sorted(senders):
            history = self.history.setdefault(src, deque(maxlen=cfg.strike_history))
            history.append(int(src in flagged))
            if src in flagged and sum(history) >= cfg.strikes and step >= cfg.warmup_steps:
                alert = self.ledger.alert(src, step, "ends", sum(history), (
                    f"{src}'s gradients were flagged and larger than its peers' in {sum(history)} of "
                    f"its last {len(history)} steps, with every activation they were computed on "
                    f"accepted: either {WorkerId(src.replica, 0)} corrupts its data in a way the "
                    f"activation statistics cannot see (e.g. permuted sequences) or {src} inflates its "
                    "gradients; the messages cannot tell which, so neither is banned and the flagged "
                    "gradients are quarantined"))
                alerts += [alert] if alert is not None else []
        return alerts

    def readmit(self, wid: WorkerId) -> None:
        self.history.pop(wid, None)

    def state_dict(self) -> dict:
        return {str(w): list(h) for w, h in sorted(self.history.items())}

    def load_state_dict(self, state: dict) -> None:
        self.history = {WorkerId.parse(w): deque(h, maxlen=self.ledger.cfg.strike_history)
                        for w, h in state.items()}
