"""Mesh shape arithmetic: worker ids, neighbours, and checks that need no processes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

_WORKER_RE = re.compile(r"^r(\d+)s(\d+)$")


class WorkerId(NamedTuple):
    """Worker (r, s): stage ``s`` of data-parallel replica ``r``. Printed as ``r{r}s{s}``.

    A named tuple (immutable, ordered by replica then stage): the simulator looks worker ids up
    in dicts and sets at every event, and a tuple's hash and equality run in C (a dataclass's
    were about a tenth of the planner's time)."""

    replica: int
    stage: int

    def __str__(self) -> str:
        return f"r{self.replica}s{self.stage}"

    @classmethod
    def parse(cls, text: str) -> WorkerId:
        match = _WORKER_RE.match(text.strip())
        if not match:
            raise ValueError(f"worker id {text!r} is not of the form r<replica>s<stage>, e.g. r1s2")
        return cls(int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True)
class MeshShape:
    """D replicas × P stages. Rank order (used by the distributed driver) is replica-major."""

    replicas: int
    stages: int

    @property
    def world_size(self) -> int:
        return self.replicas * self.stages

    def workers(self) -> list[WorkerId]:
        return [WorkerId(r, s) for r in range(self.replicas) for s in range(self.stages)]

    def rank(self, wid: WorkerId) -> int:
        return wid.replica * self.stages + wid.stage

    def worker(self, rank: int) -> WorkerId:
        return WorkerId(rank // self.stages, rank % self.stages)

    def next_stage(self, wid: WorkerId) -> WorkerId | None:
        return WorkerId(wid.replica, wid.stage + 1) if wid.stage + 1 < self.stages else None

    def prev_stage(self, wid: WorkerId) -> WorkerId | None:
        return WorkerId(wid.replica, wid.stage - 1) if wid.stage > 0 else None

    def stage_replicas(self, stage: int) -> list[WorkerId]:
        """The data-parallel group of one stage."""
        return [WorkerId(r, stage) for r in range(self.replicas)]
