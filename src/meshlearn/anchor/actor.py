"""One anchor stage's protocol, written once as a sans-IO actor, and the fast side's rule.

An anchor replica z holds the same P stages as a fast replica; its stage s is an
``AnchorStageActor``. A runtime hosts it — the simulator as a simulated process on the anchor's own
clocks and links (anchor/circuit.py), ``backend = dist`` as a real process on its own transport
(distributed/anchor.py) — by feeding it events and executing the actions it returns:

    event        from                            what the actor does
    HandOff      fast (0, s): step t's pass       loads the weights handed (none under
                 (weights, and on stages 0 and    ``anchor.weights = outer`` when the host already
                 P − 1 the batch)                 put the agreed ones in), runs its forwards
    Activation   anchor (z, s − 1)                one forward                 → Compute, Send
    Gradient     anchor (z, s + 1)                one backward                → Compute, Send

    action       the host
    Compute      charges (sim) or has spent (dist) the seconds of one forward or backward
    Send         carries an Activation or Gradient, ``nbytes`` on the wire, to the peer stage
    Share        carries this stage's share of the pass, ``nbytes``, to fast replica r of its stage

GPipe over the fast circuit's microbatches: every forward, then every backward, in microbatch
order; nothing masked, every boundary tensor in the wire dtype. ``awaiting`` names the one event
the actor can take next within a pass (None between passes: a HandOff), so a host delivers in
protocol order whatever order the wire brings. After its last backward the stage sends every fast
replica of its stage, for its targeted matrices, the gradient of the mean loss (``anchor.send =
gradients``) or the top-r factors of the EMA of them it keeps (``factors``, anchor/factors.py): the
tensors of one message, in the wire dtype (``decode_share`` reads them back).

The arithmetic is a ``StageMath``: ``RealMath`` (autograd on the stage module; the measured seconds
for the compute model's ``measured`` mode) or ``ShapeMath`` (the planner's cost-only runs: meta
tensors of the right shapes and no arithmetic), one protocol for both.

``FastSide`` is the fast worker's rule, the same under every runtime: a share computed for step t
is folded in at the first step end ``now`` ≥ t + K by which it has arrived, and one still missing
``anchor.max_late`` steps past t + K is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch
from torch import Tensor

from meshlearn.anchor.factors import AnchorEMA, pack, unpack
from meshlearn.mesh.compute import StageShape, stage_shape
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder

WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}
Batch = list[tuple[Tensor, Tensor]]  # the fast circuit's microbatches of replica 0's share


# --- events ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HandOff:
    """Step ``step``'s pass over ``microbatches`` begins: ``weights`` (name → tensor, any dtype:
    copied in; empty when the stage already holds them) and, for stages 0 and P − 1, the ``batch``."""

    step: int
    microbatches: int
    weights: dict[str, Tensor]
    batch: Batch | None


@dataclass(frozen=True)
class Activation:
    """Microbatch ``microbatch``'s activation from the stage below, in the wire dtype."""

    step: int
    microbatch: int
    x: Tensor


@dataclass(frozen=True)
class Gradient:
    """The gradient of microbatch ``microbatch``'s activation from the stage above, wire dtype."""

    step: int
    microbatch: int
    x: Tensor


Event = HandOff | Activation | Gradient


@dataclass(frozen=True)
class Await:
    """The event the actor takes next: its class, step and microbatch."""

    kind: type[Activation] | type[Gradient]
    step: int
    microbatch: int


# --- actions ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Compute:
    """One forward (``F``) or backward (``B``) of ``rows`` sequences through a stage of ``shape``
    (its FLOPs: ``ComputeModel.compute_s``); ``measured_s``: what it took here (0 without math)."""

    kind: str
    step: int
    microbatch: int
    shape: StageShape
    rows: int
    measured_s: float


@dataclass(frozen=True)
class Send:
    """``event`` to anchor stage ``dst``; ``nbytes``: its tensor's bytes on the wire."""

    dst: WorkerId
    event: Activation | Gradient
    nbytes: int


@dataclass(frozen=True)
class Share:
    """This stage's share of pass ``step`` to fast replica ``replica``: ``tensors`` in the wire dtype
    (factors packed, ``factors.pack``), ``nbytes`` of them."""

    replica: int
    step: int
    tensors: dict[str, Tensor]
    nbytes: int


Action = Compute | Send | Share


def wire_bytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_share(tensors: dict[str, Tensor], send: str) -> dict:
    """A share as the fast worker uses it, in fp32: name → ``AnchorBasis`` (factors) or gradient."""
    return unpack(tensors) if send == "factors" else {n: t.to(torch.float32) for n, t in tensors.items()}


# --- the arithmetic --------------------------------------------------------------------------

class StageMath(Protocol):
    """One stage's part of a pass. ``begin`` loads weights and the batch; ``forward`` returns the
    boundary output (None on the last stage, which keeps the loss) and the measured seconds;
    ``backward`` the gradient of its input (None on stage 0); ``gradients`` the targeted matrices'
    gradients, ending the pass."""

    module: Decoder

    def begin(self, weights: dict[str, Tensor], batch: Batch | None, microbatches: int) -> None: ...

    def forward(self, m: int, x: Tensor | None) -> tuple[Tensor | None, float]: ...

    def backward(self, m: int, grad: Tensor | None) -> tuple[Tensor | None, float]: ...

    def gradients(self) -> dict[str, Tensor]: ...


class RealMath:
    """Autograd on ``module`` (stage ``stage`` of ``stages``): the mean loss over the microbatches;
    with an fp32 wire the unsplit model's gradient on the whole batch."""

    def __init__(self, module: Decoder, targets: list[str], stage: int, stages: int,
                 timer: Callable[[], float] = time.perf_counter):
        self.module, self.targets, self.timer = module, targets, timer
        self.first, self.last, self.microbatches = stage == 0, stage == stages - 1, 1
        self.device = next(module.parameters()).device
        self.batch: Batch = []
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []

    @torch.no_grad()
    def _load(self, weights: dict[str, Tensor]) -> None:
        params = dict(self.module.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)  # a wire-dtype snapshot becomes fp32 exactly as received

    def begin(self, weights: dict[str, Tensor], batch: Batch | None, microbatches: int) -> None:
        self.microbatches = microbatches
        self.module.zero_grad(set_to_none=True)
        self._load(weights)
        self.batch = [(x.to(self.device), y.to(self.device)) for x, y in batch or []]
        self.inputs, self.outputs = [], []

    def forward(self, m: int, x: Tensor | None) -> tuple[Tensor | None, float]:
        h = self.batch[m][0] if self.first else x.to(self.device, torch.float32).requires_grad_(True)
        started = self.timer()
        out = self.module(h)
        seconds = self.timer() - started
        self.inputs.append(h)
        if self.last:
            out = Decoder.loss(out, self.batch[m][1]) / self.microbatches  # the mean over them
        self.outputs.append(out)
        return (None if self.last else out.detach()), seconds

    def backward(self, m: int, grad: Tensor | None) -> tuple[Tensor | None, float]:
        started = self.timer()
        if self.last:
            self.outputs[m].backward()
        else:
            self.outputs[m].backward(grad.to(self.device, torch.float32))
        seconds = self.timer() - started
        return (None if self.first else self.inputs[m].grad), seconds

    def gradients(self) -> dict[str, Tensor]:
        params = dict(self.module.named_parameters())
        grads = {n: params[n].grad.detach() for n in self.targets if params[n].grad is not None}
        self.module.zero_grad(set_to_none=True)  # drops the references: ``grads`` stay as they are
        self.inputs, self.outputs = [], []
        return grads


class ShapeMath:
    """``RealMath`` by shape (the planner's cost-only runs, ``module`` on the meta device): a
    boundary of rows × seq × ``d_model``, the targets' gradients as meta tensors, no seconds
    measured (meta tensors through autograd cost seconds per pass at a 1B shape)."""

    def __init__(self, module: Decoder, targets: list[str], stage: int, stages: int, d_model: int):
        self.module, self.targets, self.d_model = module, targets, d_model
        self.first, self.last = stage == 0, stage == stages - 1
        self.batch: Batch = []
        self.rows_seq: list[tuple[int, int]] = []

    def begin(self, weights: dict[str, Tensor], batch: Batch | None, microbatches: int) -> None:
        self.batch, self.rows_seq = batch or [], []

    def _boundary(self, m: int) -> Tensor:
        return torch.empty(*self.rows_seq[m], self.d_model, device="meta")

    def forward(self, m: int, x: Tensor | None) -> tuple[Tensor | None, float]:
        self.rows_seq.append(tuple((self.batch[m][0] if self.first else x).shape[:2]))
        return (None if self.last else self._boundary(m)), 0.0

    def backward(self, m: int, grad: Tensor | None) -> tuple[Tensor | None, float]:
        return (None if self.first else self._boundary(m)), 0.0

    def gradients(self) -> dict[str, Tensor]:
        params = dict(self.module.named_parameters())
        return {n: torch.empty_like(params[n], device="meta") for n in self.targets}


# --- the anchor stage ------------------------------------------------------------------------

class AnchorStageActor:
    """Anchor stage ``me`` = (D + z, s) of ``stages``: GPipe over each pass's microbatches, its share
    to each of ``replicas`` fast replicas; ``ema``: its own EMA under ``send = factors`` (None:
    gradients)."""

    def __init__(self, me: WorkerId, stages: int, replicas: int, math: StageMath, wire: torch.dtype,
                 ema: AnchorEMA | None):
        self.me, self.stages, self.replicas = me, stages, replicas
        self.math, self.wire, self.ema = math, wire, ema
        self.passes = 0  # passes finished
        self._walk: Generator[Await, Event, None] | None = None
        self._out: list[Action] = []
        self.awaiting: Await | None = None

    def takes(self, event: Event) -> bool:
        """Whether ``event`` is the one to handle next (a HandOff between passes, else ``awaiting``)."""
        want = self.awaiting
        if want is None or isinstance(event, HandOff):
            return want is None and isinstance(event, HandOff)
        return (type(event), event.step, event.microbatch) == (want.kind, want.step, want.microbatch)

    def handle(self, event: Event) -> list[Action]:
        """Take ``event`` (``takes`` it: a host buffers the others); the actions now due."""
        if not self.takes(event):
            raise RuntimeError(f"anchor {self.me}: got {type(event).__name__} of step {event.step}, "
                               f"awaiting {self.awaiting or 'a hand-off'}")
        if self.awaiting is None:
            self._walk = self._pass(event)
            self.awaiting = next(self._walk, None)
        else:
            try:
                self.awaiting = self._walk.send(event)
            except StopIteration:
                self.awaiting = None
        out, self._out = self._out, []
        return out

    def _pass(self, hand: HandOff) -> Generator[Await, Event, None]:
        t, s, math = hand.step, self.me.stage, self.math
        below, above = WorkerId(self.me.replica, s - 1), WorkerId(self.me.replica, s + 1)
        math.begin(hand.weights, hand.batch, hand.microbatches)
        shape, rows = stage_shape(math.module), []
        for m in range(hand.microbatches):  # GPipe: every forward, then every backward
            x = None if s == 0 else (yield Await(Activation, t, m)).x
            rows.append((hand.batch[m][0] if s == 0 else x).shape[0])
            out, seconds = math.forward(m, x)
            self._out.append(Compute("F", t, m, shape, rows[m], seconds))
            if s + 1 < self.stages:
                self._send(above, Activation(t, m, out.to(self.wire)))
        for m in range(hand.microbatches):
            grad = None if s + 1 == self.stages else (yield Await(Gradient, t, m)).x
            back, seconds = math.backward(m, grad)
            self._out.append(Compute("B", t, m, shape, rows[m], seconds))
            if s > 0:
                self._send(below, Gradient(t, m, back.to(self.wire)))
        grads = math.gradients()
        tensors = (pack(self.ema.fold(grads), self.wire) if self.ema is not None else
                   {n: g.to(self.wire) for n, g in grads.items()})
        nbytes = wire_bytes(tensors)
        self._out.extend(Share(r, t, tensors, nbytes) for r in range(self.replicas))
        self.passes += 1

    def _send(self, dst: WorkerId, event: Activation | Gradient) -> None:
        self._out.append(Send(dst, event, event.x.numel() * event.x.element_size()))


# --- the fast side ---------------------------------------------------------------------------

class Fate(Enum):
    WAIT = "wait"
    DELIVER = "deliver"
    DROP = "drop"


@dataclass
class AnchorCounters:
    delivered: int = 0  # shares folded in (one per fast worker and pass)
    dropped_late: int = 0  # shares still missing max_late steps past their due step
    staleness_sum: int = 0  # Σ (step folded in − step computed for) over the delivered
    late_max: int = 0  # the most steps past its due step (t + K) a share was delivered at


@dataclass
class FastSide:
    """A fast worker's (or all of them, in the simulator) rule for the shares of passes: ``delay``
    = K, ``max_late``, ``send`` and ``use`` (which receive of the spectral correction takes a
    share)."""

    delay: int
    max_late: int
    send: str
    use: str = "basis"
    counters: AnchorCounters = field(default_factory=AnchorCounters)

    def settle(self, now: int, step: int, arrived: bool) -> Fate:
        """At the step end before step ``now``, the share of pass ``step``: not yet due (or due,
        missing and not yet past the cap) waits; due and arrived is delivered; missing at the
        cap is dropped. Counted here."""
        late = now - (step + self.delay)
        if late < 0:
            return Fate.WAIT
        if arrived and late <= self.max_late:
            self.counters.delivered += 1
            self.counters.staleness_sum += now - step
            self.counters.late_max = max(self.counters.late_max, late)
            return Fate.DELIVER
        if late >= self.max_late:
            self.counters.dropped_late += 1  # not there yet, and next time it would be past the cap
            return Fate.DROP
        return Fate.WAIT

    def fold(self, spectral, share: dict, step: int, now: int) -> None:
        """Hand ``share`` (``decode_share``'s) to a worker's spectral correction: a basis (factors),
        a gradient for its EMA, or under ``anchor.use = error_feedback`` a gradient that becomes
        the delayed correction g_clean − g_masked (optim/error_feedback.py)."""
        if self.send == "factors":
            receive = spectral.receive_basis
        else:
            receive = spectral.receive_correction if self.use == "error_feedback" else spectral.receive_anchor
        for name, value in share.items():
            receive(name, value, step=step, now=now)

    def drop(self, spectral, step: int) -> None:
        """The share of pass ``step`` was dropped: the worker frees what it kept for it (the error
        feedback's masked gradient; nothing otherwise)."""
        spectral.forget(step)
