"""The anchor circuit in the simulator: Z × P anchor stage actors hosted as simulated processes.

An anchor replica z holds the same P stages as a fast replica, each an ``AnchorStageActor``
(anchor/actor.py: the protocol and its arithmetic, written once for every runtime). A pass
(``AnchorCircuit.run_pass``) is handed the weights of some step t and the ids of step t's batch
(replica 0's share, as the fast circuit cut it into microbatches). The weights are either the ones
every fast replica agrees on (``anchor.weights = outer``: the anchor has followed them by
listening, fast replica 0 relaying the reduced result of each DP round of its stage, ``listen``,
so only the ids travel at the hand-off) or fast replica 0's current ones, one snapshot per stage
sent from its stage s over the anchor's own link in ``anchor.wire_dtype`` (``snapshot``).

This module is the actors' host, and the virtual time is its own: it delivers each event when its
link has delivered it, in the order the actor awaits them; an actor's ``Compute`` is charged by the
run's compute model on that anchor stage's own clock, its ``Send`` and ``Share`` on the anchor's own
links (anchor stage s → s ± 1, fast (0, s) → anchor (z, s) for the hand-off and the listening,
anchor (z, s) → fast (r, s) for the shares), so nothing here touches a fast worker's clock or link:
with a queue per link (``links.access = off``) the fast circuit is never delayed. With one uplink
per participant (``links.access = uplink``: ``uplink`` is the network's) every link leaves its
sender's uplink, so fast (0, s)'s hand-off and relay wait behind, and delay, its own PP and DP
sends, and each anchor stage's sends share the anchor stage's uplink. Bytes are counted here,
apart from the run's ``bytes_pp`` and ``bytes_dp``. A pass runs to its end at its hand-off: its
arrival times lie ahead, and the plugin folds each share in once a worker's clock has reached it.

``CostAnchorCircuit`` is the same circuit with the actors' ``ShapeMath`` (the planner's cost-only
runs).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from meshlearn.anchor.actor import (
    WIRE,
    Action,
    AnchorStageActor,
    Compute,
    Event,
    HandOff,
    RealMath,
    Send,
    ShapeMath,
    StageMath,
    decode_share,
)
from meshlearn.anchor.factors import AnchorEMA
from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.network import Link, LinkProfile, Uplink
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder
from meshlearn.optim.spectral import AnchorBasis


@dataclass
class AnchorPass:
    """One pass's result: what each stage sends, and when it reaches each fast worker."""

    replica: int  # z
    step: int  # the step whose weights and batch the pass used
    # per stage, as received (rounded to the wire dtype): name → gradient (send = gradients) or
    # name → its EMA's top-r basis (send = factors)
    shares: list[dict[str, Tensor]] | list[dict[str, AnchorBasis]]
    arrival_s: dict[WorkerId, float]  # per fast worker (r, s): its stage's share fully there


@dataclass
class AnchorBytes:
    snapshot: int = 0  # the hand-off, fast (0, s) → anchor (z, s): the batch ids, and the weights
    # under weights = snapshot
    boundary: int = 0  # activations and their gradients between anchor stages
    gradients: int = 0  # anchor (z, s) → fast (r, s), send = gradients
    factors: int = 0  # anchor (z, s) → fast (r, s), send = factors
    listen: int = 0  # the reduced DP results relayed fast (0, s) → anchor (z, s), weights = outer

    @property
    def total(self) -> int:
        return self.snapshot + self.boundary + self.gradients + self.factors + self.listen


@dataclass
class AnchorCircuit:
    """Z anchor replicas × P stage actors on their own clocks and links; see the module docstring.

    ``modules``: one stage module per stage, copied (the anchor never shares a fast worker's
    tensors; the Z actors of a stage share the copy, a pass running to its end before the next);
    ``targets``: per stage, the names of the matrices whose gradients it sends; ``replicas``: D,
    the fast replicas each stage sends to.
    """

    modules: list[Decoder]
    targets: list[list[str]]
    anchors: int
    replicas: int
    compute: ComputeModel
    profile: LinkProfile
    wire: str = "bf16"
    seed: int = 0
    send: str = "factors"
    rank: int = 64
    beta: float = 0.95
    weights: str = "outer"
    uplink: Callable[[WorkerId], Uplink | None] | None = None  # a sender's access link, if shared
    actors: dict[WorkerId, AnchorStageActor] = field(default_factory=dict)
    clock: dict[WorkerId, float] = field(default_factory=dict)  # when each anchor stage is free
    busy_s: dict[WorkerId, float] = field(default_factory=dict)
    links: dict[tuple[WorkerId, WorkerId], Link] = field(default_factory=dict)
    bytes: AnchorBytes = field(default_factory=AnchorBytes)
    turn: int = 0  # the anchor replica that takes the next pass
    passes: int = 0

    def __post_init__(self) -> None:
        self.modules = [copy.deepcopy(m) for m in self.modules]
        for z in range(self.anchors):
            for s in range(self.stages):
                me = self.anchor_id(z, s)
                self.clock.setdefault(me, 0.0)
                self.busy_s.setdefault(me, 0.0)
                ema = AnchorEMA(self.beta, self.rank) if self.send == "factors" else None
                self.actors[me] = AnchorStageActor(me, self.stages, self.replicas, self._math(s),
                                                   WIRE[self.wire], ema)

    def _math(self, stage: int) -> StageMath:
        """The actors' arithmetic: autograd on the stage's module."""
        return RealMath(self.modules[stage], self.targets[stage], stage, self.stages)

    @property
    def stages(self) -> int:
        return len(self.modules)

    @property
    def ema(self) -> dict[WorkerId, AnchorEMA]:
        """Each anchor stage's own EMA (``send = factors``)."""
        return {me: actor.ema for me, actor in self.actors.items() if actor.ema is not None}

    def anchor_id(self, z: int, stage: int) -> WorkerId:
        """Anchor replica z's stage, numbered after the D fast replicas (they share no id)."""
        return WorkerId(self.replicas + z, stage)

    def link(self, src: WorkerId, dst: WorkerId) -> Link:
        key = (src, dst)
        if key not in self.links:
            self.links[key] = Link(src, dst, "anchor", self.profile,
                                   random.Random(f"{self.seed}:anchor:{src}->{dst}"),
                                   uplink=self.uplink(src) if self.uplink else None)
        return self.links[key]

    def listen(self, sent_at: list[float], nbytes: list[int]) -> None:
        """``weights = outer``: per stage s, ``nbytes[s]`` (the reduced result of fast (0, s)'s DP
        rounds since the last call, relayed at virtual time ``sent_at[s]``) to every anchor
        replica's stage s on the hand-off link: what the anchor needs to apply the replicas'
        update itself. A pass starts on a stage only once its link has delivered all of it."""
        for z in range(self.anchors):
            for s, n in enumerate(nbytes):
                if n:
                    self.bytes.listen += n
                    self.link(WorkerId(0, s), self.anchor_id(z, s)).transmit(sent_at[s], n)

    def run_pass(self, step: int, weights: list[dict[str, Tensor]], sent_at: list[float],
                 batches: list[tuple[Tensor, Tensor]]) -> AnchorPass:
        """Anchor replica ``turn`` computes on ``weights`` (per stage: name → tensor; handed off from
        fast (0, s) at virtual time ``sent_at[s]``) and step ``step``'s ``batches``."""
        z, self.turn = self.turn, (self.turn + 1) % self.anchors
        self.passes += 1
        dtype, P = WIRE[self.wire], self.stages
        snapshot = self.weights == "snapshot"  # outer: the anchor follows them itself, exactly
        ids_bytes = 8 * sum(x.shape[0] for x, _ in batches)  # one offset per sequence, not its tokens
        inbox: dict[WorkerId, list[tuple[Event, float]]] = {}
        for s, state in enumerate(weights):
            me = self.anchor_id(z, s)
            handed = {n: v.detach().to(dtype) for n, v in state.items()} if snapshot else state
            nbytes = sum(v.numel() for v in handed.values()) * dtype.itemsize if snapshot else 0
            nbytes += ids_bytes if s in (0, P - 1) else 0
            self.bytes.snapshot += nbytes
            link = self.link(WorkerId(0, s), me)
            # Nothing to send (outer weights, a middle stage): ready once the listening is in.
            ready = link.transmit(sent_at[s], nbytes) if nbytes else link.last_arrival
            hand = HandOff(step, len(batches), handed, batches if s in (0, P - 1) else None)
            inbox[me] = [(hand, ready)]
        shares: list[dict] = [{} for _ in range(P)]
        arrival: dict[WorkerId, float] = {}
        self._host(inbox, shares, arrival)
        arrival = {WorkerId(r, s): arrival[WorkerId(r, s)] for s in range(P) for r in range(self.replicas)}
        return AnchorPass(z, step, shares, arrival)

    def _host(self, inbox: dict[WorkerId, list[tuple[Event, float]]], shares: list[dict],
              arrival: dict[WorkerId, float]) -> None:
        """Deliver every event to its actor in the order it awaits them, each no earlier than its
        link delivered it, and execute the actions, until the pass is done on every stage."""
        moved = True
        while moved:
            moved = False
            for me, events in inbox.items():
                actor = self.actors[me]
                for i, (event, at) in enumerate(events):
                    if actor.takes(event):
                        del events[i]
                        self.clock[me] = max(self.clock[me], at)
                        for action in actor.handle(event):
                            self._execute(me, action, inbox, shares, arrival)
                        moved = True
                        break
        stuck = [me for me, actor in self.actors.items() if actor.awaiting is not None]
        if stuck:
            raise RuntimeError(f"anchor pass left stages {stuck} waiting")

    def _execute(self, me: WorkerId, action: Action, inbox: dict[WorkerId, list[tuple[Event, float]]],
                 shares: list[dict], arrival: dict[WorkerId, float]) -> None:
        """One action of actor ``me``, at the end of what it computed so far (its clock)."""
        if isinstance(action, Compute):
            seconds = self.compute.compute_s(action.shape, action.kind, action.rows, action.measured_s)
            self.clock[me] += seconds
            self.busy_s[me] += seconds
        elif isinstance(action, Send):
            self.bytes.boundary += action.nbytes
            at = self.link(me, action.dst).transmit(self.clock[me], action.nbytes)
            inbox.setdefault(action.dst, []).append((action.event, at))
        else:  # Share
            fast = WorkerId(action.replica, me.stage)
            if self.send == "factors":
                self.bytes.factors += action.nbytes
            else:
                self.bytes.gradients += action.nbytes
            arrival[fast] = self.link(me, fast).transmit(self.clock[me], action.nbytes)
            if not shares[me.stage]:
                shares[me.stage] = decode_share(action.tensors, self.send)

    def state(self) -> dict:
        return {"clock": {str(w): t for w, t in self.clock.items()},
                "busy_s": {str(w): t for w, t in self.busy_s.items()},
                "links": {f"{s}->{d}": link.state() for (s, d), link in self.links.items()},
                "bytes": vars(self.bytes).copy(), "turn": self.turn, "passes": self.passes,
                "ema": {str(w): ema.state() for w, ema in self.ema.items()}}

    def load_state(self, state: dict) -> None:
        self.clock = {WorkerId.parse(w): t for w, t in state["clock"].items()}
        self.busy_s = {WorkerId.parse(w): t for w, t in state["busy_s"].items()}
        for key, link_state in state["links"].items():
            src, dst = key.split("->")
            self.link(WorkerId.parse(src), WorkerId.parse(dst)).load_state(link_state)
        self.bytes = AnchorBytes(**state["bytes"])
        self.turn, self.passes = state["turn"], state["passes"]
        for w, ema in state["ema"].items():
            if ema:  # under send = gradients no stage keeps one
                self.actors[WorkerId.parse(w)].ema.load_state(ema)


@dataclass
class CostAnchorCircuit(AnchorCircuit):
    """The anchor circuit in cost-only mode (``meshlearn plan``): ``modules`` on the meta device,
    and actors whose arithmetic is ``ShapeMath`` (no arithmetic, the shapes). Everything else —
    the hand-off and relay, the GPipe timing on the anchor's clocks, every byte on its links and
    uplinks, the EMA and factors (their shapes) — is the same actors and host. ``d_model``: the
    boundary's width."""

    d_model: int = 0

    def _math(self, stage: int) -> StageMath:
        return ShapeMath(self.modules[stage], self.targets[stage], stage, self.stages, self.d_model)
