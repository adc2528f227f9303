"""Cost-only mode of the simulator (``meshlearn plan``): a worker whose F/B do no arithmetic and
a SimDriver whose all-reduce counts bytes. Everything else is the real worker's and driver's code,
so the planner predicts with the simulator's own cost model."""

from __future__ import annotations

import torch

from meshlearn.compress.codecs import Encoded, Kind, SizedEncoded
from meshlearn.mesh.compute import StageShape, stage_shape
from meshlearn.mesh.messages import Message
from meshlearn.mesh.sim import SimDriver
from meshlearn.mesh.worker import InFlight, Worker


class CostWorker(Worker):
    """A worker whose F/B do no arithmetic: its module lives on the meta device (shapes, no
    storage; one module per stage, shared by every replica and every simulation of that shape),
    and each F/B sends a message of exactly the codec's wire size (the codec's own ``encode`` run
    on a meta tensor of the message's shape). Everything else — the plan, the inbox, versions,
    stash bookkeeping, updates, the DP strategy's phases — is the real worker's code, so the
    simulator's event loop runs unchanged over it. The real path pays nothing for it: only this
    subclass overrides ``_forward``/``_backward`` and the weight leaves (a stashed version is an
    empty placeholder; its memory is ``stash_peak × param_bytes``).

    ``in_flight_peak``: the most microbatches held between forward and backward (activation memory).
    """

    def __init__(self, *args, seq_len: int, d_model: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.seq_len, self.d_model = seq_len, d_model
        self.in_flight_peak = 0
        self._wire: dict[tuple[str, int], Encoded] = {}
        self._shape = stage_shape(self.module)  # no warm-up locks in a cost-only run
        self.trainable_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters()
                                   if p.requires_grad)

    @property
    def shape(self) -> StageShape:
        return self._shape

    def wire(self, kind: Kind, batch: int) -> Encoded:
        """What the codec puts on the wire for one microbatch of ``batch`` sequences (cached)."""
        key = (kind, batch)
        if key not in self._wire:
            x = torch.empty(batch, self.seq_len, self.d_model, device="meta")
            ids = torch.empty(batch, self.seq_len, dtype=torch.long, device="meta")
            encoded = self.codec.encode(x, kind, ids)
            self._wire[key] = SizedEncoded(encoded.tensors, encoded.shape, encoded.dtype, encoded.meta)
        return self._wire[key]

    def _aliases(self) -> dict[str, torch.Tensor]:
        return {}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {}

    def _forward(self, j: int) -> list[Message]:
        step, m = divmod(j, self.microbatches)
        weights = self._forward_weights()
        if not self.is_first:
            self.inbox.pop(("act", j))
        self.in_flight[j] = InFlight(None, None, None, self.version, weights)
        self.in_flight_peak = max(self.in_flight_peak, len(self.in_flight))
        if self.is_last:
            return []
        payload = self.wire("act", self.work[step].microbatch_size)
        return [Message("act", step, m, self.id, self.mesh.next_stage(self.id), payload,
                        version=self.version)]

    def _backward(self, j: int) -> list[Message]:
        step, m = divmod(j, self.microbatches)
        record = self.in_flight.pop(j)
        if not self.is_last:
            self.inbox.pop(("grad", j))
        if record.weights is not None:
            self._release_stash(record)
        self._group_versions.append(record.version)
        if self.is_first:
            return []
        payload = self.wire("grad", self.work[step].microbatch_size)
        return [Message("grad", step, m, self.id, self.mesh.prev_stage(self.id), payload,
                        version=record.version)]

    def grad_sq_norm(self) -> float:
        return 0.0  # no values: clipping never scales (it would not change any time or byte)


class CostSimDriver(SimDriver):
    """The simulator in cost-only mode (``meshlearn plan``) over ``CostWorker``s: the same event
    loop, links and collectives; the all-reduce counts the bytes of the gradients every replica
    holds after a backward (each trainable parameter's, as ``average_gradients`` does) instead of
    averaging values."""

    def _average_gradients(self, replicas: list[Worker]) -> int:
        return replicas[0].trainable_bytes

    def bytes_on_axis(self, axis: str) -> int:
        """Bytes the mesh's links sent on ``axis`` (``plan.mirror``: from one row's)."""
        return self.network.bytes_on_axis(axis)
