"""The cost-only simulator's DP axis (``meshlearn plan``): the SimDriver's ``Collectives`` over
cost-only workers (``Worker(cost_only=...)``). The event loop, links and ring are the
simulator's own; only what the all-reduce computes differs: the bytes of the gradients every
replica holds after a backward (each trainable parameter's, as ``average_gradients`` counts
them), no values."""

from __future__ import annotations

from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Network
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import Worker


class SizeCollectives:
    """Every replica simulated: the ring over them, messages arrive as sent."""

    def average_gradients(self, replicas: list[Worker]) -> int:
        return replicas[0].trainable_bytes

    def stage_ring(self, replicas: list[WorkerId]) -> list[WorkerId]:
        return replicas

    def arriving(self, message: Message) -> Message:
        return message

    def bytes_on_axis(self, network: Network, axis: str) -> int:
        """Bytes the mesh's links sent on ``axis``."""
        return network.bytes_on_axis(axis)
