"""SENTINEL's bans as evictions: a banned stage replica leaves its stage's quorum for good.

Under the fixed-membership driver a ban replaces the banned worker's state from an honest donor
(``verify/trust.py``). Under elastic membership the slot is emptied instead:

1. The verifier (trusted) decides the ban when it closes step t, and before it posts the verdict
   it writes the ban on the run's store: ``elastic/banned/<slot>/<generation>`` (the identity,
   with the step and the evidence) and ``evicted/r<replica>`` (the row, in the row agreement's
   prefix store). From step t + 1 on, ``RowAgreement`` leaves that row out whatever its processes
   do, and the verifier drops anything the banned worker still sends (its slot is never readmitted).
2. Every worker reads the verdict at the end of step t (the trust plugin) and calls
   ``ElasticDriver.evict``: the banned worker and its row partners stop before step t + 1 (exit
   code 5 for the banned one, 4 for its partners: their row broke), and every worker stops
   waiting for the banned attacker's ground truth. Their stages' next quorums go on without them.
   The partners leave rather than stay and spectate (as a dead replica's partners do without
   SENTINEL, elastic/driver.py): the evicted row is never agreed again and such a run takes no
   joiners, so they would spectate to the end — a member of their stages' sums training nothing.
3. The launcher records the ban in ``workers.json`` (``banned``: step, reason, generation) and
   kills a banned process of its own that has not left after its grace period.

The identity — slot and generation, torchft's replica id ``r1s1.0`` — cannot come back: a worker
process started under it (the same ``RANK`` and ``MESHLEARN_GENERATION``) is refused at start
with one line (``refuse_banned``). A run with SENTINEL takes no ``--join`` at all yet (the
verifier relays the links of the rows it started with), so the banned slot stays closed for the
rest of the run; the other slots of its row are free, but no joiner can take them either.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from meshlearn.config import RunConfig
from meshlearn.distributed.groups import Link
from meshlearn.distributed.health import EXIT_EVICTED, EXIT_LEFT, WorkerFailure, store_client
from meshlearn.distributed.verdict_board import VerdictBoard
from meshlearn.elastic.binding import interface_of
from meshlearn.elastic.links import generation_key, verifier_links
from meshlearn.elastic.membership import GENERATION_ENV, banned_key
from meshlearn.elastic.rows import decode_rows
from meshlearn.elastic.settings import derive_timeouts
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.ledger import Ban
from meshlearn.verify.verdicts import RemoteSentinel

if TYPE_CHECKING:
    from meshlearn.distributed.session import Session


def evicted_key(replica: int) -> str:
    """Set by the verifier once a worker of row ``replica`` is banned: the row never trains again.
    Under the ``elastic/`` prefix store the row agreement and the commit vote share."""
    return f"evicted/r{replica}"


def ban_reason(ban: Ban) -> str:
    return (f"banned by SENTINEL at step {ban.step + 1} ({ban.boundary} {ban.kind} {ban.metric}, "
            f"{ban.strikes} strike{'s' if ban.strikes != 1 else ''})")


class Evicted(WorkerFailure):
    """This worker leaves the run before the next step: it, or a partner of its row, was banned."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RelayMembership:
    """The verifier's view of an elastic run's rows: which rows train each step (the agreed value,
    read from the store when the step's first message arrives — every process fixed it before
    sending), and the rows it evicted."""

    def __init__(self, store: dist.Store, mesh: MeshShape, board: VerdictBoard):
        self.store = store
        self.shared = dist.PrefixStore("elastic/", store)  # the row agreement's keys
        self.mesh = mesh
        self.board = board
        self.agreed: dict[int, tuple[int, ...]] = {}
        self.evicted: set[int] = set()

    def rows(self, step: int) -> tuple[int, ...]:
        if step not in self.agreed:
            self.agreed[step] = decode_rows(self.board.wait_for(self.shared, f"rows/{step}/fixed",
                                                                f"the rows agreed for step {step + 1}"))
        return self.agreed[step]

    def trains(self, step: int, replica: int) -> bool:
        return replica not in self.evicted and replica in self.rows(step)

    def evict(self, ban: Ban) -> None:
        """Write the ban on the store before the verdict that announces it."""
        wid = ban.worker
        generation = int(self.store.get(generation_key(wid)).decode())
        self.store.set(banned_key(wid, generation), json.dumps({"step": ban.step, "reason": ban_reason(ban)}))
        self.shared.set(evicted_key(wid.replica), str(wid))
        self.evicted.add(wid.replica)

    def left(self, wid: WorkerId) -> bool:
        """Whether ``wid`` left on purpose (its row was evicted): its closed links are no failure."""
        return wid.replica in self.evicted


def elastic_relay(cfg: RunConfig, session: Session) -> tuple[dict[Link, tuple], RelayMembership]:
    """An elastic run's relay (the SENTINEL verifier's, ``distributed/verifier.py``): its pair groups
    to every worker (elastic/links.py), and the rows the run agrees on per step. Deadline: the
    workers' first quorum, then the links. ``session``: the verifier's ``distributed.session.Session``."""
    timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link)
    deadline_s = cfg.dist.init_timeout_s + timeouts.quorum_s
    address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    links = verifier_links(store_client(*address, deadline_s), session.mesh, interface_of(cfg.elastic.host),
                           deadline_s)
    session.health.watch_again(set(range(session.mesh.world_size)))  # every worker has met us: running
    store = store_client(*address, deadline_s)  # the main thread's own (the links' is gloo's)
    return links, RelayMembership(store, session.mesh, VerdictBoard(session.health, deadline_s, store=store))


class Evictions:
    """The ElasticDriver's side of SENTINEL (a mixin): the verdicts, and bans carried out as
    evictions. Needs the driver's ``me``, ``health``, ``deadlines``, ``quorum``, ``records`` and
    ``beacon``."""

    def setup_verification(self, cfg) -> None:
        self.evicted: dict[WorkerId, int] = {}  # banned worker → the step (0-based) of its ban
        self.leaving: Evicted | None = None  # raised before the next step
        self.verdicts = self.remote_sentinel = None
        if cfg.verify.name == "sentinel":
            self.verdicts = VerdictBoard(self.health, self.deadlines.collective_s)
            self.remote_sentinel = RemoteSentinel(self.verdicts.verdict)

    def evict(self, ban: Ban) -> None:
        """Called by the trust layer in every worker at the end of the ban's step (the verifier has
        already shut the row out of the row agreement)."""
        wid = ban.worker
        self.evicted[wid] = ban.step
        if wid.replica != self.me.replica:
            return
        if wid == self.me:
            self.leaving = Evicted(f"evicted: {ban_reason(ban)}; left its stage's quorum", EXIT_EVICTED)
        else:
            self.leaving = Evicted(f"left: its pipeline row's {wid} was {ban_reason(ban)}", EXIT_LEFT)

    def check_eviction(self) -> None:
        if self.leaving is not None:
            # Records it holds but has not claimed stay the live last stages' (a claim by a leaving
            # process would take an evaluation record's step from the one that evaluated).
            self.records.pending.clear()
            self.quorum.shutdown()
            # Its last step on the store before it exits (the process ends without waiting for the
            # progress thread): the launcher's workers.json says it left after that step. A store
            # that fails or lags here leaves the step before; the process leaves all the same.
            with contextlib.suppress(RuntimeError, TimeoutError):
                self.beacon.close(self.deadlines.collective_s)
            self.health.finish()  # on purpose: nobody is to take its silence for a failure
            raise self.leaving

    def exchange_truth(self, step: int, local: dict[WorkerId, set], attackers: list[WorkerId]
                       ) -> dict[WorkerId, set]:
        """As the fixed driver's, without the attackers evicted before ``step`` (gone). Without a
        verifier (a DP attack under ``elastic.membership = "control"``) nothing carries the ground
        truth between processes: each knows its own attacker's only."""
        if self.verdicts is None:
            return local
        return super().exchange_truth(step, local, [w for w in attackers
                                                    if self.evicted.get(w, step) >= step])


def refuse_banned(store: dist.Store, wid: WorkerId, generation: int) -> None:
    """A process that starts under a banned identity (the slot and generation of a banned worker)."""
    key = banned_key(wid, generation)
    if store.check([key]):
        ban = json.loads(store.get(key).decode())
        raise ConfigError(GENERATION_ENV, generation,
                          f"the identity {wid}.{generation} (slot {wid}, generation {generation}) was "
                          f"{ban['reason']}: it cannot rejoin; the slot stays closed for the rest of the run")


def refuse_banned_start(cfg) -> None:
    """``refuse_banned`` for this process's identity, from the launcher's (or torchrun's)
    environment, before it joins anything; the verifier and the launcher's first start pass."""
    from meshlearn.distributed.health import store_client

    rank = int(os.environ.get("RANK", "-1"))
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    if cfg.verify.name == "none" or not 0 <= rank < mesh.world_size or "MASTER_PORT" not in os.environ:
        return
    store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), cfg.dist.init_timeout_s)
    refuse_banned(store, mesh.worker(rank), int(os.environ.get(GENERATION_ENV, "0")))


def refuse_resume_when_verified(cfg, run_dir) -> None:
    if cfg.elastic.enabled and cfg.verify.name != "none":
        raise ConfigError("--resume", str(run_dir), "an elastic run with SENTINEL cannot resume yet (the "
                                                    "verifier's state is not in the elastic checkpoints)")


def refuse_join_when_verified(cfg, address: str) -> None:
    if cfg.verify.name != "none":
        raise ConfigError("--join", address, f"the run verifies (verify.name = {cfg.verify.name!r}): "
                                             "it takes no joiners yet (the verifier relays the links of "
                                             "the rows it started with; a banned worker's slot stays closed)")
