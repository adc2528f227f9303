"""This worker's part in its stage's data-parallel reduce over the quorum, one update at a time.

The elastic driver's update walks the update protocol (``mesh/update_run.py``); what its
``ReduceGradients`` and a strategy's rounds execute is here: the gradients (or a strategy's
round) summed over the stage's quorum and held to the ring model's time, or — under a robust rule
— every member's contribution gathered, each member's step counts checked against the agreed rows
(``elastic/counts.py``: a member that lies about them is left out and scored ∞), and the rule's
aggregate of the contributors' parts applied alike on every member (``elastic/rounds.py``). It
says whether the stage's batch was whole (``QuorumStep.mean_ok``, read by the vote) and keeps the
update's outlier scores of the stage (attribution, ``dp/attribution.py``).
"""

from __future__ import annotations

import math

import torch

from meshlearn.distributed.dp_axis import DPAxis
from meshlearn.dp.robust import Robust
from meshlearn.elastic.counts import COUNTS, CheckedCounts, check_counts
from meshlearn.elastic.quorum import QuorumStep, StageQuorum
from meshlearn.elastic.rounds import QuorumExchange, reduce_contributions
from meshlearn.elastic.rows import Row, whole_batch
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import Worker


class StageReduce:
    """``worker``'s reduces over ``quorum`` (``dp_axis`` charges their time and bytes). ``begin``
    hands it each update's quorum step, agreed rows, step and whether this worker trains."""

    def __init__(self, worker: Worker, quorum: StageQuorum, dp_axis: DPAxis, me: WorkerId, last_stage: bool,
                 batch_size: int, microbatches: int):
        self.worker, self.quorum, self.dp_axis, self.me = worker, quorum, dp_axis, me
        self.last_stage, self.batch_size, self.microbatches = last_stage, batch_size, microbatches
        self.current: QuorumStep | None = None
        self.rows: tuple[Row, ...] = ()
        self.step = 0
        self.trains = False
        self.scores: dict[str, float] = {}  # the stage's outlier scores in the update

    def begin(self, current: QuorumStep, rows: tuple[Row, ...], step: int, trains: bool) -> None:
        self.current, self.rows, self.step, self.trains = current, rows, step, trains
        self.scores = {}

    def exchange(self, members: int, robust: Robust) -> QuorumExchange:
        """A message-based strategy's rounds as reduces over the quorum (with ``robust``: gathered,
        and reduced alike by every member)."""
        return QuorumExchange(self.me, members, self.reduce_round, self.gather_round, robust,
                              self.note_scores)

    def strategy_counts(self, counts: list[float], exchange: QuorumExchange) -> float | None:
        """A strategy's step: the counts summed — or, under a robust rule, gathered and checked
        before its rounds, which then leave a liar out (``QuorumExchange.left_out``). Returns the
        stage's train loss."""
        if not exchange.robust.gathers:
            summed = torch.tensor(counts, dtype=torch.float64)
            self.reduce_round(summed)
            return self.summed_counts(summed.tolist(), True)
        parts = self.gather_round(torch.tensor(counts, dtype=torch.float64))
        if parts is None:  # a member's counts did not arrive: the step commits nowhere
            self.current.mean_ok = False
            exchange.left_out = frozenset()
            return None
        checked = self.checked(parts)
        exchange.left_out = frozenset(i for i, c in enumerate(checked.contributes) if not c)
        return checked.loss

    def summed_counts(self, counts: list[float], ok: bool) -> float | None:
        """The stage's verdict on the counts summed over the quorum (``whole_batch``; ``ok``:
        whether the sum itself went through) into ``mean_ok``; returns the mean loss."""
        self.current.mean_ok = ok and whole_batch(counts[2], counts[3], self.rows, self.batch_size)
        loss_sum, loss_count = counts[:2]
        return loss_sum / loss_count if loss_count > 0 else None

    def gradients(self, counts: list[float]) -> float | None:
        """The gradients' sum over the quorum with the step's counts beside them; the mean divides
        by the contributing replicas. Returns the mean loss of the summed counts."""
        flat = self.contribution(counts)
        summed = self.reduce_round(flat)
        counts = flat[-COUNTS:].tolist()
        loss = self.summed_counts(counts, summed)
        offset = 0
        for g in self.worker.grads():
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            g.div_(max(counts[2], 1.0))
            offset += g.numel()
        return loss

    def robustly(self, counts: list[float], rule: Robust) -> float | None:
        """``dp.robust``: every member's gradients with the step's counts beside them, gathered
        over the quorum; the rule's aggregate of the contributors' gradients replaces this
        worker's, a member whose counts the agreement contradicts left out (``checked``).
        Returns the stage's train loss."""
        parts = self.gather_round(self.contribution(counts))
        if parts is None:  # a member's contribution did not arrive: the step commits nowhere
            self.current.mean_ok = False
            return None
        checked = self.checked([p[-COUNTS:] for p in parts])
        aggregate, scores = reduce_contributions([p[:-COUNTS] for p in parts], checked.contributes, rule)
        self.note_scores(checked.contributes, scores)
        self.worker.set_flat_gradients(aggregate)
        return checked.loss

    def checked(self, sent: list[torch.Tensor]) -> CheckedCounts:
        """The members' gathered counts against the agreed rows (``check_counts``): the stage's
        verdict into ``mean_ok``, each liar scored ∞ (reported as a DP outlier once marked in
        enough steps, ``dp/attribution.py``)."""
        checked = check_counts([c.tolist() for c in sent], self.quorum.member_workers(), self.rows,
                               self.batch_size, self.microbatches, self.last_stage)
        self.current.mean_ok = checked.whole
        for wid in checked.liars:
            self.scores[str(wid)] = math.inf
        return checked

    def contribution(self, counts: list[float]) -> torch.Tensor:
        """What this worker adds to its stage's reduce: its flattened gradients as they leave it
        (``flat_gradients``, the seam of ``attack.target = dp``; a spectator's zeros as they
        are), then the step's four counts."""
        worker = self.worker
        grads = worker.flat_gradients() if self.trains else torch.cat([g.reshape(-1) for g in worker.grads()])
        return torch.cat([grads, grads.new_tensor(counts)])

    def gather_round(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """Every member's ``flat`` (a robust rule's round), in replica order (None if a member
        failed: the step then commits nowhere), held for the all-gather's time on the link model
        as the fixed driver holds its robust reduce: this worker's N bytes to each other member."""
        parts = self.quorum.gather(flat)
        nbytes = flat.numel() * flat.element_size()
        self.dp_axis.hold_gather(nbytes, self.quorum.member_workers(), self.step)
        return parts

    def note_scores(self, flags: list[bool], scores: list[float] | None) -> None:
        """A robust round's outlier scores of its contributors (in replica order, as ``flags``),
        the same on every member of the stage: each worker's largest of the update is its score
        of the step (attribution, ``dp/attribution.py``)."""
        if scores is None:
            return
        contributors = [w for w, f in zip(self.quorum.member_workers(), flags, strict=True) if f]
        for wid, score in zip(contributors, scores, strict=True):
            name = str(wid)
            self.scores[name] = max(self.scores.get(name, score), score)

    def reduce_round(self, flat: torch.Tensor) -> bool:
        """``flat`` ← its sum over the quorum (garbage if a participant failed: the step then
        commits nowhere; False then), held for the ring model's time as the fixed driver holds it."""
        summed = self.quorum.sum(flat)
        nbytes = flat.numel() * flat.element_size()
        self.dp_axis.hold_ring(nbytes, self.current.participants, self.step)
        return summed
