"""The anchor circuit in the simulator: clean gradients on stale weights, on resources of its own.

An anchor replica z holds the same P stages as a fast replica. A pass (``AnchorCircuit.run_pass``)
is handed the weights of some step t and the ids of step t's batch (replica 0's share, as the fast
circuit cut it into microbatches). The weights are either the ones every fast replica agrees on
(``anchor.weights = outer``: the anchor has followed them by listening, fast replica 0 relaying
the reduced result of each DP round of its stage, ``listen``, so only the ids travel at the
hand-off) or fast replica 0's
current ones, one snapshot per stage sent from its stage s over the anchor's own link
(``snapshot``). It runs a GPipe forward/backward through its stages with nothing masked: each
boundary carries the whole activation (and the whole gradient back) in ``anchor.wire_dtype``. It
takes no optimizer step: its output is the gradient of the mean loss w.r.t. the targeted matrices
of every stage ("geometry, not an update"). Each anchor stage sends every fast replica of its stage
either those gradients (``anchor.send = gradients``) or, from the EMA it keeps of them, the top-r
factors of its thin SVD (``factors``, anchor/factors.py).

The arithmetic is real (``anchor_gradients``); time is virtual. Compute is charged by the run's
compute model on the anchor stage's own clock, messages on the anchor's own links (anchor stage
s → s ± 1, fast (0, s) → anchor (z, s) for the hand-off and the listening, anchor (z, s) → fast
(r, s) for the shares), so nothing here touches a fast worker's clock or link: with a queue per
link (``links.access = off``) the fast circuit is never delayed. With one uplink per participant
(``links.access = uplink``: ``uplink`` is the network's) every link leaves its sender's uplink,
so fast (0, s)'s hand-off and relay wait behind, and delay, its own PP and DP sends, and each
anchor stage's sends share the anchor stage's uplink. Bytes are counted here, apart from the run's
``bytes_pp`` and ``bytes_dp``.

``CostAnchorCircuit`` is the same circuit without the arithmetic (the planner's cost-only runs).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from meshlearn.anchor.factors import AnchorEMA, basis_on_wire, factor_bytes
from meshlearn.mesh.compute import ComputeModel, stage_shape
from meshlearn.mesh.network import Link, LinkProfile, Uplink
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder
from meshlearn.optim.spectral import AnchorBasis

WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def on_wire(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` as the receiver holds it after a trip in ``dtype`` (fp32 again, rounded if narrower)."""
    return x.detach().to(dtype).to(torch.float32)


@dataclass
class PassCompute:
    """What a pass computed: per stage the targeted gradients, and the measured seconds of each
    microbatch's forward and backward (the compute model's ``measured`` mode uses them)."""

    grads: list[dict[str, Tensor]]
    forward_s: list[list[float]]  # [stage][microbatch]
    backward_s: list[list[float]]
    boundary_numel: list[int]  # elements of each microbatch's activation at a boundary


def anchor_gradients(modules: list[Decoder], batches: list[tuple[Tensor, Tensor]],
                     targets: list[list[str]], wire: torch.dtype) -> PassCompute:
    """The unmasked gradient of the mean loss over ``batches`` (equal-sized microbatches, as the fast
    circuit cuts them) w.r.t. each stage's ``targets``, the stages chained like a pipeline: every
    boundary tensor, forward and backward, goes through ``on_wire``. With an fp32 wire it is the
    unsplit model's gradient on the concatenated batch."""
    for module in modules:
        module.zero_grad(set_to_none=True)
    stages = len(modules)
    forward_s = [[] for _ in modules]
    backward_s = [[] for _ in modules]
    numel = []
    for x, y in batches:
        inputs, outputs = [], []
        h = x
        for s, module in enumerate(modules):
            if s > 0:
                h = on_wire(h, wire).requires_grad_(True)
            inputs.append(h)
            started = time.perf_counter()
            out = module(h)
            forward_s[s].append(time.perf_counter() - started)
            outputs.append(out)
            h = out
        numel.append(outputs[0].numel() if stages > 1 else 0)
        loss = Decoder.loss(outputs[-1], y) / len(batches)  # the mean over the microbatches
        grad = None
        for s in reversed(range(stages)):
            started = time.perf_counter()
            if s == stages - 1:
                loss.backward()
            else:
                outputs[s].backward(grad)
            backward_s[s].append(time.perf_counter() - started)
            if s > 0:
                grad = on_wire(inputs[s].grad, wire)
    grads = []
    for module, names in zip(modules, targets, strict=True):
        params = dict(module.named_parameters())
        grads.append({n: params[n].grad.detach().clone() for n in names if params[n].grad is not None})
    for module in modules:
        module.zero_grad(set_to_none=True)
    return PassCompute(grads, forward_s, backward_s, numel)


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
    """Z anchor replicas × P stages on their own clocks and links; see the module docstring.

    ``modules``: one stage module per stage, copied (the anchor never shares a fast worker's
    tensors); ``targets``: per stage, the names of the matrices whose gradients it sends;
    ``replicas``: D, the fast replicas each stage sends to.
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
    ema: dict[WorkerId, AnchorEMA] = field(default_factory=dict)  # per anchor stage (send = factors)
    clock: dict[WorkerId, float] = field(default_factory=dict)  # when each anchor stage is free
    busy_s: dict[WorkerId, float] = field(default_factory=dict)
    links: dict[tuple[WorkerId, WorkerId], Link] = field(default_factory=dict)
    bytes: AnchorBytes = field(default_factory=AnchorBytes)
    turn: int = 0  # the anchor replica that takes the next pass
    passes: int = 0

    def __post_init__(self) -> None:
        self.modules = [copy.deepcopy(m) for m in self.modules]
        for z in range(self.anchors):
            for s in range(len(self.modules)):
                self.clock.setdefault(self.anchor_id(z, s), 0.0)
                self.busy_s.setdefault(self.anchor_id(z, s), 0.0)
                self.ema.setdefault(self.anchor_id(z, s), AnchorEMA(self.beta, self.rank))

    @property
    def stages(self) -> int:
        return len(self.modules)

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

    @torch.no_grad()
    def _load(self, weights: list[dict[str, Tensor]], dtype: torch.dtype) -> list[int]:
        """Put the weights into the anchor's stages; their bytes on the hand-off link per stage.
        A snapshot arrives rounded to the wire dtype; the outer weights the anchor follows itself
        (exactly: it applies the same update as the replicas), and nothing travels."""
        snapshot = self.weights == "snapshot"
        sizes = []
        for module, state in zip(self.modules, weights, strict=True):
            params = dict(module.named_parameters())
            for name, value in state.items():
                params[name].copy_(on_wire(value, dtype) if snapshot else value)
            sizes.append(sum(v.numel() for v in state.values()) * dtype.itemsize if snapshot else 0)
        return sizes

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
        dtype = WIRE[self.wire]
        P, M = self.stages, len(batches)
        me = [self.anchor_id(z, s) for s in range(P)]
        ids_bytes = 8 * sum(x.shape[0] for x, _ in batches)  # one offset per sequence, not its tokens
        free = []
        for s, nbytes in enumerate(self._load(weights, dtype)):
            nbytes += ids_bytes if s in (0, P - 1) else 0
            self.bytes.snapshot += nbytes
            link = self.link(WorkerId(0, s), me[s])
            # Nothing to send (outer weights, a middle stage): ready once the listening is in.
            ready = link.transmit(sent_at[s], nbytes) if nbytes else link.last_arrival
            free.append(max(self.clock[me[s]], ready))
        done = self._compute(batches, dtype)
        shapes = [stage_shape(m) for m in self.modules]
        micro = batches[0][0].shape[0]

        def run(s: int, kind: str, m: int, ready: float) -> float:
            measured = (done.forward_s if kind == "F" else done.backward_s)[s][m]
            seconds = self.compute.compute_s(shapes[s], kind, micro, measured)
            start = max(free[s], ready)
            free[s] = start + seconds
            self.busy_s[me[s]] += seconds
            return free[s]

        # GPipe: every forward, then every backward; a stage's work is served in order.
        act = [[0.0] * M for _ in range(P)]
        for m in range(M):
            for s in range(P):
                end = run(s, "F", m, act[s][m])
                if s + 1 < P:
                    nbytes = done.boundary_numel[m] * dtype.itemsize
                    self.bytes.boundary += nbytes
                    act[s + 1][m] = self.link(me[s], me[s + 1]).transmit(end, nbytes)
        grad = [[0.0] * M for _ in range(P)]
        arrival: dict[WorkerId, float] = {}
        for m in range(M):
            for s in reversed(range(P)):
                end = run(s, "B", m, grad[s][m])
                if s > 0:
                    nbytes = done.boundary_numel[m] * dtype.itemsize
                    self.bytes.boundary += nbytes
                    grad[s - 1][m] = self.link(me[s], me[s - 1]).transmit(end, nbytes)
        received = []
        for s in range(P):
            nbytes = self.share_bytes(done.grads[s])
            if self.send == "factors":  # the stage's own EMA, its top-r factors on the wire
                bases = self.ema[me[s]].fold(done.grads[s])
                received.append({n: basis_on_wire(b, dtype) for n, b in bases.items()})
            else:
                received.append({n: on_wire(g, dtype) for n, g in done.grads[s].items()})
            for r in range(self.replicas):
                if self.send == "factors":
                    self.bytes.factors += nbytes
                else:
                    self.bytes.gradients += nbytes
                arrival[WorkerId(r, s)] = self.link(me[s], WorkerId(r, s)).transmit(free[s], nbytes)
            self.clock[me[s]] = free[s]
        return AnchorPass(z, step, received, arrival)

    def _compute(self, batches: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> PassCompute:
        """The pass's arithmetic, on the stages' own device (the batch comes on CPU)."""
        device = next(self.modules[0].parameters()).device
        batches = [(x.to(device), y.to(device)) for x, y in batches]
        return anchor_gradients(self.modules, batches, self.targets, dtype)

    def share_bytes(self, grads: dict[str, Tensor]) -> int:
        """Wire bytes of one stage's share to one fast replica: each targeted matrix's top-r
        factors (``send = factors``) or the matrix itself, in ``wire``."""
        itemsize = WIRE[self.wire].itemsize
        if self.send == "factors":
            return sum(factor_bytes(tuple(g.shape), self.rank, itemsize) for g in grads.values())
        return sum(g.numel() for g in grads.values()) * itemsize

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
            self.ema[WorkerId.parse(w)].load_state(ema)


@dataclass
class CostAnchorCircuit(AnchorCircuit):
    """The anchor circuit in cost-only mode (``meshlearn plan``): ``modules`` on the meta device,
    and a pass whose forward/backward do no arithmetic (meta tensors through autograd cost
    seconds per pass at a 1B shape). Everything else — the hand-off and relay, the GPipe timing
    on the anchor's clocks, every byte on its links and uplinks, the EMA and factors (their
    shapes) — is ``AnchorCircuit``'s own code. ``d_model``: the boundary's width."""

    d_model: int = 0

    def _compute(self, batches: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> PassCompute:
        """What ``anchor_gradients`` yields, by shape: each target's gradient (meta), no measured
        seconds (the device model charges the compute), a boundary tensor of micro × seq × d."""
        stages, micro, seq = len(self.modules), *batches[0][0].shape
        grads = []
        for module, names in zip(self.modules, self.targets, strict=True):
            params = dict(module.named_parameters())
            grads.append({n: torch.empty_like(params[n], device="meta") for n in names})
        zeros = [[0.0] * len(batches) for _ in self.modules]
        numel = [micro * seq * self.d_model if stages > 1 else 0 for _ in batches]
        return PassCompute(grads, zeros, [list(z) for z in zeros], numel)
