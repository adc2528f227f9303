"""The anchor circuit in the planner's cost-only runs (``anchor.z > 0``).

``CostAnchorCallback`` is the trainer's ``AnchorCallback`` — the same hand-offs every K steps,
the same relay of fast (0, s)'s DP rounds (``relay_bytes``), the same delivery and drop rules at
each step end — over a ``CostAnchorCircuit``: the circuit's own timing and byte accounting on its
own clocks and links (under ``links.access = uplink``, fast (0, s)'s hand-off and relay on that
worker's uplink, each anchor stage's sends on its own), with passes that do no arithmetic. The
batch is handed as meta tensors of the fast circuit's microbatch shapes, the weights as the meta
stage's parameters (their sizes are the snapshot's). Nothing reaches a spectral correction (a
share has no values), so a cost-only fast worker's correction only counts what arrived.

``AnchorWindow`` is what the planner reports for an anchored row: the anchor's bytes per
training token and whether it keeps up (no share dropped: every pass arrived by its due step +
``anchor.max_late``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from meshlearn.anchor.circuit import CostAnchorCircuit
from meshlearn.anchor.plugin import AnchorCallback
from meshlearn.config import RunConfig
from meshlearn.mesh.sim import SimDriver
from meshlearn.mesh.topology import WorkerId


class CostAnchorCallback(AnchorCallback):
    """``AnchorCallback`` over cost-only workers; ``steps``: the run's length (hand-offs stop
    there, as in a run of ``train.steps``; a steady-state search runs open-ended)."""

    circuit_class = CostAnchorCircuit

    def __init__(self, cfg: RunConfig, workers: dict, driver: SimDriver, steps: int):
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
        super().__init__(cfg, workers, driver.clock, driver, data=None, fresh=False)

    def start(self) -> None:
        """Step 0's hand-off, before the first step (the trainer's plugin makes it when built):
        made here so that a run's first counters come before it."""
        self._hand_off(0)

    def _circuit_extra(self) -> dict:
        return {"d_model": self.cfg.model.d_model}

    def _batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Replica 0's microbatches of ``step`` by shape (``shard_batch``'s: B / D / M rows each)."""
        mesh, cfg = self.cfg.mesh, self.cfg
        rows = cfg.train.batch_size // mesh.replicas // mesh.microbatches
        ids = torch.empty(rows, cfg.model.seq_len, dtype=torch.long, device="meta")
        return [(ids, ids)] * mesh.microbatches

    def _weights(self, wid: WorkerId) -> dict[str, torch.Tensor]:
        """The stage's parameters, by shape: a snapshot's size (outer weights send none)."""
        return dict(self.workers[wid].module.named_parameters())


@dataclass(frozen=True)
class AnchorMarks:
    """The anchor's cumulative counters at one step's end."""

    bytes: int
    passes: int
    delivered: int
    dropped_late: int
    late_max: int  # the most steps past its due step a share was delivered at, so far

    @classmethod
    def of(cls, anchor: CostAnchorCallback) -> AnchorMarks:
        c = anchor.counters
        return cls(anchor.circuit.bytes.total, anchor.circuit.passes, c.delivered, c.dropped_late,
                   c.late_max)


@dataclass(frozen=True)
class AnchorWindow:
    """The anchor between two marks: bytes per training token, passes handed off, shares (one
    per fast worker and pass) delivered and dropped as late, and the latest delivery so far."""

    bytes_per_token: float
    passes: int
    delivered: int
    dropped_late: int
    late_max: int
    max_late: int  # anchor.max_late: the cap

    @property
    def keeps_up(self) -> bool:
        """No share dropped, and some delivered (a window with neither says nothing)."""
        return self.dropped_late == 0 and self.delivered > 0

    @classmethod
    def between(cls, a: AnchorMarks, b: AnchorMarks, tokens: int, max_late: int) -> AnchorWindow:
        return cls((b.bytes - a.bytes) / tokens, b.passes - a.passes, b.delivered - a.delivered,
                   b.dropped_late - a.dropped_late, b.late_max, max_late)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "keeps_up": self.keeps_up}


__all__ = ["AnchorMarks", "AnchorWindow", "CostAnchorCallback"]
