"""How a live replica hands a joiner its state (torchft's healing) without a pickle.

torchft's own ``PGTransport`` sends a pickled description of the state and ``pickle.loads`` it on
the joiner: the donor's bytes would run as code in the joiner. This transport sends the same
state, over the same process group, as one meshlearn state file (safetensors + JSON,
meshlearn/statefile.py): first its length, then its bytes. The joiner refuses a length beyond
``bound()`` before it allocates anything, and anything that is not that format in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

from meshlearn.statefile import MAX_HEADER, CheckpointError, decode_state, encode_state

LENGTH_TAG, BODY_TAG = 1, 2  # the process group's message tags, as torchft's transport uses them


class StateTransport:
    """torchft's checkpoint transport interface (``metadata``, ``send_checkpoint``,
    ``recv_checkpoint``, ``disallow_checkpoint``, ``shutdown``: the calls its Manager makes), for
    one state blob over ``pg`` with CPU tensors."""

    def __init__(self, pg, timeout: timedelta, bound: Callable[[], int]):
        self.pg = pg
        self.timeout = timeout
        self.bound = bound  # the most bytes a joiner accepts (from its own state's size)

    def metadata(self) -> str:
        return "meshlearn-state"

    def disallow_checkpoint(self) -> None:
        """Sends complete inside ``send_checkpoint``: nothing is left to wait for."""

    def shutdown(self, wait: bool = True) -> None:
        """No thread or buffer of its own to release."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout=None) -> None:
        wait = timeout or self.timeout
        blob = torch.frombuffer(bytearray(encode_state({"step": step, "state": state_dict})),
                                dtype=torch.uint8)
        length = torch.tensor([blob.numel()], dtype=torch.int64)
        works = []
        for dst in dst_ranks:
            works += [self.pg.send([length], dst, tag=LENGTH_TAG), self.pg.send([blob], dst, tag=BODY_TAG)]
        for work in works:
            work.wait(wait)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout=None):
        wait = timeout or self.timeout
        source = f"the healing state from replica rank {src_rank}"
        length = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([length], src_rank, tag=LENGTH_TAG).wait(wait)
        n, bound = int(length.item()), self.bound()
        if not 0 < n <= bound:
            raise CheckpointError(source, f"{n} bytes announced, at most {bound} accepted")
        blob = torch.empty(n, dtype=torch.uint8)
        self.pg.recv([blob], src_rank, tag=BODY_TAG).wait(wait)
        message = decode_state(blob.numpy().tobytes(), source, bound, device="cpu")
        if not isinstance(message, dict) or message.get("step") != step or \
                not isinstance(message.get("state"), dict):
            raise CheckpointError(source, f"not the state of step {step}")
        return message["state"]


def own_bound(state_dict: Callable[[], object]) -> Callable[[], int]:
    """What a joiner accepts: twice the size of its own state (the donor's has the same shapes)
    and room for the tree's header."""
    return lambda: 2 * len(encode_state(state_dict())) + MAX_HEADER
