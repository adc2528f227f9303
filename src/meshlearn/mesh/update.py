"""The update protocol: the end of a synchronous step (an update U), written once, sans-IO.

Every runtime ends an update with the same decisions: whether the stage's gradients are reduced by
the built-in collective (and by which rule, ``dp.robust``), whether the clip needs every stage's
norm (a gather across the mesh) or only this stage's, when a message-based DP strategy's phases run
(``dp/base.py``), where an elastic commit vote sits, and what the optimizer step is clipped with.
Those decisions used to be restated in the simulator, the dist driver and the elastic driver; here
they are made once, from the worker's config and strategy, as a list of explicit actions (the style
of ``torch.distributed.pipelining``'s action lists). A runtime only executes them with its own
collectives: the simulator with values in one process on its virtual clock, dist with process
groups or framed streams, elastic with its stage's quorum.

The actions of one update, in order (each present only where the config asks for it):

    ReduceGradients(rule, deadline)   the built-in collective strategies: the stage's aggregate of
                                      its replicas' gradients (a mean, or a robust rule's reduce)
    StrategyPhase("pre", u)           a message-based strategy: pre_step's messages, then wait
                                      until pre_ready(u)
    GatherNorms(deadline, latency)    a flushing schedule where a collective spans the mesh (not
                                      elastic): every stage's squared norm, for the global clip
    Commit                            elastic, before the optimizer step: the stage's and the
                                      mesh's vote (a step that does not commit applies nothing)
    ClipAndStep(policy)               the clip coefficient from ``policy``, the optimizer step
    StrategyPhase("post", u)          post_step's messages, then each round post_wait(u) names,
                                      until it completes or its deadline passes (then expired)
    Commit                            elastic, where the strategy's rounds follow the optimizer
                                      step (``post_rounds``): the vote comes after them
    MergeRounds(u)                    the strategy's apply(u): what is due at u is merged

A ``StrategyPhase`` is walked by ``PhaseWalk`` (its messages, then ``poll`` until done, rounds past
their deadline expired there), with the rounds' starts in ``RoundStarts`` and every ``dp`` arrival
through ``receive_round``: the runtimes only send, wait and deliver.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from meshlearn.dp.base import DPStrategy, Key
from meshlearn.dp.robust import Robust
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId


def clip_coefficient(sq_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient; 1.0 when clipping is off (max_norm ≤ 0)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(sq_norm) + 1e-6))


@dataclass(frozen=True)
class ClipPolicy:
    """Which squared norm clips an update, and against what threshold.

    ``scope = "mesh"``: the norm of a whole replica, its stages' squared norms summed in stage order
    from 0 (replica 0's, identical everywhere, unless the strategy lets replicas drift: then each
    replica's own). ``scope = "stage"``: this stage's own norm, against ``max_norm`` already
    divided by √P (see ``clip_policy``)."""

    scope: Literal["mesh", "stage"]
    max_norm: float
    stages: int
    per_replica: bool = False

    def sq_norm(self, me: WorkerId, stage_sq: Callable[[WorkerId], float]) -> float:
        """The squared norm that clips ``me``'s update; ``stage_sq(w)``: worker ``w``'s squared
        gradient norm (after the stage's reduce), however the runtime learned it."""
        if self.scope == "stage":
            return stage_sq(me)
        replica = me.replica if self.per_replica else 0
        return sum(stage_sq(WorkerId(replica, s)) for s in range(self.stages))

    def coefficient(self, sq_norm: float) -> float:
        return clip_coefficient(sq_norm, self.max_norm)


def clip_policy(grad_clip: float, stages: int, flushes: bool, drifts: bool,
                mesh_wide: bool = True) -> ClipPolicy:
    """The clip policy, the one place it is decided.

    A flushing schedule clips by the global norm (``torch.nn.utils.clip_grad_norm_`` over the whole
    model), per replica when the DP strategy lets replicas drift. Without a flush (``async``), or in
    a runtime where no collective spans the mesh (``mesh_wide = False``: elastic), there is no
    moment at which every stage's gradient is known, so each stage clips its own update at
    ``grad_clip / √P``: the norm of all P stages' updates together then stays within ``grad_clip``
    (Σ_s (c/√P)² = c²), the global clip's guarantee, without a barrier."""
    if flushes and mesh_wide:
        return ClipPolicy("mesh", grad_clip, stages, per_replica=drifts)
    return ClipPolicy("stage", grad_clip / math.sqrt(stages) if grad_clip > 0 else 0.0, stages)


@dataclass(frozen=True)
class ReduceGradients:
    """The stage's built-in collective over its replicas' gradients: the mean (a ring all-reduce),
    or with a robust rule its reduce of every whole contribution (an all-gather). A stage of one
    replica reduces nothing (the runtime's collective is then its identity)."""

    rule: Robust
    deadline_s: float | None

    @property
    def gathers(self) -> bool:
        return self.rule.gathers


@dataclass(frozen=True)
class StrategyPhase:
    """A message-based strategy's phase of update ``u``: ``pre`` sends ``pre_step(u)``'s messages
    and waits until ``pre_ready(u)``; ``post`` sends ``post_step(u)``'s and waits for every round
    ``post_wait(u)`` names until it completes or its deadline (``round_give_up_at``) passes."""

    phase: Literal["pre", "post"]
    u: int


@dataclass(frozen=True)
class GatherNorms:
    """Every stage's squared gradient norm to every worker (the global clip's input). ``latency``:
    the clip waits on this scalar exchange (one link latency), which only a clip that is on does."""

    deadline_s: float | None
    latency: bool


@dataclass(frozen=True)
class Commit:
    """Elastic: the stage's verdict and every stage's vote. Nothing after it applies if the step
    does not commit; what came before is undone (the runtime's rollback)."""


@dataclass(frozen=True)
class ClipAndStep:
    """The optimizer step, its gradients scaled by ``policy``'s coefficient."""

    policy: ClipPolicy


@dataclass(frozen=True)
class MergeRounds:
    """The strategy's ``apply(u)``: the rounds' results due at update ``u``."""

    u: int


UpdateAction = ReduceGradients | StrategyPhase | GatherNorms | Commit | ClipAndStep | MergeRounds


@dataclass(frozen=True)
class UpdateSpec:
    """What decides one worker's update: its schedule, its strategy and the runtime's shape.
    ``u``: the update's number (the worker's version; elastic: committed updates so far)."""

    u: int
    flushes: bool
    stages: int
    grad_clip: float
    strategy: DPStrategy | None
    mesh_wide: bool = True
    """False: no collective spans the mesh (elastic): the clip is per stage, no norms gathered."""
    votes: bool = False
    """True: the update commits by a vote (elastic)."""
    collective_deadline_s: float | None = None
    """The bound of a collective's wait (None: the simulator's virtual clock never waits)."""

    @property
    def collective(self) -> bool:
        """The built-in all-reduce runs (no strategy, or ``allreduce``)."""
        return self.strategy is None or self.strategy.collective

    @property
    def drifts(self) -> bool:
        return self.strategy is not None and self.strategy.drifts


def update_actions(spec: UpdateSpec) -> list[UpdateAction]:
    """The actions of one update, in order (see the module's docstring)."""
    policy = clip_policy(spec.grad_clip, spec.stages, spec.flushes, spec.drifts, spec.mesh_wide)
    gather = ([GatherNorms(spec.collective_deadline_s, latency=spec.grad_clip > 0)]
              if policy.scope == "mesh" else [])
    if spec.collective:
        rule = spec.strategy.robust if spec.strategy is not None else Robust()
        return [ReduceGradients(rule, spec.collective_deadline_s), *gather,
                *([Commit()] if spec.votes else []), ClipAndStep(policy)]
    late = spec.votes and spec.strategy.post_rounds(spec.u)  # the vote must see the post rounds
    return [StrategyPhase("pre", spec.u), *gather, *([Commit()] if spec.votes and not late else []),
            ClipAndStep(policy), StrategyPhase("post", spec.u), *([Commit()] if late else []),
            MergeRounds(spec.u)]


def waits_for(actions: list[UpdateAction]) -> Literal["mesh", "stage", "self"]:
    """Who must stand at this update before its first collective can run: everyone (the norms are
    gathered across the mesh), the stage's replicas (its gradients are reduced), or nobody (a
    strategy's rounds are messages, exchanged in its phases)."""
    if any(isinstance(a, GatherNorms) for a in actions):
        return "mesh"
    if any(isinstance(a, ReduceGradients) for a in actions):
        return "stage"
    return "self"


def find(actions: list[UpdateAction], kind: type) -> UpdateAction | None:
    """The first action of type ``kind`` (None: the update has none)."""
    return next((a for a in actions if isinstance(a, kind)), None)


def round_give_up_at(started: float | None, limit_s: float | None) -> float | None:
    """When a round this worker started at ``started`` is dropped if still incomplete (None: it is
    waited for). Counted from the receiver's own start of the round, so the decision never depends
    on when the receiver happens to look."""
    if started is None or limit_s is None:
        return None
    return started + limit_s


def round_late(started: float | None, limit_s: float | None, arrived: float) -> bool:
    """Whether a round's message that arrived at ``arrived`` missed the round's deadline."""
    give_up = round_give_up_at(started, limit_s)
    return give_up is not None and arrived > give_up


# --- a strategy's phase, walked (the StrategyPhase's executor, sans-IO) ----------------------------

class RoundStarts:
    """When this worker started each DP round, on its runtime's clock: the origin of the round's
    deadline. A round starts when the worker first sends a part of it."""

    def __init__(self):
        self.at: dict[Key, float] = {}
        self._keys: list[Key] = []  # a heap: forgetting old rounds pops only those

    def mark(self, messages: list[Message], now: float) -> None:
        for message in messages:
            key = (message.step, message.microbatch)
            if key not in self.at:
                self.at[key] = now
                heapq.heappush(self._keys, key)

    def give_up_at(self, strategy: DPStrategy, key: Key) -> float | None:
        return round_give_up_at(self.at.get(key), strategy.deadline_s(key))

    def forget_before(self, u: int) -> None:
        """Drop the starts of rounds begun by updates before ``u`` (long settled)."""
        while self._keys and self._keys[0][0] < u:
            self.at.pop(heapq.heappop(self._keys), None)


def receive_round(strategy: DPStrategy, starts: RoundStarts, message: Message,
                  arrived: float) -> list[Message]:
    """A ``dp`` message arrived at ``arrived``: past its round's deadline the round is dropped,
    whenever the receiver looks; else the strategy takes it. Returns what to send in answer."""
    key = (message.step, message.microbatch)
    if round_late(starts.at.get(key), strategy.deadline_s(key), arrived):
        strategy.expire(key)
        return []
    return strategy.receive(message)


@dataclass(frozen=True)
class Wait:
    """A phase is not done: deliver arrivals until ``until`` (None: until the next one); ``u``: the
    update whose round it waits for."""

    until: float | None
    u: int


@dataclass(frozen=True)
class PhaseWalk:
    """A ``StrategyPhase`` on one worker: ``messages()`` once (the runtime sends them and marks
    their rounds' starts), then ``poll(now)`` after every arrival or deadline until it returns None.
    A round whose deadline has passed is expired here, so a runtime only waits and delivers."""

    strategy: DPStrategy
    phase: StrategyPhase
    starts: RoundStarts

    def messages(self) -> list[Message]:
        u = self.phase.u
        return self.strategy.pre_step(u) if self.phase.phase == "pre" else self.strategy.post_step(u)

    def poll(self, now: float) -> Wait | None:
        strategy, u = self.strategy, self.phase.u
        if self.phase.phase == "pre":
            return None if strategy.pre_ready(u) else Wait(None, u)
        while (key := strategy.post_wait(u)) is not None:
            until = self.starts.give_up_at(strategy, key)
            if until is None or now < until:
                return Wait(until, key[0])
            strategy.expire(key)
        return None
