"""The rendezvous store as the board where the verifier posts its verdicts and attackers their truth.

Per step these are small JSON values (a few kB of decisions): ``verdict/<t>``, posted by the
verifier once it has seen all of step t's messages and closed the step, read by every worker at
the step's end (the trust plugin's ``on_step_end``); ``truth/<t>/<worker>``, the messages an
attacker's own process changed in step t (the harness's ground truth), read by the process that
writes the records; under async ``drained/<t>``, posted by rank 0 when the pipeline drains after
step t, before that drain's gather, read by the verifier. Every read waits with a deadline and
checks liveness, so a dead verifier or attacker ends the run with its name instead of a hang. Old
keys are deleted by the one that knows nobody needs them any more: under a flushing schedule the
records' writer (a step's end is a barrier of all workers), under async the verifier, which knows
the drain points. For checkpoints, the verifier's state crosses it too: rank 0 asks for it at a
checkpoint (``state_request`` → ``state/<done>``) and keeps it in its own shard, and hands it back
on resume (``resume_state``), so the checkpoint layout and its completeness rule stay the workers'.
"""

from __future__ import annotations

import json
import os
import time

import torch

from meshlearn.distributed.health import Health, WorkerFailure, store_client
from meshlearn.mesh.topology import WorkerId
from meshlearn.statefile import decode_state, encode_state

POLL_S = 0.002  # a step's end waits on this


class VerdictBoard:
    """``cleanup``: this reader deletes the keys of the previous step (the records' writer)."""

    def __init__(self, health: Health, deadline_s: float, cleanup: bool = False, store=None):
        self.health = health
        self.deadline_s = deadline_s
        self.cleanup = cleanup
        self.store = store or store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           deadline_s)

    def post_verdict(self, step: int, record: dict) -> None:
        self.store.set(f"verdict/{step}", json.dumps(record))

    def verdict(self, step: int) -> dict:
        """The verifier's verdict record of ``step`` (waits until it is posted)."""
        key = f"verdict/{step}"
        record = json.loads(self._get(key, f"the verifier's verdict on step {step + 1}"))
        if self.cleanup and step > 0:
            # Every worker read step − 1's verdict before its update of this step (a barrier).
            self.store.delete_key(f"verdict/{step - 1}")
        return record

    def post_drained(self, step: int) -> None:
        """Async: the pipeline drains after ``step`` (rank 0, before the drain's gather)."""
        self.store.set(f"drained/{step}", "1")

    def drained(self, step: int) -> bool:
        """Whether a drain point followed ``step`` (exact once a message of step + 1 was seen)."""
        return self.store.check([f"drained/{step}"])

    def forget(self, steps) -> None:
        """Async: delete the verdicts (and drain marks) of ``steps``, which every worker has read."""
        for step in steps:
            self.store.delete_key(f"verdict/{step}")
            self.store.delete_key(f"drained/{step}")

    def verifier_state(self, done: int) -> bytes:
        """Rank 0, at a checkpoint after ``done`` steps: the verifier's state there."""
        self.store.set("state_request", str(done))
        key = f"state/{done}"
        blob = self._get(key, f"the verifier's state after step {done}")
        self.store.delete_key(key)
        return blob

    def state_requested(self) -> int | None:
        """The verifier: the steps done of a checkpoint waiting for its state (None: none)."""
        if not self.store.check(["state_request"]):
            return None
        done = int(self.store.get("state_request"))
        self.store.delete_key("state_request")
        return done

    def post_state(self, done: int, blob: bytes) -> None:
        self.store.set(f"state/{done}", blob)

    def post_resume_state(self, blob: bytes) -> None:
        """Rank 0 on resume: the verifier's state from its checkpoint shard."""
        self.store.set("resume_state", blob)

    def resume_state(self, deadline_s: float) -> bytes:
        """The verifier on resume: waits for rank 0 to load its shard."""
        return self._get("resume_state", "the verifier's state from rank 0's checkpoint", deadline_s)

    def post_bans(self, step: int, records: list[dict]) -> None:
        """Rank 0, at ``step``'s end: the bans decided outside the verifier (DP evictions; posted
        every step, often none), so the verifier's ledger counts them against the same budget."""
        self.store.set(f"bans/{step}", json.dumps(records))

    def bans(self, step: int) -> list[dict]:
        """The verifier: the records ``post_bans`` posted for ``step`` (waits for them; read once)."""
        key = f"bans/{step}"
        records = json.loads(self._get(key, f"the DP evictions of step {step + 1}"))
        self.store.delete_key(key)
        return records

    def publish_truth(self, step: int, wid: WorkerId, keys: set) -> None:
        self.store.set(f"truth/{step}/{wid}", json.dumps(sorted(keys)))

    def truth(self, step: int, wid: WorkerId) -> set:
        key = f"truth/{step}/{wid}"
        raw = self._get(key, f"attacker {wid}'s ground truth of step {step + 1}")
        keys = {tuple(k) for k in json.loads(raw)}
        self.store.delete_key(key)
        return keys

    def wait_for(self, store, key: str, what: str) -> bytes:
        """A key of another view of the run's store (a prefix store over the board's), as the board
        waits for its own (elastic: the agreed rows)."""
        return self._get(key, what, store=store)

    def _get(self, key: str, what: str, deadline_s: float | None = None, store=None) -> bytes:
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        store = store or self.store
        end = time.monotonic() + deadline_s
        while not store.check([key]):
            self.health.check()
            if time.monotonic() >= end:
                raise WorkerFailure(self.health.explain(
                    f"{what} did not come within {deadline_s:.1f} s"))
            time.sleep(POLL_S)
        return store.get(key)


def state_blob(state: dict) -> torch.Tensor:
    """A state dict as one uint8 tensor (to broadcast it): safetensors + JSON, never a pickle
    (meshlearn/statefile.py), because the receiver must not run what a peer sends."""
    return torch.frombuffer(bytearray(encode_state(state)), dtype=torch.uint8)


def blob_state(blob: torch.Tensor | bytes, source: str, max_bytes: int) -> dict:
    """The inverse of ``state_blob``, of at most ``max_bytes``: tensors and plain containers only;
    anything else is refused in one line naming ``source`` (CheckpointError)."""
    data = blob if isinstance(blob, bytes) else blob.numpy().tobytes()
    return decode_state(data, source, max_bytes)
