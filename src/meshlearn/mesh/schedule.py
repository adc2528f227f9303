"""Pipeline schedules: which forward (F), backward (B) or update (U) a stage runs next.

A schedule is a per-stage *plan* that the worker consults after every action. Both drivers execute
the same plans; a worker runs its plan in order and waits only for the inputs an action needs (an
activation for F on stages > 0, a gradient for B on stages < P-1, its peers for a collective U).

- ``gpipe`` and ``1f1b`` flush: every step is a fixed table of F/B over the step's microbatches,
  closed by one mesh-wide update U (the data-parallel all-reduce and the global-norm clip happen
  there). They reproduce the unsplit model exactly.
- ``async`` never flushes (PipeDream-style 1F1B): stage s keeps up to ``in_flight`` microbatches
  between forward and backward and applies an update U as soon as the gradients of an update group
  (``update_every`` microbatches) are in. Work flows across step boundaries; only a *drain point*
  the trainer requests (evaluation, checkpoint) stops new forwards until the pipeline is empty.

Microbatch ids are global: microbatch m of step t is ``t · M + m``, so an id names one microbatch of
the whole run and the inbox, stashes and messages are keyed by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple, Protocol

import torch

from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.registry import build_codec
from meshlearn.mesh.compute import ComputeModel, StageShape
from meshlearn.mesh.network import build_run_network
from meshlearn.mesh.topology import WorkerId

Kind = Literal["F", "B", "U"]


class Action(NamedTuple):
    """F = forward of a microbatch, B = its backward, U = an optimizer update.

    ``version`` is the weight version the action uses (F: the weights it runs with; B: those of its
    forward, which weight stashing restores) or, for U, the version it creates. A named tuple:
    a worker names its next action at every event of the simulator, so it is built and
    compared in C.
    """

    kind: Kind
    microbatch: int
    version: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


# --- the synchronous tables ------------------------------------------------------------------


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    """All forwards, then all backwards in reverse order (peak memory: M activations per stage)."""
    forwards = [Action("F", m) for m in range(microbatches)]
    backwards = [Action("B", m) for m in reversed(range(microbatches))]
    return forwards + backwards


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    """PipeDream-flush 1F1B: a warm-up of P-s-1 forwards, then alternate, then drain the backwards.

    Same bubble as GPipe, but a stage holds at most P-s activations instead of M.
    """
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action("F", m) for m in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < microbatches:
        if next_forward < microbatches:
            actions.append(Action("F", next_forward))
            next_forward += 1
        actions.append(Action("B", next_backward))
        next_backward += 1
    return actions


def flush_bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share a flushing schedule (GPipe, 1F1B) cannot avoid even with instant links and equal
    stage times: (P − 1) / (M + P − 1) of every worker's step is pipeline fill and drain."""
    return (stages - 1) / (microbatches + stages - 1)


TABLES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def schedule_table(name: str, stages: int, microbatches: int) -> list[list[Action]]:
    """The per-stage F/B lists of one step of a flushing schedule."""
    if name not in TABLES:
        raise ValueError(f"mesh.schedule = {name!r} has no table; tables exist for {sorted(TABLES)}")
    return [TABLES[name](s, stages, microbatches) for s in range(stages)]


def format_table(table: list[list[Action]]) -> str:
    """One line per stage, e.g. ``F0 F1 B0 B1`` — handy in tests and docs."""
    return "\n".join(" ".join(str(a) for a in row) for row in table)


# --- plans: what a worker consults -----------------------------------------------------------


class StagePlan(Protocol):
    """The order of one stage's actions. ``peek`` names the next one (kind, global microbatch id),
    or None when nothing may run before more microbatches are allowed (``horizon``: the first id
    this stage may not forward yet); ``advance`` records that it ran."""

    flushes: bool
    """Each step ends in a mesh-wide update (all-reduce, global clip): the pipeline drains per step."""
    updates_per_step: int

    def peek(self, horizon: int) -> tuple[Kind, int] | None: ...

    def advance(self, kind: Kind) -> None: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


class FlushPlan:
    """A synchronous table repeated every step, each step closed by one update."""

    flushes = True
    updates_per_step = 1

    def __init__(self, row: list[Action], microbatches: int):
        self.row = [*row, Action("U", microbatches - 1)]
        self.microbatches = microbatches
        self.step = 0  # steps whose update has been applied
        self.position = 0

    def peek(self, horizon: int) -> tuple[Kind, int] | None:
        if (self.step + 1) * self.microbatches > horizon:
            return None
        action = self.row[self.position]
        return action.kind, self.step * self.microbatches + action.microbatch

    def advance(self, kind: Kind) -> None:
        self.position += 1
        if self.position == len(self.row):
            self.position, self.step = 0, self.step + 1

    def state(self) -> dict:
        return {"step": self.step, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.step, self.position = state["step"], state["position"]


class AsyncPlan:
    """No-flush 1F1B: forward while fewer than ``in_flight`` microbatches are in flight (and the
    horizon allows), else backward the oldest; update after every ``update_every`` backwards.

    With ``in_flight = P - s`` this is 1F1B's order (P-s-1 warm-up forwards, then alternate) carried
    across steps, so stage s applies gradients τ_s = P-1-s versions old in steady state.
    """

    flushes = False

    def __init__(self, in_flight: int, update_every: int, microbatches: int):
        self.in_flight = in_flight
        self.update_every = update_every
        self.updates_per_step = microbatches // update_every
        self.forwarded = 0
        self.backwarded = 0
        self.updates = 0

    def peek(self, horizon: int) -> tuple[Kind, int] | None:
        if self.backwarded // self.update_every > self.updates:
            return "U", self.backwarded - 1
        if self.forwarded - self.backwarded < self.in_flight and self.forwarded < horizon:
            return "F", self.forwarded
        if self.backwarded < self.forwarded:
            return "B", self.backwarded
        return None

    def advance(self, kind: Kind) -> None:
        if kind == "F":
            self.forwarded += 1
        elif kind == "B":
            self.backwarded += 1
        else:
            self.updates += 1

    def state(self) -> dict:
        return {"forwarded": self.forwarded, "backwarded": self.backwarded, "updates": self.updates}

    def load_state(self, state: dict) -> None:
        self.forwarded, self.backwarded, self.updates = (state["forwarded"], state["backwarded"],
                                                         state["updates"])


Schedule = Literal["1f1b", "async", "gpipe"]
"""Values of ``mesh.schedule``."""


def round_trip_in_flight(stage: int, stages: int, compute_s: float, latency_s: float,
                         transfer_s: float, cap: int) -> int:
    """``mesh.in_flight = auto``: enough microbatches to keep stage s busy across its round trip.

    The gradient of a microbatch comes back after the stages below finish it: 2(P-1-s) latencies
    and transfers plus (P-1-s) forward+backward computes. Keeping ⌈round trip / own compute⌉ + 1 in
    flight hides it; the cap bounds staleness and stash memory.
    """
    below = stages - 1 - stage
    if below == 0:
        return 1
    round_trip = 2 * below * (latency_s + transfer_s) + below * compute_s
    return max(below + 1, min(cap, math.ceil(round_trip / compute_s) + 1 if compute_s > 0 else cap))


def feed_lookahead(deepest_in_flight: int, microbatches: int, flushes: bool = False) -> int:
    """Steps a driver feeds ahead of the one it runs: enough that the first stage (the deepest in
    flight) never waits for data before a drain point, so the order of actions never depends on
    when data was handed over. One number for the whole mesh, the same in every process.

    A flushing schedule feeds none: no stage can start step t + 1 before the mesh-wide update that
    ends step t, and a driver that hands out step t + 1 when it runs it starts each stage on it at
    that stage's own clock, as early as data handed out before. Feeding nothing ahead keeps every
    step end a possible drain point, so a stop request lands after the step in flight
    (train/signals.py)."""
    if flushes:
        return 0
    return math.ceil(deepest_in_flight / microbatches) + 1


def send_order(schedule: str, stage: int, stages: int, kind: Kind, microbatches: int) -> list[int]:
    """The microbatch (0..M-1) of each message stage ``stage`` sends in a step, in sending order:
    ``F`` its activations, ``B`` its gradients. A stage sends each as its action ends, so this is
    the order of those actions in its plan: the table's for a flushing schedule (GPipe's backwards
    descend), increasing ids for ``async`` (``AsyncPlan`` forwards and backwards in id order). A
    receiver that cannot read a header learns from it which microbatch the n-th message was."""
    if schedule == "async":
        return list(range(microbatches))
    return [a.microbatch for a in schedule_table(schedule, stages, microbatches)[stage] if a.kind == kind]


def build_plan(schedule: str, stage: int, stages: int, microbatches: int, in_flight: int,
               update_every: int) -> StagePlan:
    """The plan of one stage (``in_flight`` and ``update_every`` matter for ``async`` only)."""
    if schedule == "async":
        return AsyncPlan(in_flight, update_every, microbatches)
    return FlushPlan(schedule_table(schedule, stages, microbatches)[stage], microbatches)


def stage_in_flight(cfg, stage: int) -> int:
    """``mesh.in_flight`` for one stage of the async schedule (the last stage always holds one)."""
    return pipeline_in_flight(cfg)[stage]


def pipeline_in_flight(cfg) -> list[int]:
    """Every stage's in-flight depth in run ``cfg`` (a RunConfig). Whatever was asked, depths are at
    least 1F1B's (P − s) and strictly decrease along the pipeline: where two neighbours hold the
    same number, the upper one waits, in plan order, for an activation while a gradient it could
    backward sits in its inbox (measured: 2/2/2/1 runs at 0.37× the throughput of 4/3/2/1)."""
    mesh, stages = cfg.mesh, cfg.mesh.stages
    text = mesh.in_flight.strip()
    wanted = []
    for stage in range(stages):
        below = stages - 1 - stage
        if text == "default" or below == 0:
            wanted.append(below + 1)
        elif text.isdigit():
            # N is the first stage's depth; later stages hold proportionally fewer, 1F1B's shape.
            wanted.append(1 + math.ceil((int(text) - 1) * below / (stages - 1)))
        else:
            wanted.append(_round_trip_depth(cfg, stage))
    depths = [max(n, stages - s) for s, n in enumerate(wanted)]
    for s in range(1, stages):  # strictly decreasing, within what the stage above holds
        depths[s] = max(stages - s, min(depths[s], depths[s - 1] - 1))
    return depths


def _round_trip_depth(cfg, stage: int) -> int:
    """auto: the stage's own forward+backward per microbatch against the round trip below it, with
    the codec's real message size (encoded once, on zeros)."""
    mesh, stages = cfg.mesh, cfg.mesh.stages
    compute = ComputeModel(cfg.sim, cfg.model)
    micro = cfg.train.batch_size // mesh.replicas // mesh.microbatches
    stage_shape = StageShape(cfg.model.n_layer // stages, stage == 0, stage == stages - 1)
    own = sum(compute.compute_s(stage_shape, kind, micro, 0.0) for kind in ("F", "B"))
    shape = (micro, cfg.model.seq_len, cfg.model.d_model)
    ids = torch.zeros(shape[:-1], dtype=torch.long)
    ctx = MessageContext(0, 0, stage)  # a training message over this boundary
    message_bytes = build_codec(cfg.codec, cfg.model).encode(torch.zeros(shape), "act", ids, ctx).wire_bytes
    # The boundary below this stage (per-axis profiles and overrides included).
    profile = build_run_network(cfg).link(WorkerId(0, stage), WorkerId(0, stage + 1)).profile
    transfer = profile.serialization_s(message_bytes)
    return round_trip_in_flight(stage, stages, own, profile.latency_s, transfer, mesh.max_in_flight)
