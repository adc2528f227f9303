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

Data explain a gradient's size, not a constant added to it. Each token's gradient is
softmax − one-hot of its own prediction, back-propagated: the tokens' gradients point different
ways, and their mean over the message's tokens carries a small share of their energy
(``mean_share``: ‖mean‖² over the mean ‖token‖², about 1/N for N independent tokens, 1 for a
constant). Mismatched labels make each token's gradient larger and move that share little; a
last stage that adds a constant c to every token's gradient g makes it larger too, but
‖g + c‖² ≈ ‖g‖² + N‖c‖², so gradients r times larger through a constant alone carry a share of at
least 1 − 1/r² (0.31 at the ratio 1.2). So a larger sender whose median share exceeds its peers'
median by ``verify.ends_mean_share`` (0.15) or more is not explained: its flags are its own and it
is banned like any (issue 31: before this, bias at r1s3 only raised an ``ends`` alert). Measured
excess of the honest last stage behind a permuting first stage: ≤ 0.04 on the demo and ≤ 0.05 on
the tiny test mesh; of a last stage adding a 1σ bias: 0.45 and 0.36. What is left to the alert is
a last stage that only multiplies its gradients by a constant: a larger gradient of honest shape,
which the messages cannot tell from a data mismatch.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.ledger import Alert, Ledger, Scored


def data_blame(wid: WorkerId) -> str:
    """The ``explained_by`` of a last-stage flag that its row's data explains."""
    return f"{WorkerId(wid.replica, 0)} data"


def mean_share(values: torch.Tensor) -> float:
    """The share of a message's energy in its mean over tokens: ‖mean‖² / mean ‖token‖² over the
    (sequences × positions) token vectors; 0 for an all-zero message."""
    tokens = values.detach().float().reshape(-1, values.shape[-1])
    energy = tokens.pow(2).sum(1).mean().item()
    return tokens.mean(0).pow(2).sum().item() / energy if energy > 0 else 0.0


def _peers_median(values: dict[WorkerId, list[float]], src: WorkerId) -> float | None:
    """The median of every other sender's values (None without any)."""
    peers = [v for w, mine in values.items() if w != src for v in mine]
    return statistics.median(peers) if peers else None


def data_explained(scored: list[Scored], stages: int, ratio: float,
                   mean_excess: float = float("inf")) -> set[WorkerId]:
    """Mark the flagged last-stage gradients of senders whose gradients this step are larger than
    their peers' (median norm ≥ ``ratio`` × theirs) without a share of their mean above their
    peers' by ``mean_excess`` (module docstring) as explained by their row's data; those senders."""
    last = stages - 1
    norms: dict[WorkerId, list[float]] = {}
    shares: dict[WorkerId, list[float]] = {}
    for e in scored:
        if e.src.stage == last and e.kind == "grad" and not e.provisional and e.decision.norm > 0:
            norms.setdefault(e.src, []).append(e.decision.norm)
            if e.mean_share is not None:
                shares.setdefault(e.src, []).append(e.mean_share)
    larger = set()
    for src, mine in norms.items():
        peers, share = _peers_median(norms, src), _peers_median(shares, src)
        if peers is None or statistics.median(mine) < ratio * peers:
            continue
        if src in shares and share is not None and statistics.median(shares[src]) - share >= mean_excess:
            continue  # a constant added to every token's gradient: no data does that
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
