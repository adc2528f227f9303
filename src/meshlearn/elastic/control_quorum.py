"""A stage's membership on the run's control service (``elastic.membership = "control"``).

Why not torchft across machines: its lighthouse, each replica's manager server, the quorum's
store and its gloo group all open ports of their own and authenticate nobody, and it asks the
lighthouse for a quorum at every step (a WAN round trip on every step's critical path). Here the
stage's membership is a record in the run's store — the launcher's on one machine, the
authenticated control service in a cluster run (``health.store_client`` gives whichever) — and
the DP sum runs over framed streams from the run's connector (``FramedCollectives``: plain on
one machine, mutual TLS through each host's one port in a cluster run).

The record (``at/<q>``, fixed with compare-and-set by the first member that sees it complete):
the members of quorum number ``q`` (``<worker>.<generation>``, replica order), how many join
requests it consumed, whether the members keep the streams they hold, and who heals whom.

When a new record is formed (the slow path, a few store round trips): at the first step; after a
step that did not commit (the vote is the same for every process, so every member of every stage
knows); and after a step in whose sums some member flagged a change. Every other step reuses the
last record and sends nothing to the control service (the fast path). A change is flagged by a
member's background ``Watch``: a join request for its stage beyond those admitted, or a member's
heartbeat (``hb/<id>``, a counter the watch also beats) unchanged for ``elastic.heartbeat_timeout_s``.
The flag rides in every contribution of the stage's sums (one number after the payload): members
whose sums all succeeded saw the same flags, so they all take the slow path at the same step.

Forming record ``q``: each member of the last record says it arrived (and whether its streams are
intact); the record is fixed once every member whose heartbeat has not lapsed arrived (or
``elastic.join_timeout_s`` passed), with the fresh joiners admitted beside them (a joiner does not
arrive: it waits for a record that names it) and at least ``elastic.min_replicas`` members. A
joiner is healed by the first member of the last record (replica order) over the new streams: one
meshlearn state file (safetensors + JSON, no pickle), refused beyond twice the joiner's own state.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshlearn.distributed.collectives import FramedCollectives, Lost, Refused
from meshlearn.distributed.health import WorkerFailure
from meshlearn.distributed.streams import StreamConnector
from meshlearn.elastic.heal_transport import own_bound
from meshlearn.elastic.quorum import QuorumStep
from meshlearn.elastic.settings import ElasticTimeouts
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.statefile import CheckpointError, decode_state, encode_state

POLLS_PER_HEARTBEAT = 5  # the watch beats and looks this often per heartbeat timeout


def member_worker(member: str) -> WorkerId:
    """``r1s0.2`` → r1s0 (the slot; ``.2``: the process's generation)."""
    return WorkerId.parse(member.split(".", 1)[0])


def all_pairs(connector: StreamConnector, mesh: MeshShape, me: WorkerId, members: list[WorkerId],
              channel: str, connect_s: float, collective_s: float) -> FramedCollectives:
    """``me``'s framed collectives over streams between every ordered pair of ``members`` (a stage's
    quorum, the vote's group), connected on ``channel``; each collective waits ``collective_s``."""
    rank = mesh.rank(me)
    hops = [((a, b), mesh.rank(a), mesh.rank(b)) for a in members for b in members if a != b]
    mine = connector.connect(rank, {channel: hops}, connect_s)[channel]
    framed = FramedCollectives(rank, {b: mine[i] for i, (_, a, b) in enumerate(hops) if a == rank},
                               {a: mine[i] for i, (_, a, b) in enumerate(hops) if b == rank},
                               connector.counters)
    framed.set_timeout(collective_s)
    return framed


class CountingStore:
    """The store, counting the requests made through it (each a round trip to the run's store:
    over a WAN, what the quorum costs a step). A plain wrapper, never under a ``PrefixStore``:
    a Python ``dist.Store`` there takes the GIL again on every request, measured to slow an
    elastic step on a loaded host (docs/elastic.md)."""

    def __init__(self, store):
        self.store = store
        self.requests = 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)
        return counted


@dataclass
class Seen:
    """What the watch knows of its stage: join requests, and when each heartbeat last moved."""

    joins: int = 0
    joiners: dict[int, str] = field(default_factory=dict)  # request number → member
    beats: dict[str, tuple[int, float]] = field(default_factory=dict)  # member → (count, when it moved)


class Watch:
    """This member's heartbeat and its eye on the stage, in a thread of its own (its own store
    client: a store client is not for two threads). ``changed()`` is what this member flags in
    its contributions; ``lapsed`` and ``pending`` are what the slow path forms the record from."""

    def __init__(self, store, member: str, heartbeat_s: float):
        self.store, self.member, self.heartbeat_s = store, member, heartbeat_s
        self.period = heartbeat_s / POLLS_PER_HEARTBEAT
        self.members: tuple[str, ...] = ()  # the current record's (set by the quorum)
        self.admitted = 0  # join requests the current record consumed
        self.seen = Seen()
        self.lock = threading.Lock()
        self.failure: str | None = None
        self._stop = threading.Event()
        self.store.add(f"hb/{member}", 1)
        self.thread = threading.Thread(target=self._run, name="elastic-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def register(self) -> None:
        """Ask to be admitted to the stage (its next record names this member)."""
        k = int(self.store.add("joins", 1))
        self.store.set(f"join/{k}", self.member)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.look()
            except Exception as err:  # noqa: BLE001 — the store is gone: the run is ending or lost
                self.failure = f"{type(err).__name__}: {err}"
                return

    def look(self) -> None:
        """Beat, then read the join count, new requests and the heartbeats of everyone concerned."""
        store = self.store
        store.add(f"hb/{self.member}", 1)
        joins = int(store.add("joins", 0))
        with self.lock:
            known = self.seen.joins
        fresh = {k: store.get(f"join/{k}").decode() for k in range(known + 1, joins + 1)}
        with self.lock:
            self.seen.joins = max(self.seen.joins, joins)
            self.seen.joiners |= fresh
            watched = sorted((set(self.members) | set(self.pending().values())) - {self.member})
        counts = [int(v) for v in store.multi_get([f"hb/{m}" for m in watched])] if watched else []
        now = time.monotonic()
        with self.lock:
            for m, count in zip(watched, counts, strict=True):
                last = self.seen.beats.get(m)
                if last is None or last[0] != count:
                    self.seen.beats[m] = (count, now)

    def lapsed(self, member: str) -> bool:
        """Its heartbeat has not moved for a heartbeat timeout (never seen: not lapsed yet)."""
        with self.lock:
            last = self.seen.beats.get(member)
        return last is not None and time.monotonic() - last[1] > self.heartbeat_s

    def pending(self) -> dict[int, str]:
        """Join requests the current record has not consumed, as the watch has read them (call
        with ``lock`` held)."""
        return {k: m for k, m in self.seen.joiners.items() if k > self.admitted}

    def changed(self) -> bool:
        with self.lock:
            joined = self.seen.joins > self.admitted
        return joined or any(self.lapsed(m) for m in self.members if m != self.member)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2 * self.period + 1.0)


class ControlQuorum:
    """One stage replica's membership (``StageQuorum``'s interface: ``begin``, ``sum``,
    ``should_commit``, ``shutdown``; plus ``settled``, the commit vote's outcome, which
    ``SettlingVote`` hands it). ``store``: the stage's namespace of the run's store (this
    thread's client, counting its requests); ``watch_store``: a second client for the watch;
    ``connector``: who makes the sums' streams; ``joining``: a process that takes a slot mid-run
    (healed by a member)."""

    def __init__(self, mesh: MeshShape, me: WorkerId, member: str, store: CountingStore, watch_store,
                 connector: StreamConnector, timeouts: ElasticTimeouts, min_replicas: int,
                 state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None], joining: bool):
        self.mesh, self.me, self.member = mesh, me, member
        self.store = store
        self.connector, self.timeouts, self.min_replicas = connector, timeouts, min_replicas
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        self.joining = joining
        self.watch = Watch(watch_store, member, timeouts.heartbeat_s)
        self.watch.register()  # initial members too: the first record is formed from the requests
        self.watch.start()
        self.q = 0  # the number of the record the next begin forms or reuses
        self.members: tuple[str, ...] = ()
        self.framed: FramedCollectives | None = None
        self.broken = False  # a sum of this step failed: the streams are out of step
        self.flagged = False  # a contribution of this step's sums flagged a change
        self.sums = 0  # sums this step
        self.committed: bool | None = None  # the vote's outcome of the last step (None: no vote seen)
        self.formed = 0  # records this member formed or joined (the slow path taken)
        self.requests: dict[int, str] = {}  # join requests read by the slow path

    # --- the interface the ElasticDriver calls ------------------------------------------------

    def begin(self) -> QuorumStep:
        started, before = time.monotonic(), self.store.requests
        fast = (self.members and self.committed is True and not self.flagged and not self.broken
                and self.sums > 0)
        intact = self.framed is not None and not self.broken
        self.broken, self.flagged, self.sums, self.committed = False, False, 0, None
        if not fast:
            if self.joining:
                self._join()
                self.joining = False
            else:
                self._form(intact)
            self.formed += 1
        self.q += 1
        return QuorumStep(len(self.members), time.monotonic() - started,
                          requests=self.store.requests - before)

    def sum(self, flat: torch.Tensor) -> bool:
        """``flat`` ← its sum over the record's members, added in replica order (the same bits
        everywhere); False if a member's contribution did not arrive (the step must not commit)."""
        parts = self.gather(flat)
        if parts is None:
            return False
        flat.copy_(torch.stack(parts).sum(0).view_as(flat).to(flat.device))
        return True

    def gather(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """Every member's ``flat`` (flattened, on the CPU), in replica order (``members``); None if
        a member's contribution did not arrive (the step must not commit). What a robust rule
        (``dp.robust``) reduces: every member receives every contribution over the same streams
        the sum uses."""
        if self.broken:
            return None
        self.sums += 1
        flag = torch.tensor([1.0 if self.watch.changed() else 0.0], dtype=flat.dtype)
        payload = torch.cat([flat.detach().reshape(-1).cpu(), flag])
        try:
            parts = self.framed.all_gather(payload, self._ranks(), "sum") if self.framed else [payload]
        except (Lost, Refused):
            self.broken = True
            return None
        self.flagged |= any(float(p[-1]) != 0.0 for p in parts)
        return [p[:-1] for p in parts]

    def member_workers(self) -> list[WorkerId]:
        """The record's members (slots), in replica order: whose rows ``gather`` returns."""
        return [member_worker(m) for m in self.members]

    def should_commit(self) -> bool:
        return not self.broken

    def settled(self, committed: bool) -> None:
        self.committed = committed

    def unchanged(self) -> bool:
        """Whether the next step may keep this record, as far as this member knows after its sums:
        none failed and none flagged a change (the peer vote's ``steady``)."""
        return not self.flagged and not self.broken and self.sums > 0

    def shutdown(self) -> None:
        self.watch.stop()
        if self.framed is not None:
            self.framed.close(wait_s=0.5)

    # --- the slow path: a new record -------------------------------------------------------------

    def _ranks(self) -> list[int]:
        return [self.mesh.rank(member_worker(m)) for m in self.members]

    def _form(self, intact: bool) -> None:
        """Arrive at record ``q`` (saying whether this member's streams are ``intact``: all its
        sums went through); fix it when complete (or adopt another member's); then streams and
        healing as it says."""
        base, store = f"at/{self.q}", self.store
        store.set(f"{base}/in/{self.member}", "1" if intact else "0")
        now = time.monotonic()
        join_end, end = now + self.timeouts.join_s, now + self.timeouts.quorum_s
        while not store.check([base]):
            record = self._complete(base, time.monotonic() > join_end)
            if record is not None:
                store.compare_set(base, "", json.dumps(record))
                break
            self._give_up_after(end)
            time.sleep(self.watch.period / 4)
        self._adopt(json.loads(store.get(base).decode()))

    def _complete(self, base: str, late: bool) -> dict | None:
        """The record to fix now, or None: a member of the last record (initial members at the
        first) that is alive has not arrived yet, or fewer than ``min_replicas`` would be in it."""
        watch = self.watch
        pending = self._requests()
        first = self.q == 0  # the initial members: every one arrives, none is healed
        expected = [m for m in (pending.values() if first else self.members) if not watch.lapsed(m)]
        arrived = {m: self.store.get(f"{base}/in/{m}").decode() for m in expected
                   if self.store.check([f"{base}/in/{m}"])}
        if len(arrived) < len(expected) and not late:
            return None
        joiners = [] if first else [m for m in pending.values() if not watch.lapsed(m)]
        members = sorted(set(arrived) | set(joiners), key=lambda m: member_worker(m).replica)
        if len(members) < self.min_replicas:
            return None
        keep = (not first and tuple(members) == self.members and all(v == "1" for v in arrived.values()))
        donor = next((m for m in members if m in self.members), None)
        return {"q": self.q, "members": members, "joins": max(pending, default=watch.admitted),
                "keep": keep, "donor": donor, "healed": [m for m in joiners if m in members]}

    def _requests(self) -> dict[int, str]:
        """The join requests beyond the last record's, read here (the watch may not have seen the
        latest yet: at the first record, every initial member's must be in)."""
        joins = int(self.store.add("joins", 0))
        for k in range(self.watch.admitted + 1, joins + 1):
            if k not in self.requests:
                self.requests[k] = self.store.get(f"join/{k}").decode()
        return {k: m for k, m in self.requests.items() if k > self.watch.admitted}

    def _give_up_after(self, end: float) -> None:
        if time.monotonic() > end:
            raise WorkerFailure(f"the quorum of stage {self.me.stage} did not form within "
                                f"elastic.quorum_timeout_s = {self.timeouts.quorum_s:.1f} s "
                                f"(noticed by {self.me})")
        if self.watch.failure is not None:
            raise WorkerFailure(f"worker {self.me} lost the run's control service: {self.watch.failure}")

    def _join(self) -> None:
        """A joiner: wait for a record that names it (``latest``), then be healed there."""
        end = time.monotonic() + self.timeouts.quorum_s
        while True:
            if self.store.check(["latest"]):
                q = int(self.store.get("latest").decode())
                record = json.loads(self.store.get(f"at/{q}").decode())
                if self.member in record["members"]:
                    self.q = q
                    self._adopt(record)
                    return
            self._give_up_after(end)
            time.sleep(self.watch.period / 4)

    def _adopt(self, record: dict) -> None:
        if self.member not in record["members"]:
            raise WorkerFailure(f"worker {self.me} was left out of stage {self.me.stage}'s quorum "
                                f"{record['q']} (it arrived after elastic.join_timeout_s)")
        self.store.set("latest", str(record["q"]))
        self.members = tuple(record["members"])
        with self.watch.lock:
            self.watch.members, self.watch.admitted = self.members, record["joins"]
        if not record["keep"]:
            if self.framed is not None:
                self.framed.close(wait_s=0.5)
            self.framed = None
            try:
                self.framed = self._connect(record["q"]) if len(self.members) > 1 else None
            except (TimeoutError, dist.DistStoreError) as err:  # (a peer's address never posted)
                if self.member in record["healed"]:
                    raise WorkerFailure(f"worker {self.me} could not join: {err}") from None
                # A member never connected (a joiner that died after it asked): this step fails
                # everywhere, and the next record leaves it out once its heartbeat lapses.
                self.broken = True
                return
        if record["healed"] and (self.member == record["donor"] or self.member in record["healed"]):
            self._heal(record)

    def _connect(self, q: int) -> FramedCollectives:
        """Streams between every ordered pair of the record's members, on a channel of its own."""
        return all_pairs(self.connector, self.mesh, self.me, [member_worker(m) for m in self.members],
                         f"quorum-s{self.me.stage}-q{q}", self.timeouts.quorum_s, self.timeouts.collective_s)

    def _heal(self, record: dict) -> None:
        """The donor sends its state to the record's joiners; each joiner loads it."""
        donor = self.mesh.rank(member_worker(record["donor"]))
        ranks = [donor] + [self.mesh.rank(member_worker(m)) for m in record["healed"]]
        source = f"the healing state from {record['donor']}"
        try:
            if self.member == record["donor"]:
                state = encode_state({"q": record["q"], "state": self.state_dict()})
                blob = torch.frombuffer(bytearray(state), dtype=torch.uint8)
                self.framed.broadcast_bytes(blob, donor, ranks, blob.numel())  # a joiner gone by
                return  # now fails the step's sums, not the donor
            bound = own_bound(self.state_dict)()
            blob = self.framed.broadcast_bytes(None, donor, ranks, bound)
        except (Lost, Refused) as err:
            raise WorkerFailure(f"worker {self.me}: {source} did not arrive ({err})") from None
        message = decode_state(blob.numpy().tobytes(), source, bound, device="cpu")
        if not isinstance(message, dict) or message.get("q") != record["q"] or \
                not isinstance(message.get("state"), dict):
            raise CheckpointError(source, f"not the state of quorum {record['q']}")
        self.load_state_dict(message["state"])


class SettlingVote:
    """The commit vote, telling the quorum its outcome (every process adopts the same one: the
    fast path's condition). Otherwise the vote it wraps as it is (``PeerVote``)."""

    def __init__(self, vote, quorum: ControlQuorum):
        self.vote, self.quorum = vote, quorum

    def decide(self, step: int, me: WorkerId, participants: int, ok: bool) -> bool:
        committed = self.vote.decide(step, me, participants, ok)
        self.quorum.settled(committed)
        return committed

    def close(self) -> None:
        self.vote.close()

