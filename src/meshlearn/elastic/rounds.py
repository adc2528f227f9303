"""A message-based DP strategy's rounds, run as sums over the stage's torchft quorum.

The fixed-membership drivers carry a strategy's rounds (``dp/base.py: Exchange``) as messages to
every other replica of the stage, and average the D parts. An elastic stage has no fixed peers:
its members are the step's quorum. ``QuorumExchange`` stands in for the strategy's exchange: a
round's part, with a contribution flag beside it, is summed over the quorum when the strategy
shares it, so the round is complete at once (the strategy's own ``on_complete`` runs, and may
start its next round the same way), and its mean divides by the contributors. A spectator (its
row does not train the step) adds zeros and a flag of 0, so the mean is over the replicas that
trained. The strategy code — its phases, arithmetic and state — is the one the fixed drivers run.

With a robust rule (``dp.robust``, under ``elastic.membership = "control"`` only: its sums are
all-gathers over framed streams, so every member holds every contribution) ``share`` gathers the
parts instead, and every member reduces the contributors' parts with the rule
(``reduce_contributions``), in replica order: the same bits on every member.

If a participant fails during a round, torchft's ``should_commit`` says no for the step and the
step commits nowhere (``CommitVote``); the caller then rolls the strategy's state back
(``elastic/rollback.py``), and the next step, over the new quorum, runs the same update's rounds
again: a replica that died mid-round is left out of that round's reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlearn.dp.base import Exchange, Key
from meshlearn.dp.robust import Robust
from meshlearn.mesh.messages import Message

MAJORITY = 3
"""Contributors a robust round needs before it scores anyone: with two there is no majority (both
are equally far from their aggregate, docs/dp_robust.md), so nothing is attributed below three."""


def reduce_contributions(parts: list[torch.Tensor], flags: list[bool], rule: Robust
                         ) -> tuple[torch.Tensor, list[float] | None]:
    """``rule``'s aggregate of the contributing ``parts`` (replica order; ``flags``: which
    contributed, a spectator's zeros are no contribution) and their outlier scores, in the same
    order (None below ``MAJORITY`` contributors). No contributor: zeros (as the sum's mean)."""
    rows = [p for p, f in zip(parts, flags, strict=True) if f]
    if not rows:
        return torch.zeros_like(parts[0]), None
    aggregate, scores = rule.reduce_scored(torch.stack(rows))
    return aggregate, scores if len(rows) >= MAJORITY else None


class QuorumExchange(Exchange):
    """``share`` sums (part, flag) over the quorum through ``reduce`` (in place); ``mean`` is the
    sum over the contributors. With a robust ``rule`` it gathers them through ``gather`` instead
    and ``mean`` is the rule's aggregate of the contributors' parts (less ``left_out``); ``scored`` gets the
    contributors' outlier scores (replica order) of each round. No message ever travels: ``share``
    returns none."""

    def __init__(self, me, replicas: int, reduce: Callable[[torch.Tensor], None],
                 gather: Callable[[torch.Tensor], list[torch.Tensor] | None] | None = None,
                 rule: Robust | None = None,
                 scored: Callable[[list[bool], list[float] | None], None] | None = None):
        super().__init__(me, replicas, rule)
        self.reduce, self.gather, self.on_scores = reduce, gather, scored
        self.contributes = True  # set by the driver per step: False while spectating
        # with a rule, set by the driver per step: the members (gather order) whose part no round
        # reduces, their counts contradicting the row agreement (``elastic/counts.py``)
        self.left_out: frozenset[int] = frozenset()
        self.means: dict[Key, torch.Tensor] = {}

    def share(self, key: Key, values: torch.Tensor, version: int) -> list[Message]:
        values = values.detach().reshape(-1)
        part = values if self.contributes else torch.zeros_like(values)
        flat = torch.cat([part, values.new_tensor([1.0 if self.contributes else 0.0])])
        if self.robust.gathers:
            self.means[key] = self._robust_mean(flat)
            return []
        self.reduce(flat)
        self.means[key] = flat[:-1] / max(flat[-1].item(), 1.0)
        return []

    def _robust_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The rule's aggregate of the contributors' parts (garbage, here the own part, if a member
        failed: the step then commits nowhere)."""
        parts = self.gather(flat)
        if parts is None:
            return flat[:-1]
        flags = [float(p[-1]) != 0.0 and i not in self.left_out for i, p in enumerate(parts)]
        aggregate, scores = reduce_contributions([p[:-1] for p in parts], flags, self.robust)
        if self.on_scores is not None:
            self.on_scores(flags, scores)
        return aggregate.to(flat.device, flat.dtype)

    def receive(self, message: Message) -> Key | None:
        raise RuntimeError(f"worker {self.me}: a dp message from {message.src} in an elastic run, "
                           "whose rounds are sums over the quorum")

    def complete(self, key: Key) -> bool:
        return key in self.means

    def mean(self, key: Key) -> torch.Tensor | None:
        return self.means.pop(key)

    def expire(self, key: Key) -> None:
        self.means.pop(key, None)
        self.dropped.add(key)
