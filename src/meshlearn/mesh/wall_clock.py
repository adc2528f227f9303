"""A real run's ``Clock`` (mesh/driver.py): monotonic wall seconds since its driver started."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from meshlearn.mesh.topology import WorkerId


@dataclass(frozen=True)
class WallClock:
    """Every worker of a process reads the same clock; a plugin that reads it at a step's end
    reads the time that step ended."""

    epoch: float  # time.monotonic() when the driver started
    virtual: ClassVar[bool] = False

    def worker_s(self, worker: WorkerId) -> float:
        return time.monotonic() - self.epoch

    def elapsed_s(self) -> float:
        return time.monotonic() - self.epoch
