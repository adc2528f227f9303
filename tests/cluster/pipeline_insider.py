"""A participant with valid credentials that lies on its pipeline link (issue 27): bob's worker r1s0,
started with this file in place of ``python -m meshlearn.entry.worker`` — the same worker with bob's
real key, whose own code puts, in place of three of its activations to alice's r1s1 (``LIES``):

- a frame whose header does not decode (its JSON's first bytes overwritten);
- a frame beyond any message of the run (``wire.message_bound``): its padding takes
  ``PADDING_ENV`` bytes, which the test sets past the bound;
- a replay, byte for byte, of an activation it sent the step before.

Each lie takes the honest message's place on the wire, so its receiver must fill that slot.
``simulated_lies`` is the same three in the simulator, where the receiver's guard refuses them
(oversized, oversized, stale step): what the dist run's losses are compared with.

    INSIDER_PADDING=BYTES python pipeline_insider.py --config … --out …

or ``install()`` in a process that runs meshlearn's worker otherwise (``insider_site``).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from meshlearn.compress.codecs import Encoded
from meshlearn.distributed import transport
from meshlearn.distributed.wire import PREFIX_BYTES
from meshlearn.entry.worker import main
from meshlearn.mesh.messages import Message

INSIDER = 2  # r1s0's rank, on bob
LIES = {(1, 0): "undecodable", (2, 1): "oversized", (3, 0): "replay"}  # (step, microbatch), 0-based
PADDING_ENV = "INSIDER_PADDING"

honest_pack = transport.pack
sent: dict[tuple[int, int], torch.Tensor] = {}  # its honest activation frames, as packed


def padded(message: Message, size: int) -> Message:
    """``message`` with an extra field of ``size`` bytes (a flood no receiver may buffer)."""
    payload = message.payload
    padding = torch.zeros(size, dtype=torch.uint8)
    return dataclasses.replace(message, payload=Encoded(dict(payload.tensors) | {"padding": padding},
                                                        payload.shape, payload.dtype, dict(payload.meta)))


def _pack(message: Message, device: torch.device) -> torch.Tensor:
    key = (message.step, message.microbatch)
    if message.kind != "act" or os.environ.get("RANK") != str(INSIDER):
        return honest_pack(message, device)
    sent[key] = honest_pack(message, device)
    lie = LIES.get(key)
    if lie == "undecodable":
        garbled = sent[key].clone()
        garbled[PREFIX_BYTES:PREFIX_BYTES + 8] = ord("#")
        return garbled
    if lie == "oversized":
        return honest_pack(padded(message, int(os.environ[PADDING_ENV])), device)
    if lie == "replay":
        return sent[(message.step - 1, message.microbatch)]
    return sent[key]


def simulated_lies(message: Message) -> Message:
    """The simulator's r1s0 (``Worker.forge``): the same slots, refused by the receiver's guard."""
    lie = LIES.get((message.step, message.microbatch)) if message.kind == "act" else None
    if lie == "replay":
        return dataclasses.replace(message, step=message.step - 1)
    return padded(message, message.payload.wire_bytes) if lie is not None else message


def install() -> None:
    """Make this process's pipeline senders lie (only where RANK is r1s0's)."""
    transport.pack = _pack


if __name__ == "__main__":  # imported (by the test, for ``simulated_lies``), it patches nothing
    install()
    sys.exit(main(sys.argv[1:]))
