"""One stage replica's membership: its torchft Manager, the DP mean over the quorum, the commit vote.

Each pipeline stage has its own lighthouse; each stage replica (one process) is a torchft replica
group of size one. At the start of every step the replica asks its stage's lighthouse for a quorum
(the live replicas of the stage; a dead one is dropped once its heartbeat is older than
``elastic.heartbeat_timeout_s``); the gradient mean runs over that quorum's process group; torchft's
``should_commit`` says whether it went through. torchft decides per stage only, so a step is then
put to a vote of every stage through the run's store (``CommitVote``): it commits in every stage
or in none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.health import WorkerFailure
from meshlearn.elastic.binding import bound_process_group, create_manager, require_torchft
from meshlearn.elastic.heal_transport import StateTransport, own_bound
from meshlearn.elastic.settings import ElasticTimeouts
from meshlearn.mesh.topology import WorkerId


@dataclass
class QuorumStep:
    """What one step's quorum looked like from this replica."""

    participants: int
    quorum_s: float  # seconds from asking for the quorum until it formed (the per-step overhead)
    mean_ok: bool = False
    stage_commit: bool = False
    committed: bool = False
    requests: int | None = None  # requests to the run's store in ``begin`` (None: torchft's, not counted)
    vote_rows_requests: int | None = None  # the run store's requests of the row agreement and the vote


class StageQuorum:
    """This stage replica's torchft Manager (its store, process group and server on ``host``)."""

    def __init__(self, me: WorkerId, replica_id: str, host: str, lighthouse: str,
                 timeouts: ElasticTimeouts, min_replicas: int, state_dict, load_state_dict):
        require_torchft()
        timeout = timedelta(seconds=timeouts.collective_s)
        self.me = me
        self.store = BoundStore(host, timeouts.quorum_s)  # the replica group's own store
        self.pg = bound_process_group(host, timeout)
        self.manager = create_manager(
            host, pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=timeouts.quorum_s),
            connect_timeout=timedelta(seconds=timeouts.quorum_s), rank=0, world_size=1,
            store_addr=host, store_port=self.store.port, lighthouse_addr=lighthouse,
            replica_id=replica_id,
            checkpoint_transport=StateTransport(self.pg, timeout, own_bound(state_dict)),  # no pickle
            init_sync=False)  # every replica builds the same seeded model: nothing to sync at step 0

    def begin(self) -> QuorumStep:
        """The quorum of the coming step (a joiner heals here, from a live peer of its stage)."""
        started = time.monotonic()
        self.manager.start_quorum()
        return QuorumStep(self.manager.num_participants(), time.monotonic() - started)

    def sum(self, flat: torch.Tensor) -> bool:
        """``flat`` ← its sum over the quorum's replicas (the caller divides by the contributing
        ones); False if a participant failed (then ``flat`` is garbage and the step must not
        commit)."""
        return bool(self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait())

    def should_commit(self) -> bool:
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class CommitVote:
    """A step commits in every stage or in none: each replica adds its stage's verdict to the run's
    store; the first replica to see every stage's votes (or the deadline pass) fixes the outcome
    with compare-and-set, and everyone adopts it. A stage whose quorum has no replica left cannot
    vote: the step fails there, and the run stops with the stage's name."""

    def __init__(self, store: dist.Store, stages: int, deadline_s: float):
        self.store = store
        self.stages = stages
        self.deadline_s = deadline_s

    def decide(self, step: int, me: WorkerId, participants: int, ok: bool) -> bool:
        key = f"commit/{step}"
        # The tallies before the size: a stage's size exists only once its tallies do, so a reader
        # (which asks for them once every size exists) never blocks on one — it would hold the
        # store client, and others could not add — and nobody creates the other stages' tallies
        # (a round trip each, on every step's path). "yes" before "done": a reader never counts a
        # vote as done and not yet yes.
        self.store.add(f"{key}/s{me.stage}/yes", int(ok))
        self.store.add(f"{key}/s{me.stage}/done", 1)
        self.store.set(f"{key}/s{me.stage}/n", str(participants))
        end = time.monotonic() + self.deadline_s
        pause = 1e-4
        while True:
            outcome = self._outcome(key)
            if outcome is not None:
                return self._fix(key, "1" if outcome else "0")
            if self.store.check([f"{key}/decision"]):
                return self.store.get(f"{key}/decision") == b"1"
            if time.monotonic() >= end:
                missing = [s for s in range(self.stages) if not self.store.check([f"{key}/s{s}/n"])]
                if missing:
                    raise WorkerFailure(f"no replica of stage {missing[0]} is left (step {step + 1} "
                                        f"got no vote from it within {self.deadline_s:.1f} s; "
                                        f"noticed by {me})")
                return self._fix(key, "0")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def close(self) -> None:
        """Nothing to close: the store is the driver's."""

    def _outcome(self, key: str) -> bool | None:
        """False on the first "no"; True once every stage's quorum has voted yes in full; else None."""
        names = [f"{key}/s{s}/n" for s in range(self.stages)]
        if not self.store.check(names):
            return None
        counts = [int(v) for v in self.store.multi_get(names)]
        tallies = self.store.multi_get([f"{key}/s{s}/{what}" for s in range(self.stages)
                                        for what in ("done", "yes")])
        done, yes = [int(v) for v in tallies[0::2]], [int(v) for v in tallies[1::2]]
        if any(d > y for d, y in zip(done, yes, strict=True)):
            return False  # one "no" settles it: no need to wait for a replica that may be dead
        if any(d < n for d, n in zip(done, counts, strict=True)):
            return None
        return all(y == n for y, n in zip(yes, counts, strict=True))

    def _fix(self, key: str, value: str) -> bool:
        won = self.store.compare_set(f"{key}/decision", "", value)
        return (won.decode() if isinstance(won, bytes) else str(won)) == "1"
