"""Wire-level forgeries (the tensor is honest, the message lies) and how they reach the wire.

``Forgery.forge(message)`` rewrites an encoded message: token ids out of range, a wrong shape or
dtype, non-finite values, an oversized or a stale message — what ``meshlearn.compress.wire_checks``
makes receivers reject. The trust layer installs it as the attacker's ``Worker.forge`` hook, so a
forged message leaves the sender as it is (an oversized one costs its real bytes on the link) and
meets the receiver's guard (``Worker.admit``) before any verifier decodes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import TYPE_CHECKING

import torch

from meshlearn.compress.codecs import Encoded, Kind
from meshlearn.compress.wire_checks import INDEX_FIELDS
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.attack_base import Attack, AttackConfig

if TYPE_CHECKING:  # config.py and the trainer import this module
    pass


FORGERIES = ("forge_ids", "forge_shape", "forge_dtype", "forge_nonfinite", "forge_oversize", "forge_stale",
             "forge_src", "forge_kind")
"""The registry names of the forgeries (see ``verify.attacks.ATTACKS``)."""


# --- wire-level forgeries: the tensor is honest, the message lies ------------------------------


class Forgery(Attack):
    """Base of the wire forgeries: leaves the tensor alone and rewrites the encoded payload."""

    def corrupt(self, kind, step, microbatch, x):
        return x

    def forge_message(self, message: Message) -> Message:
        payload = self.forge_payload(message.payload)
        return message if payload is None else dataclasses.replace(message, payload=payload)

    def forge_payload(self, payload: Encoded) -> Encoded | None:
        """The forged payload, or None to decline (nothing to forge in this codec's format)."""
        raise NotImplementedError


def _with_tensors(payload: Encoded, tensors: dict[str, torch.Tensor]) -> Encoded:
    """The payload's header (shape, dtype, meta) over other tensors: the original stays untouched."""
    return Encoded(tensors, payload.shape, payload.dtype, dict(payload.meta))


class ForgeIds(Forgery):
    """Index fields out of range: token ids (subspace activations) or top-k positions become −1 and
    the dtype's maximum. Unchecked, the receiver's table lookup or scatter raises."""

    name = "forge_ids"

    def forge_payload(self, payload):
        names = [n for n in INDEX_FIELDS if n in payload.tensors]
        if not names:
            return None
        tensors = dict(payload.tensors)
        for name in names:
            forged = tensors[name].clone().reshape(-1)
            forged[:] = torch.iinfo(forged.dtype).max
            forged[0] = -1
            tensors[name] = forged.reshape(payload.tensors[name].shape)
        return _with_tensors(payload, tensors)


class ForgeShape(Forgery):
    """Every field one row short along its first dimension, the header unchanged (a lie about size)."""

    name = "forge_shape"

    def forge_payload(self, payload):
        return _with_tensors(payload, {n: t[:-1].clone() for n, t in payload.tensors.items()})


SAME_WIDTH = {torch.float32: torch.int32, torch.int32: torch.float32, torch.bfloat16: torch.int16,
              torch.float16: torch.int16, torch.int16: torch.float16, torch.int8: torch.uint8,
              torch.uint8: torch.int8, torch.float64: torch.int64, torch.int64: torch.float64}


class ForgeDtype(Forgery):
    """Every field's bits reinterpreted as another dtype of the same width: same bytes, wrong type."""

    name = "forge_dtype"

    def forge_payload(self, payload):
        return _with_tensors(payload, {n: t.view(SAME_WIDTH[t.dtype]) for n, t in payload.tensors.items()})


class ForgeNonFinite(Forgery):
    """A NaN and an inf in every floating field (values, scales or coefficients)."""

    name = "forge_nonfinite"

    def forge_payload(self, payload):
        tensors = dict(payload.tensors)
        floats = [n for n, t in tensors.items() if t.is_floating_point()]
        if not floats:
            return None
        for name in floats:
            forged = tensors[name].clone().reshape(-1)
            forged[0], forged[-1] = float("nan"), float("inf")
            tensors[name] = forged.reshape(payload.tensors[name].shape)
        return _with_tensors(payload, tensors)


class ForgeOversize(Forgery):
    """An extra field of ``oversize_factor`` × the honest size: a flood the receiver must not buffer."""

    name = "forge_oversize"

    def forge_payload(self, payload):
        padding = torch.zeros(math.ceil(self.cfg.oversize_factor * payload.wire_bytes), dtype=torch.uint8)
        return _with_tensors(payload, dict(payload.tensors) | {"padding": padding})


class ForgeStale(Forgery):
    """Sends, for (kind, microbatch), its own message from ``replay_delay`` steps earlier with that
    step's number (the oldest it kept, early on); declines while it has no earlier step."""

    name = "forge_stale"

    def __init__(self, cfg: AttackConfig, seed: int):
        super().__init__(cfg, seed)
        self.history: dict[tuple[Kind, int], deque[tuple[int, Encoded]]] = {}

    def observe_message(self, message):
        if message.kind in self.kinds and self.stopped_at is None:
            queue = self.history.setdefault((message.kind, message.microbatch),
                                            deque(maxlen=self.cfg.replay_delay + 1))
            queue.append((message.step, message.payload))

    def forge_message(self, message):
        step, payload = self.history[(message.kind, message.microbatch)][0]
        if step == message.step:
            return message
        return dataclasses.replace(message, step=step, payload=payload)

    def state_dict(self) -> dict:
        return super().state_dict() | {"history": {f"{k}:{m}": [(t, p.tensors, p.shape, p.dtype, p.meta)
                                                                for t, p in q]
                                                   for (k, m), q in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.history = {}
        for key, entries in state["history"].items():
            kind, m = key.split(":")
            self.history[(kind, int(m))] = deque(
                [(t, Encoded(tensors, tuple(shape), dtype, dict(meta))) for t, tensors, shape, dtype, meta
                 in entries], maxlen=self.cfg.replay_delay + 1)


class ForgeSender(Forgery):
    """Claims another sender: the header names the next replica of its own stage (which may not
    exist), the payload stays honest. A receiver that trusted the header would credit another worker
    with the message (and SENTINEL would score the wrong one); receivers route by the link, so the
    claim alone gets it refused. Under ``backend = dist`` the refusal comes before decoding (the
    transport's check of a header's source, ``distributed/wire.py: unpack``)."""

    name = "forge_src"

    def forge_message(self, message):
        return dataclasses.replace(message, src=WorkerId(message.src.replica + 1, message.src.stage))


class ForgeKind(Forgery):
    """Labels its activations as gradients and its gradients as activations, the payload honest. A
    receiver that took the kind from the header would file the message where the other neighbour's
    belongs (and blame that neighbour); receivers take the kind from the link, so the label alone
    gets it refused and the stand-in is of the kind the receiver waits for."""

    name = "forge_kind"

    def forge_message(self, message):
        return dataclasses.replace(message, kind="grad" if message.kind == "act" else "act")
