"""A DP strategy from outside meshlearn: "average every other step" (tests/dp/test_plugin_strategy.py).

It stands for a third party's package: it imports only meshlearn's public strategy interface
(``meshlearn.dp.base``), and a test declares ``build`` under the entry point group
``meshlearn.dp_strategies`` as the name ``every_other``. After every second update of a stage
(u = 1, 3, ...) its replicas average their whole weights, waiting for the round; in between each
replica steps on its own gradients. So it equals ``dp.name = sparse`` with ``dp.fraction = 1,
dp.every = 2, dp.delay = 0, dp.rule = avg``, which is the test's oracle.
"""

from __future__ import annotations

import torch

from meshlearn.dp.base import DPStrategy, Key
from meshlearn.mesh.messages import Message


class EveryOther(DPStrategy):
    name = "every_other"
    drifts = True  # the replicas differ between two averages

    def __init__(self, me, replicas: int, module: torch.nn.Module):
        super().__init__(me, replicas)
        self.params = list(module.parameters())
        self.averages: dict[int, torch.Tensor] = {}  # by the update whose round they complete

    def averages_at(self, u: int) -> bool:
        return self.replicas > 1 and u % 2 == 1

    def post_step(self, u: int) -> list[Message]:
        if not self.averages_at(u):
            return []
        self.rounds += 1
        weights = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        return self.share((u, 0), weights, u + 1)

    def on_complete(self, key: Key) -> list[Message]:
        mean = self.exchange.mean(key)  # None: a peer's part was misshapen and the round dropped
        if mean is not None:
            self.averages[key[0]] = mean
        return []

    def post_wait(self, u: int) -> Key | None:
        key = (u, 0)
        if self.averages_at(u) and u not in self.averages and key not in self.exchange.dropped:
            return key
        return None

    @torch.no_grad()
    def apply(self, u: int) -> None:
        mean = self.averages.pop(u, None)
        if mean is None:
            return
        self.note_score(u, (u, 0))
        offset = 0
        for p in self.params:
            p.copy_(mean[offset:offset + p.numel()].reshape(p.shape).to(p.dtype))
            offset += p.numel()

    def expects(self, u: int) -> int:
        return 1 if self.averages_at(u) else 0

    def post_rounds(self, u: int) -> bool:
        return self.averages_at(u)

    def state_dict(self) -> dict:
        return super().state_dict() | {"averages": dict(self.averages)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.averages = dict(state["averages"])


def build(dp, worker, profile) -> EveryOther:
    """The entry point: (DPConfig, the worker, its DP links' LinkProfile) → the strategy."""
    return EveryOther(worker.id, worker.mesh.replicas, worker.module)
