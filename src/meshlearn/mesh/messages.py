"""Messages between workers: what the drivers carry, and what verifiers and attacks will inspect."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshlearn.compress.codecs import Encoded
from meshlearn.mesh.topology import WorkerId


@dataclass
class Message:
    """A forward activation (``act``) or a backward gradient (``grad``) of one microbatch."""

    kind: Literal["act", "grad"]
    step: int
    microbatch: int
    src: WorkerId
    dst: WorkerId
    payload: Encoded

    @property
    def wire_bytes(self) -> int:
        return self.payload.wire_bytes
