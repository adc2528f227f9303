"""One worker's update, walked once for every runtime: the update protocol's actions turned into
the requests a runtime executes with its own collectives, sans-IO.

``update_actions`` (mesh/update.py) decides *what* an update does; this module decides *how the
actions follow one another*, which each runtime used to restate in its own executor loop: which
squared norm the clip reads (the gathered norms, or this stage's own, computed once), that a step
which does not commit applies nothing after its vote, how a strategy's phase is walked (its
messages, then its rounds waited for until done or past their deadline), how long the phases
waited, and the merge of the rounds (a spectator's own state then forgotten). A runtime asks
``UpdateRun.start()`` for the first request, executes it, and hands the result to ``resume``:

    request            the runtime                                      answers
    ReduceGradients    the stage's aggregate of its replicas' gradients   None
    Send(messages)     sends a phase's messages (marking their rounds'    its clock's now
                       starts), after posting what receives it needs
    Wait(until, u)     delivers arrivals until ``until`` (a deadline)     its clock's now
    GatherNorms        every worker's squared norm, however it learns it  norm_of(worker) → float
    Commit             the stage's verdict and the mesh's vote            whether the step commits
    Apply(coef, sq)    the optimizer step, its gradients scaled by coef   None

until ``resume`` returns None; ``outcome`` then says what happened. The simulator parks a run at a
``Wait`` (a deadline event) or a collective (its group) and resumes it from its event loop; dist
and elastic run it through in one call (``drive``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshlearn.dp.base import DPStrategy
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.update import (
    ClipAndStep,
    Commit,
    GatherNorms,
    MergeRounds,
    PhaseWalk,
    ReduceGradients,
    RoundStarts,
    StrategyPhase,
    UpdateAction,
    UpdateSpec,
    Wait,
    update_actions,
)

if TYPE_CHECKING:
    from meshlearn.mesh.worker import Worker

KEEP_ROUND_STARTS = 64
"""Rounds begun this many updates ago are long settled: their starts are forgotten at a merge."""


@dataclass(frozen=True)
class Send:
    """Send ``messages``, the first of ``phase`` (a "pre" phase's runtime posts the update's
    receives first); answered with the runtime's clock, from which the phase's waits count."""

    messages: list[Message]
    phase: StrategyPhase


@dataclass(frozen=True)
class Apply:
    """The optimizer step, its gradients scaled by ``coefficient`` (the clip's, from ``sq_norm``)."""

    coefficient: float
    sq_norm: float


Request = ReduceGradients | Send | Wait | GatherNorms | Commit | Apply


@dataclass
class Outcome:
    """What one update did: whether it committed (only a vote says no), whether the optimizer
    stepped, the squared norm its clip read (None: no clip was reached), and the time its phases
    waited, not yet taken by the runtime (``UpdateRun.pop_waited``)."""

    committed: bool = True
    stepped: bool = False
    sq_norm: float | None = None
    waited_s: float = 0.0


class UpdateRun:
    """Update ``actions`` of worker ``me``: ``own_sq()`` is its stage's squared gradient norm (asked
    at most once, after the reduce); ``starts``: the worker's round starts (its runtime's clock);
    ``spectator``: the worker trained nothing of the step (elastic), so after the merge its
    strategy forgets what would be its own (``reset_local``)."""

    def __init__(self, actions: list[UpdateAction], me: WorkerId, strategy: DPStrategy | None,
                 starts: RoundStarts, own_sq: Callable[[], float], spectator: bool = False):
        self.actions = actions
        self.me = me
        self.strategy = strategy
        self.starts = starts
        self.own_sq = own_sq
        self.spectator = spectator
        self.outcome = Outcome()
        self._own: float | None = None
        self._walk = self._steps()

    @classmethod
    def of(cls, worker: Worker, grad_clip: float, starts: RoundStarts, u: int | None = None,
           spectator: bool = False, **runtime) -> UpdateRun:
        """``worker``'s coming update: its actions from its schedule, its strategy and the
        runtime's shape (``runtime``: ``UpdateSpec``'s ``mesh_wide``, ``votes``,
        ``collective_deadline_s``); ``u``: its number (the worker's version unless the runtime
        counts otherwise: elastic counts committed updates)."""
        spec = UpdateSpec(worker.version if u is None else u, worker.plan.flushes, worker.mesh.stages,
                          grad_clip, worker.dp, **runtime)
        strategy = worker.dp if worker.dp is not None and not worker.dp.collective else None
        return cls(update_actions(spec), worker.id, strategy, starts, worker.grad_sq_norm, spectator)

    def start(self) -> Request | None:
        """The first request (None: the update has nothing to do, which no action list allows)."""
        return next(self._walk, None)

    def resume(self, result: Any = None) -> Request | None:
        """The last request's ``result`` (see the module's table); the next request, or None: done."""
        try:
            return self._walk.send(result)
        except StopIteration:
            return None

    def pop_waited(self) -> float:
        """The phases' waiting time since the last call (the runtime's DP wait counter)."""
        waited, self.outcome.waited_s = self.outcome.waited_s, 0.0
        return waited

    def _own_sq(self, _worker: WorkerId | None = None) -> float:
        if self._own is None:
            self._own = self.own_sq()
        return self._own

    def _steps(self) -> Generator[Request, Any, None]:
        out = self.outcome
        norm_of: Callable[[WorkerId], float] = self._own_sq  # until the norms are gathered
        for act in self.actions:
            if isinstance(act, ReduceGradients):
                yield act
            elif isinstance(act, StrategyPhase):
                walk = PhaseWalk(self.strategy, act, self.starts)
                since = now = yield Send(walk.messages(), act)
                while (wait := walk.poll(now)) is not None:
                    now = yield wait
                out.waited_s += now - since
            elif isinstance(act, GatherNorms):
                norm_of = yield act
            elif isinstance(act, Commit):
                out.sq_norm = self._own_sq()  # the stage's own: a vote is elastic's, clipped per stage
                out.committed = yield act
                if not out.committed:
                    return  # nothing after a vote that says no
            elif isinstance(act, ClipAndStep):
                out.sq_norm = act.policy.sq_norm(self.me, norm_of)
                yield Apply(act.policy.coefficient(out.sq_norm), out.sq_norm)
                out.stepped = True
            elif isinstance(act, MergeRounds):
                self.strategy.apply(act.u)
                if self.spectator:
                    self.strategy.reset_local()
                self.starts.forget_before(act.u - KEEP_ROUND_STARTS)
            else:
                raise TypeError(f"worker {self.me}: no update action {act!r}")


def drive(run: UpdateRun, execute: dict[type, Callable[[Any], Any]]) -> Outcome:
    """Run ``run`` through in one call (a runtime whose collectives block: dist, elastic):
    ``execute[type(request)](request)`` answers each request; a request type the runtime lacks
    (a vote outside elastic) is a bug, named."""
    request = run.start()
    while request is not None:
        handler = execute.get(type(request))
        if handler is None:
            raise RuntimeError(f"worker {run.me}: this runtime cannot execute {request!r}")
        request = run.resume(handler(request))
    return run.outcome
