"""A message-based DP strategy's rounds, run as sums over the stage's torchft quorum.

The fixed-membership drivers carry a strategy's rounds (``dp/base.py: Exchange``) as messages to
every other replica of the stage, and average the D parts. An elastic stage has no fixed peers:
its members are the step's quorum. ``QuorumExchange`` stands in for the strategy's exchange: a
round's part, with a contribution flag beside it, is summed over the quorum when the strategy
shares it, so the round is complete at once (the strategy's own ``on_complete`` runs, and may
start its next round the same way), and its mean divides by the contributors. A spectator (its
row does not train the step) adds zeros and a flag of 0, so the mean is over the replicas that
trained. The strategy code — its phases, arithmetic and state — is the one the fixed drivers run.

If a participant fails during a round, torchft's ``should_commit`` says no for the step and the
step commits nowhere (``CommitVote``); the caller then rolls the strategy's state back
(``elastic/rollback.py``), and the next step, over the new quorum, runs the same update's rounds
again: a replica that died mid-round is left out of that round's reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlearn.dp.base import Exchange, Key
from meshlearn.mesh.messages import Message


class QuorumExchange(Exchange):
    """``share`` sums (part, flag) over the quorum through ``reduce`` (in place); ``mean`` is the
    sum over the contributors. No message ever travels: ``share`` returns none."""

    def __init__(self, me, replicas: int, reduce: Callable[[torch.Tensor], None]):
        super().__init__(me, replicas)
        self.reduce = reduce
        self.contributes = True  # set by the driver per step: False while spectating
        self.means: dict[Key, torch.Tensor] = {}

    def share(self, key: Key, values: torch.Tensor, version: int) -> list[Message]:
        values = values.detach().reshape(-1)
        part = values if self.contributes else torch.zeros_like(values)
        flat = torch.cat([part, values.new_tensor([1.0 if self.contributes else 0.0])])
        self.reduce(flat)
        self.means[key] = flat[:-1] / max(flat[-1].item(), 1.0)
        return []

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
