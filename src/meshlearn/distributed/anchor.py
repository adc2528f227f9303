"""The anchor circuit under ``backend = dist``: Z × P anchor processes with links of their own.

The anchor stage actors (``anchor/actor.py``) that the simulator hosts on virtual clocks
(``anchor/circuit.py``), hosted here in real processes; this module is the process and transport
glue. Anchor replica z's stage s is rank D·P + z·P + s (``groups.rank_of``); its actor holds stage
s's module and nothing else (no optimizer: its gradient is "geometry, not an update"). Its links,
each a two-rank group (``groups.anchor_link_list``): the snapshot fast (0, s) → anchor (z, s), the
anchor pipeline (z, s) ↔ (z, s ± 1), and the gradients anchor (z, s) → fast (r, s) for every fast
replica r. Every sender paces its messages to
the anchor links' profile (``anchor.bandwidth_mbit`` / ``latency_ms``), as the simulator's links.

A pass, for hand-off step t (t = 0, K, 2K, ... < train.steps; anchor replica (t / K) mod Z):

1. at its step t − 1's end (t = 0: before the first step) fast worker (0, s) sends its stage's
   weights in ``anchor.wire_dtype`` (``anchor.weights = snapshot``); stages 0 and P − 1 add the
   ids of replica 0's share of step t's batch (8 bytes per sequence: their start offsets, never
   the tokens). Under ``anchor.weights = outer`` no weights travel at the hand-off (only the ids):
   every anchor stage has followed the weights its stage's replicas agree on by listening — at
   each of its step ends fast (0, s) relays to every anchor replica's stage s the tensors of the
   agreed weights that changed (the DP strategy's ``agreed_weights``, or the live ones, which a
   non-drifting strategy keeps common), exact in fp32 (``WeightRelay``). The simulator models that
   relay as the size of the DP round's reduced result (``anchor/plugin.py: relay_bytes``); the two
   are equal under the all-reduce and uncompressed DiLoCo, and under a compressing strategy the
   fp32 tensors are larger than the reduced result (docs/adaptation.md);
2. the anchor stages' actors run GPipe over the fast circuit's microbatches, nothing masked:
   every boundary carries the whole activation forward and the whole gradient back in the wire
   dtype (``AnchorStage`` hands each actor the event it awaits and sends what it returns);
3. each anchor stage sends every fast replica of its stage, for its targeted matrices (the mean
   loss over the share, as the fast circuit normalizes it), the gradients (``anchor.send =
   gradients``) or the top-r factors of the EMA of them it keeps itself (``factors``): the
   actor's ``Share``, one message.

The fast side (``AnchorClient``) never waits for any of it: the driver calls ``step_end`` when its
worker has applied a step's updates; it takes what has already arrived (a non-blocking poll of its
own transport, apart from the pipeline's), hands each share due (now ≥ t + K) to the worker's
spectral correction (``receive_basis`` for factors, ``receive_anchor`` for gradients), and drops
one still missing ``anchor.max_late`` steps past its due step: the simulator's rule
(``anchor.actor.FastSide``), with "arrived by the worker's clock" read on the wall clock. At the end a worker
neither drains its anchor links nor waits for a pass in flight. The anchor processes end when
every worker has finished (their ``done`` keys).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import NoReturn

import torch
from torch import Tensor

from meshlearn.anchor.actor import (
    WIRE,
    Activation,
    AnchorStageActor,
    Compute,
    FastSide,
    Fate,
    HandOff,
    RealMath,
    Send,
    decode_share,
)
from meshlearn.anchor.factors import AnchorEMA
from meshlearn.anchor.settings import link_profile, stage_targets
from meshlearn.compress.codecs import Encoded
from meshlearn.data import batch_offsets, shard_batch, windows
from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.groups import Link, anchor_id, build_groups, rank_of
from meshlearn.distributed.health import Health, WorkerFailure, run_and_exit, store_client
from meshlearn.distributed.shaping import Pacer
from meshlearn.distributed.transport import Transport
from meshlearn.distributed.wire import HEADER_ROOM, PREFIX_BYTES, message_bound
from meshlearn.hooks import Callback, PluginContext
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Link as LinkModel
from meshlearn.mesh.network import LinkProfile, build_network
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder
from meshlearn.optim.spectral import SpectralCorrection

POLL_S = 0.05  # how often an anchor stage waiting for a message looks at liveness and the end
# A posted receive on an anchor link may wait as long as the link is slow: the run's end and the
# heartbeats bound it, not a message deadline (this is only the transport's backstop).
WAIT_S = 7 * 24 * 3600.0
IDS = "__ids__"  # the batch ids' tensor in a snapshot (no parameter is named so)


def hand_offs(cfg) -> list[int]:
    """Every hand-off step of the run, in order: 0, K, 2K, ... below train.steps."""
    return list(range(0, cfg.train.steps, cfg.anchor.delay))


def passes_of(cfg, z: int) -> list[int]:
    """The hand-off steps anchor replica z takes (round-robin over Z)."""
    return [t for i, t in enumerate(hand_offs(cfg)) if i % cfg.anchor.z == z]


def anchor_profile(cfg, mesh: MeshShape) -> LinkProfile:
    """The anchor links' profile, as the simulator's (``anchor.settings.link_profile``)."""
    network = build_network(cfg.link, cfg.links, mesh, cfg.seed)
    return link_profile(network.axes.get("pp", network.default), cfg.anchor)


def capacity(cfg) -> int:
    """Receive buffers of the anchor links: one microbatch's fp32 activation plus header room;
    snapshots and gradient shares are larger and take the transport's oversize path."""
    micro = cfg.train.batch_size // cfg.mesh.replicas // cfg.mesh.microbatches
    return PREFIX_BYTES + HEADER_ROOM + micro * cfg.model.seq_len * cfg.model.d_model * 4


def build_transport(cfg, me: WorkerId, mesh: MeshShape, links: dict[Link, object], health: Health,
                    device: torch.device, stage_params: int) -> Transport:
    """A transport over this process's anchor links, every send paced to the anchor profile with
    the simulator's per-link seeded stream (``stage_params``: this stage's, which bounds what a
    snapshot or gradient share may announce)."""
    profile, epoch = anchor_profile(cfg, mesh), time.monotonic()
    shaped = cfg.dist.shaping == "sender"
    pacers = {dst: Pacer(LinkModel(src, dst, "anchor", profile,
                                   random.Random(f"{cfg.seed}:anchor:{src}->{dst}")), epoch, shaped)
              for src, dst in links if src == me}
    return Transport(me, mesh, links, pacers, device, health, WAIT_S, message_bound(cfg, stage_params))


def message(kind: str, step: int, microbatch: int, src: WorkerId, dst: WorkerId,
            tensors: dict[str, Tensor]) -> Message:
    return Message(kind, step, microbatch, src, dst, Encoded(tensors, (), torch.float32))


def listens(cfg) -> int:
    """Relays of the agreed weights on each hand-off link (``anchor.weights = outer``): one at every
    step end of fast replica 0, the simulator's ``AnchorPlugin._listen``; 0 under snapshots."""
    return cfg.train.steps if cfg.anchor.weights == "outer" else 0


class WeightRelay:
    """Fast (0, s)'s side of ``anchor.weights = outer``: at each step end, the tensors of its
    stage's agreed weights that changed since the last relay, fp32 (exact: the anchor computes on
    the weights the replicas agree on, as in the simulator), to every anchor replica's stage s.
    The relay is sent even when nothing changed, so each anchor stage knows how many arrive."""

    def __init__(self, worker, anchors: list[WorkerId]):
        self.worker, self.anchors = worker, anchors
        self.last: dict[str, Tensor] = {}  # what the anchor stages hold, by name
        self.bytes = 0

    def start(self) -> None:
        """Before the first step: the anchor stages built the same initial weights."""
        self.last = {n: v.to(torch.float32, copy=True) for n, v in self._agreed().items()}

    def after_step(self, step: int, send) -> None:
        changed = {n: v.to(torch.float32, copy=True) for n, v in self._agreed().items()
                   if n not in self.last or not torch.equal(v.to(torch.float32), self.last[n])}
        self.last.update(changed)
        for z, dst in enumerate(self.anchors):
            out = message("anchor_listen", step, z, self.worker.id, dst, changed)
            self.bytes += out.wire_bytes
            send(out)

    def _agreed(self) -> dict[str, Tensor]:
        """The agreed weights as they stand (not copied: ``relay`` copies only what changed)."""
        dp = self.worker.dp
        agreed = dp.agreed_weights() if dp is not None else None
        return agreed or {n: p.detach() for n, p in self.worker.module.named_parameters()}


class Follower:
    """An anchor stage's side of ``anchor.weights = outer``: the agreed weights as the relays of
    fast step ends leave them, one fp32 copy into which each relay is folded when it arrives, in
    step order, up to the step before this stage's next pass (so memory is that copy, not one per
    relay buffered until the pass); a relay for a later step is held until that pass has begun
    (only an anchor more than a pass behind holds any)."""

    def __init__(self, module: Decoder):
        self.weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        self.folded = 0  # the relays of fast step ends 0 .. folded − 1 are in ``weights``
        self.until: int | None = 0  # fold relays of steps below this (None: every one)
        self.held: dict[int, Message] = {}

    def arrive(self, relay: Message) -> None:
        self.held[relay.step] = relay
        self._fold()

    def aim(self, until: int | None) -> None:
        """Fold what has arrived, and what arrives from now on, up to step ``until`` − 1."""
        self.until = until
        self._fold()

    def _fold(self) -> None:
        while (self.until is None or self.folded < self.until) and self.folded in self.held:
            for name, value in self.held.pop(self.folded).payload.tensors.items():
                self.weights[name].copy_(value)
            self.folded += 1


class AnchorClient:
    """A fast worker's side of the anchor circuit; see the module docstring. ``links``: this
    worker's anchor links (``Groups.anchor_links``)."""

    def __init__(self, cfg, worker, links: dict[Link, object], health: Health, device: torch.device,
                 run_dir: Path):
        self.cfg, self.a = cfg, cfg.anchor
        self.worker = worker
        self.me = worker.id
        self.mesh = worker.mesh
        self.dtype = WIRE[self.a.wire_dtype]
        self.transport = build_transport(cfg, self.me, self.mesh, links, health, device, worker.n_params)
        for z in range(self.a.z):
            self.transport.expect_link((anchor_id(self.mesh, z, self.me.stage), self.me),
                                       len(passes_of(cfg, z)), capacity(cfg))
        self.arrived: dict[int, dict] = {}  # hand-off step → its share (gradients or bases), until used
        self.outstanding: list[int] = []  # hand-offs made whose share is neither folded nor dropped
        self.settled: set[int] = set()  # folded or dropped: a later arrival is ignored
        self.fast = FastSide(self.a.delay, self.a.max_late, self.a.send, self.a.use)
        self.run_dir = run_dir  # the corpus (and a BPE tokenizer's cache) for the batch ids
        self.train_tokens = None
        self.started = False
        self.relay = (WeightRelay(worker, [anchor_id(self.mesh, z, self.me.stage) for z in range(self.a.z)])
                      if listens(cfg) and self.me.replica == 0 else None)

    # --- the driver's calls ------------------------------------------------------------------

    def step_start(self, step: int) -> None:
        """Before the first step: the hand-off of step 0."""
        if not self.started:
            self.started = True
            if self.relay is not None:
                self.relay.start()
            self._hand_off(step)

    def step_end(self, step: int) -> None:
        """This worker applied step ``step``'s updates: fold in, drop, and hand off the next."""
        now = step + 1  # the next step to run: what arrived by now is used from its update on
        self._poll()
        kept = []
        for t in sorted(self.outstanding):
            fate = self.fast.settle(now, t, t in self.arrived)  # the simulator's rule (FastSide)
            if fate is Fate.WAIT:
                kept.append(t)
                continue
            share = self.arrived.pop(t, None)
            if fate is Fate.DELIVER:
                self.fast.fold(self.worker.spectral, share, t, now)
            else:
                self.fast.drop(self.worker.spectral, t)
            self.settled.add(t)
        self.outstanding = kept
        if self.relay is not None:  # the weights as they stand now, before a hand-off of them
            self.relay.after_step(step, lambda out: self.transport.send(out, capacity(self.cfg)))
        if now % self.a.delay == 0 and now < self.cfg.train.steps:
            self._hand_off(now)

    def close(self) -> None:
        """No drain: a snapshot still held by a slow link, or a pass in flight, is abandoned."""
        self.transport.close()

    # --- inside ------------------------------------------------------------------------------

    def _hand_off(self, step: int) -> None:
        self.outstanding.append(step)
        if self.me.replica != 0:
            return
        z = hand_offs(self.cfg).index(step) % self.a.z
        tensors = {} if self.relay is not None else {  # outer: the anchor holds them already
            n: p.detach().to(self.dtype, copy=True) for n, p in self.worker.module.named_parameters()}
        if self.me.stage in (0, self.mesh.stages - 1):
            tensors[IDS] = torch.from_numpy(self._ids(step))
        dst = anchor_id(self.mesh, z, self.me.stage)
        self.transport.send(message("anchor_weights", step, z, self.me, dst, tensors), capacity(self.cfg))

    def _ids(self, step: int):
        """Replica 0's rows of step ``step``'s batch: their start offsets (int64)."""
        from meshlearn.data.corpus import load_corpus

        cfg = self.cfg
        if self.train_tokens is None:
            self.train_tokens = load_corpus(cfg, self.run_dir).splits.train
        offsets = batch_offsets(self.train_tokens, step, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
        return offsets[: cfg.train.batch_size // cfg.mesh.replicas].astype("int64")

    def _poll(self) -> None:
        """Take every share that has already arrived; never waits."""
        while (item := self.transport.next_message("nothing", self.me, time.monotonic())) is not None:
            if item.kind != "anchor_share":
                raise RuntimeError(f"worker {self.me}: a {item.kind!r} message on an anchor link "
                                   f"from {item.src}")
            if item.step not in self.settled:
                self.arrived[item.step] = decode_share(item.payload.tensors, self.a.send)

    def totals(self) -> list[float]:
        """This worker's counters, in ``TOTALS`` order (summed over the workers for the summary)."""
        c = self.fast.counters
        listen = self.relay.bytes if self.relay is not None else 0
        snapshot = sum(p.link.bytes_sent for p in self.transport.pacers.values()) - listen
        return [c.delivered, c.dropped_late, c.staleness_sum, len(self.outstanding), snapshot, listen]


TOTALS = ("delivered", "dropped_late", "staleness_sum", "pending", "bytes_snapshot", "bytes_listen")


class DistAnchorCallback(Callback):
    """The trainer's view of the anchor circuit under dist: its summary (the fold-ins happen in
    the driver, at each of the worker's step ends). Counters are summed over the worker
    processes; the anchors' passes and bytes come from what they posted on the store."""

    def __init__(self, cfg, driver: DistDriver):
        self.cfg, self.driver = cfg, driver

    def summary(self) -> dict:
        client, mesh = self.driver.anchor, self.driver.mesh
        spectral = client.worker.spectral.summary()
        sums = self.driver.sum_over_workers([*client.totals(), *spectral.values()])
        c = dict(zip(TOTALS, sums[:len(TOTALS)], strict=True))
        store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             self.cfg.dist.init_timeout_s)
        posted = {}
        for z in range(self.cfg.anchor.z):
            for s in range(mesh.stages):
                key = f"anchor/{rank_of(mesh, anchor_id(mesh, z, s))}"
                posted[(z, s)] = json.loads(store.get(key)) if store.check([key]) else {}
        passes = sum(min(posted[(z, s)].get("passes", 0) for s in range(mesh.stages))
                     for z in range(self.cfg.anchor.z))
        boundary = sum(p.get("boundary", 0) for p in posted.values())
        gradients = sum(p.get("gradients", 0) for p in posted.values())
        factors = sum(p.get("factors", 0) for p in posted.values())
        tokens = self.cfg.train.steps * self.cfg.train.batch_size * self.cfg.model.seq_len
        total = c["bytes_snapshot"] + c["bytes_listen"] + boundary + gradients + factors
        out = {"anchor_passes": passes, "anchor_delivered": int(c["delivered"]),
               "anchor_dropped_late": int(c["dropped_late"]), "anchor_pending_at_end": int(c["pending"]),
               "anchor_mean_staleness": c["staleness_sum"] / c["delivered"] if c["delivered"] else None,
               "anchor_bytes_snapshot": int(c["bytes_snapshot"]), "anchor_bytes_boundary": boundary,
               "anchor_bytes_gradients": gradients, "anchor_bytes_factors": factors,
               "anchor_bytes_listen": int(c["bytes_listen"]),
               "bytes_per_token_anchor": total / tokens if tokens else 0.0}
        return out | {k: int(v) for k, v in zip(spectral, sums[len(TOTALS):], strict=True)}


def dist_anchor_plugin(ctx: PluginContext) -> Callback | None:
    """The anchor circuit's trainer plugin in a dist worker process (see ``DistAnchorCallback``):
    the runtime's own plugin, over its own driver (its anchor client and its sums over workers)."""
    if ctx.cfg.anchor.z == 0:
        return None
    if not isinstance(ctx.driver, DistDriver):
        raise RuntimeError("the distributed anchor's callback needs a DistDriver, not "
                           f"{type(ctx.driver).__name__}")
    return DistAnchorCallback(ctx.cfg, ctx.driver)


class AnchorStage:
    """Anchor replica z's stage s as a process: its ``AnchorStageActor`` (anchor/actor.py) on this
    process's transport. It waits for each hand-off, then for the event the actor awaits (buffering
    the others), and carries out the actor's sends and shares; the actor computes."""

    def __init__(self, cfg, me: WorkerId, mesh: MeshShape, module: Decoder, links: dict[Link, object],
                 health: Health, train_tokens, store):
        self.cfg, self.me, self.mesh = cfg, me, mesh
        self.z, self.s = me.replica - mesh.replicas, me.stage
        self.health = health
        self.train_tokens = train_tokens
        self.store = store
        self.rank = rank_of(mesh, me)
        self.transport = build_transport(cfg, me, mesh, links, health, torch.device("cpu"),
                                         sum(p.numel() for p in module.parameters()))
        passes, M = len(passes_of(cfg, self.z)), cfg.mesh.microbatches
        self.transport.expect_link((WorkerId(0, self.s), me), passes + listens(cfg), capacity(cfg))
        self.follower = Follower(module) if listens(cfg) else None
        if self.s > 0:
            self.transport.expect_link((anchor_id(mesh, self.z, self.s - 1), me), passes * M, capacity(cfg))
        if self.s + 1 < mesh.stages:
            self.transport.expect_link((anchor_id(mesh, self.z, self.s + 1), me), passes * M, capacity(cfg))
        self.inbox: dict[tuple[str, int, int], Message] = {}
        self.bytes_boundary = 0
        self.bytes_gradients = 0
        self.bytes_factors = 0
        # send = factors: this stage's own EMA of its gradients, whose top-r factors it sends
        ema = (AnchorEMA(cfg.optim.spectral.beta_anc, cfg.anchor.rank)
               if cfg.anchor.send == "factors" else None)
        targets = stage_targets(cfg, SpectralCorrection(module.named_parameters(), cfg.optim.spectral).params)
        math = RealMath(module, targets, self.s, mesh.stages)
        self.actor = AnchorStageActor(me, mesh.stages, mesh.replicas, math, WIRE[cfg.anchor.wire_dtype], ema)

    @property
    def passes(self) -> int:
        return self.actor.passes

    def run(self) -> None:
        """Every pass of this anchor replica, until the workers have all finished."""
        due = passes_of(self.cfg, self.z)
        for i, t in enumerate(due):
            if self.follower is not None:  # outer: every relay of the fast step ends before t in
                self.follower.aim(t)
                if not self._wait_until(lambda t=t: self.follower.folded >= t):
                    return
            snapshot = self._wait("anchor_weights", t, self.z)
            if snapshot is None or not self._pass(t, snapshot, due[i + 1] if i + 1 < len(due) else None):
                return
            self.store.set(f"anchor/{self.rank}", json.dumps(
                {"passes": self.passes, "boundary": self.bytes_boundary, "gradients": self.bytes_gradients,
                 "factors": self.bytes_factors}))
        self._wait(None, -1, -1)  # nothing more to do: wait for the end

    def _pass(self, t: int, snapshot: Message, after: int | None) -> bool:
        """Pass ``t`` through the actor (``after``: the next pass's step, None: the last); False once
        every worker finished."""
        cfg, M = self.cfg, self.cfg.mesh.microbatches
        tensors = dict(snapshot.payload.tensors)
        ids = tensors.pop(IDS, None)
        batch = None
        if ids is not None:
            x, y = windows(self.train_tokens, ids.numpy(), cfg.model.seq_len)
            batch = shard_batch(x, y, 1, M)[0]
        weights = self.follower.weights if self.follower is not None else tensors  # copied in at once
        actions = self.actor.handle(HandOff(t, M, weights, batch))
        if self.follower is not None:  # the weights are in: from now on fold up to the next pass
            self.follower.aim(after)
        while True:
            for action in actions:
                self._carry_out(t, action)
            want = self.actor.awaiting
            if want is None:
                return True
            arrival = self._wait("anchor_act" if want.kind is Activation else "anchor_grad", t,
                                 want.microbatch)
            if arrival is None:
                return False
            actions = self.actor.handle(want.kind(t, want.microbatch, arrival.payload.tensors["x"]))

    def _carry_out(self, t: int, action) -> None:
        """A ``Send`` or ``Share`` as a message on this stage's links (a ``Compute`` is done)."""
        if isinstance(action, Compute):
            return
        if isinstance(action, Send):
            kind = "anchor_act" if isinstance(action.event, Activation) else "anchor_grad"
            out = message(kind, t, action.event.microbatch, self.me, action.dst, {"x": action.event.x})
            self.bytes_boundary += out.wire_bytes
        else:
            out = message("anchor_share", t, self.z, self.me, WorkerId(action.replica, self.s),
                          action.tensors)
            if self.actor.ema is not None:
                self.bytes_factors += out.wire_bytes
            else:
                self.bytes_gradients += out.wire_bytes
        self.transport.send(out, capacity(self.cfg))

    def _wait(self, kind: str | None, step: int, microbatch: int) -> Message | None:
        """The message (kind, step, microbatch), buffering others; None once every worker finished
        (a pass the fast circuit no longer needs is abandoned)."""
        key = (kind, step, microbatch)
        return self.inbox.pop(key) if self._wait_until(lambda: key in self.inbox) else None

    def _wait_until(self, done) -> bool:
        """Take arrivals (relays to the follower, others into the inbox) until ``done()``; False
        once every worker finished."""
        while not done():
            self.health.check()
            item = self.transport.next_arrival(POLL_S)
            if isinstance(item, Message):
                if item.kind == "anchor_listen" and self.follower is not None:
                    self.follower.arrive(item)
                else:
                    self.inbox[(item.kind, item.step, item.microbatch)] = item
                continue
            if self._workers_done():  # then a closed link or a failed send is no failure
                return False
            if item is not None:  # Broken: a link closed while the workers still run
                raise WorkerFailure(self.health.abort(item.message))
            if (error := self.transport.send_error()) is not None:
                raise WorkerFailure(self.health.abort(error))
        return True

    def _workers_done(self) -> bool:
        return self.store.check([f"done/{rank}" for rank in range(self.mesh.world_size)])


def run_anchor(cfg, run_dir: Path, session) -> NoReturn:
    """An anchor rank's whole life; ends the process (``run_and_exit``)."""
    from meshlearn.assemble import resolve
    from meshlearn.data.corpus import load_corpus
    from meshlearn.distributed.session import train_tokenizer_once
    from meshlearn.models.split import init_model, split_model
    from meshlearn.protocol.model import stage_modules

    me = session.anchor
    name = session.health.name

    def life() -> None:
        nonlocal cfg
        if cfg.data.tokenizer in ("bpe", "model"):
            train_tokenizer_once(cfg, run_dir, session)  # a collective of every rank
        corpus = load_corpus(cfg, Path(run_dir))
        cfg = resolve(cfg, corpus.vocab_size)
        groups = build_groups(cfg, session.mesh, session.rank, connector=session.connector)
        module = stage_modules(cfg, split_model(init_model(cfg.model, cfg.seed), cfg.mesh.stages))[me.stage]
        store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             cfg.dist.init_timeout_s)
        stage = AnchorStage(cfg, me, session.mesh, module, groups.anchor_links, session.health,
                            corpus.splits.train, store)
        print(f"anchor {name} (rank {session.rank}): stage {me.stage} of anchor replica {stage.z}, "
              f"{len(passes_of(cfg, stage.z))} passes due", flush=True)
        stage.run()
        print(f"anchor {name}: done, {stage.passes} passes", flush=True)

    run_and_exit(session.health, f"anchor {name}", f"anchor {name}", life)
