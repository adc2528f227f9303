"""Long runs from short simulations: the steady state between drain points, and what binds it.

Under the async schedule a run of ``train.steps`` steps is a sequence of segments between drain
points (evaluation, checkpoints, basis updates, the end); each starts from a drained mesh. Past
a few steps of fill, a segment's steps repeat with the period of the DP strategy's rounds, so
the virtual time of a segment of S steps is ``overhead + S · period`` (fill and drain in
``overhead``). ``predict`` simulates one drained segment just long enough to see that: ``warm``
steps of fill, a ``window`` of whole DP periods it measures, and a ``tail`` for the drain;
shorter segments are simulated whole. A flushing schedule (GPipe, 1F1B) drains at every step,
so a drain point changes nothing: the run is ``overhead + steps · period``, the overhead being
its first step's. A run that fits in one measuring segment is simulated whole.

Which resource binds is measured, not guessed, in one of two ways. ``with_path`` (the
planner's): the steady state's own critical path, split by resource (``plan.critical``: the
simulation's seconds carry what they are made of); the resource with the largest share binds,
``none`` if even halving that share's time would gain under 5% (share < 2 · (1 − 1/1.05)).
``with_gains`` (the reference it is checked against): the steady state simulated again with
each resource twice as good (FLOP rate, PP bandwidth, DP bandwidth, half the latency); the one
whose doubling gains most binds (``none`` if no doubling gains 5%). A link that is handed more
bytes than it can send in the window (busy share > 1) has no steady state: its queue grows for
as long as the run lasts, and the row says so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from meshlearn.config import RunConfig
from meshlearn.mesh.compute import DEVICES
from meshlearn.mesh.schedule import feed_lookahead, pipeline_in_flight
from meshlearn.plan.cost import CostRun, Window, simulate
from meshlearn.plan.memory import WorkerMemory, largest

RESOURCES = ("compute", "PP link", "DP link", "latency")
MAX_STEPS = 64  # steps the steady-state search measures at most (``measure``)
FAR = 10**9  # a drain point no measurement reaches


@dataclass(frozen=True)
class Horizon:
    """Steps of one measuring segment: fill, the measured window, the drain; ``period``: steps
    of one DP period (a steady state repeats in whole ones)."""

    warm: int
    window: int
    tail: int
    period: int = 1

    @property
    def steps(self) -> int:
        return self.warm + self.window + self.tail


def horizon(cfg: RunConfig) -> Horizon:
    """The fill covers the pipeline's feed-ahead (async) and the DP strategy's lag (a sparse
    round is applied ``delay`` updates after it starts, a DiLoCo sync ``overlap`` updates after
    it starts); the window is a whole number of DP periods (a sparse round every ``every``
    updates, a DiLoCo sync every ``H``; with an anchor circuit, its hand-offs
    every ``anchor.delay`` steps too), at least 1 step (2 under async). A flushing schedule's
    steps repeat from the second on: the first is the fill."""
    mesh, dp = cfg.mesh, cfg.dp
    flush = mesh.schedule != "async"
    updates = 1 if flush else mesh.microbatches // mesh.update_every
    period, lag = {"sparse": (dp.every, dp.delay + dp.every),
                   "diloco": (dp.inner_steps, dp.overlap)}.get(dp.name, (1, 0))
    period_steps = period // math.gcd(period, updates)
    if cfg.anchor.z:  # the anchor's hand-offs (its snapshot or pass traffic) repeat every K steps
        period_steps = math.lcm(period_steps, cfg.anchor.delay)
    lag_steps = math.ceil(lag / updates)
    if flush:
        warm, tail, least = 1 + lag_steps, 0, 1
    else:
        ahead = feed_lookahead(max(pipeline_in_flight(cfg)), mesh.microbatches)
        warm, tail, least = ahead + lag_steps + 1, ahead, 2
    return Horizon(warm, period_steps * math.ceil(least / period_steps), tail, period_steps)


def segment_lengths(cfg: RunConfig) -> Counter:
    """How many segments of each length a run of ``train.steps`` has between drain points."""
    train, steps = cfg.train, cfg.train.steps
    periods = [train.eval_every, train.checkpoint_every, cfg.subspace_update.every]
    points = sorted({steps} | {k for p in periods if p for k in range(p, steps, p)})
    return Counter(b - a for a, b in zip([0, *points], points, strict=False))


@dataclass
class Prediction:
    """The planner's answer for one configuration."""

    tokens_per_s: float  # over the whole run of train.steps, drain points included
    steady_tokens_per_s: float  # between drain points
    window: Window  # the steady state: bytes, busy shares, bubble
    overhead_s: float  # per segment: fill and drain beyond the steady steps
    whole_run: bool  # simulated whole (train.steps fits one measuring segment)
    steps_simulated: int
    memory: WorkerMemory
    memory_worker: str
    stash_versions: int
    in_flight_peak: int
    binds: str = ""  # see ``with_gains``
    gains: dict[str, float] = field(default_factory=dict)  # tokens/s × when a resource doubles


def _facts(cfg: RunConfig, run: CostRun) -> dict:
    memory, where = largest(cfg, run.workers, run.source.micro)
    return {"memory": memory, "memory_worker": where,
            "stash_versions": max(w.stash_peak for w in run.workers.values()),
            "in_flight_peak": max(w.in_flight_peak for w in run.workers.values())}


def period(durations: list[float], unit: int, least: int = 0) -> int | None:
    """The shortest p (a multiple of ``unit``) with which the last max(2p, ``least``) steps'
    virtual durations repeat (to 1e-9: differences of a clock that only grows). None: no such p
    yet. Bytes are not compared: a message sent near a step's end is counted in either step."""
    n = len(durations)
    for p in range(unit, n // 2 + 1, unit):
        seen = max(2 * p, least)
        if seen <= n and all(math.isclose(durations[-k], durations[-k - p], rel_tol=1e-9, abs_tol=1e-12)
                             for k in range(1, seen - p + 1)):
            return p
    return None


def measure(run: CostRun, h: Horizon) -> Window:
    """The steady state: after the fill, step until the steps repeat (``period``) and measure one
    whole period. The horizon's window alone is not enough: a pipeline deeper than a step's
    microbatches (P > M) finishes its steps in a pattern that repeats every few steps (32 stages
    of 8 microbatches: every 4), and a window of one pattern's first steps is not its mean. The
    period is a whole number of DP periods, seen twice and over at least two horizon windows
    (an async pipeline's steps alternate: one repeat of one step is no evidence). Past
    ``MAX_STEPS`` (or two windows, if longer) without a repeat, the mean over the latest whole
    windows.

    A window in which a link or uplink was handed more bytes than it can send (busy share > 1)
    is only taken for an oversubscribed link if it stays so over a long one: the step times can
    repeat while the bytes queued on a shared uplink land in a pattern of their own (PowerSGD's
    rounds behind the pipeline's sends: every 6th step), so a short window can catch the
    pattern's busy steps (busy 1.3 over 2 steps, 0.94 over 30, the backlog flat). The run then
    steps on to ``MAX_STEPS`` steps after the fill and measures the latest whole windows of them
    (``confirmed``); a queue that only grows stays over 1 there."""
    marks = [run.run(h.warm)]
    durations: list[float] = []
    while True:
        marks.append(run.run(1))
        durations.append(marks[-1].sim_s - marks[-2].sim_s)
        p = period(durations, h.period, 2 * h.window)
        if p is None and len(durations) >= max(MAX_STEPS, 2 * h.window):
            p = len(durations) // 2 // h.window * h.window
        if p is not None:  # whole periods, at least the horizon's window (the fill is the rest)
            span = p * math.ceil(h.window / p)
            window = run.window(marks[-1 - span], marks[-1])
            return confirmed(run, marks, span) if _over(window) else window


def _over(w: Window) -> bool:
    """Whether some link or uplink was handed more than it can send in ``w``."""
    return max(w.pp_link_share, w.dp_link_share, w.uplink_share) > 1.0


def confirmed(run: CostRun, marks: list, span: int) -> Window:
    """The window over the latest whole ``span``s of ``MAX_STEPS`` steps after the fill (two
    spans, if longer; ``marks``: the counters at the fill's end and after every step since)."""
    while len(marks) <= max(MAX_STEPS, 2 * span):
        marks.append(run.run(1))
    steps = (len(marks) - 1) // span * span
    return run.window(marks[-1 - steps], marks[-1])


@functools.lru_cache(maxsize=512)
def steady(cfg: RunConfig, mask_keep: float | None = None, mirror: bool = True,
           critical_path: bool = False) -> Prediction:
    """The steady state between drain points (a method row, a point of the sweep, a doubled
    resource); remembered per configuration, as rows, sweeps and doublings often coincide.
    ``mirror``: one replica row when the replicas are mirror images (``plan.mirror``);
    ``critical_path``: the window also splits its critical path by resource (``plan.critical``)."""
    h = horizon(cfg)
    run = CostRun(cfg, FAR, drain_at=FAR, mask_keep=mask_keep, mirror=mirror,  # the drain comes later
                  critical_path=critical_path)
    window = measure(run, h)
    return Prediction(window.tokens_per_s, window.tokens_per_s, window, 0.0, False, run.done,
                      **_facts(cfg, run))


def predict(cfg: RunConfig, mask_keep: float | None = None, mirror: bool = True,
            critical_path: bool = False) -> Prediction:
    """Tokens/s of ``cfg``'s whole run, and its steady state, from the shortest simulation that
    shows them: one segment of the fill, the steps ``measure`` needed to see the steady
    state, and the drain; its time beyond the steady steps is the overhead of every segment.
    ``critical_path``: the steady window splits its critical path by resource."""
    h, steps = horizon(cfg), cfg.train.steps
    if steps <= h.steps:
        run, window = simulate(cfg, steps, mask_keep, mirror, critical_path)
        return Prediction(window.tokens_per_s, window.tokens_per_s, window, 0.0, True, steps,
                          **_facts(cfg, run))
    run = CostRun(cfg, FAR, drain_at=FAR, mask_keep=mask_keep, mirror=mirror, critical_path=critical_path)
    window = measure(run, h)
    measured, segment = run.done, run.done + h.tail
    if steps <= segment:  # shorter than the segment that shows the steady state
        run, whole = simulate(cfg, steps, mask_keep, mirror)
        return Prediction(whole.tokens_per_s, window.tokens_per_s, window, 0.0, True, steps,
                          **_facts(cfg, run))
    period_s = window.sim_s / window.steps
    # The drain moves to ``segment``. Exact while nothing past it has been fed yet (the feed
    # reaches ``tail`` steps ahead); else the segment is simulated again with its drain.
    run.source.drain_at = segment
    simulated = segment
    if run.driver.fed >= segment:
        run = CostRun(cfg, segment, drain_at=segment, mask_keep=mask_keep, mirror=mirror)
        run.run(measured)
        simulated += measured
    overhead = float(run.run(h.tail).sim_s - segment * period_s)
    fill = measured - window.steps + h.tail  # steps outside the steady state in a segment
    if cfg.mesh.schedule != "async":  # every step drains: a drain point adds nothing
        total_s = overhead + steps * period_s
    else:
        total_s = 0.0
        for length, count in segment_lengths(cfg).items():
            if length >= fill:
                total_s += count * (overhead + length * period_s)
            else:  # too short to reach the steady state: simulated as it is
                short = CostRun(cfg, length, drain_at=length, mask_keep=mask_keep, mirror=mirror)
                total_s += count * short.run(length).sim_s
                simulated += length
    tokens = steps * run.tokens_per_step
    return Prediction(tokens / total_s, window.tokens_per_s, window, overhead, False, simulated,
                      **_facts(cfg, run))


def doubled(cfg: RunConfig, resource: str) -> RunConfig:
    """``cfg`` with one resource twice as good (per-link overrides are left as they are)."""
    link, links = cfg.link, cfg.links
    if resource == "compute":
        peak = cfg.sim.peak_tflops or DEVICES[cfg.sim.device][0]
        return dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, peak_tflops=2 * peak))
    if resource == "PP link":
        return dataclasses.replace(cfg, links=dataclasses.replace(
            links, pp_bandwidth_mbit=2 * (links.pp_bandwidth_mbit or link.bandwidth_mbit)))
    if resource == "DP link":
        return dataclasses.replace(cfg, links=dataclasses.replace(
            links, dp_bandwidth_mbit=2 * (links.dp_bandwidth_mbit or link.bandwidth_mbit)))
    pp = links.pp_latency_ms if links.pp_latency_ms >= 0 else link.latency_ms
    dp = links.dp_latency_ms if links.dp_latency_ms >= 0 else link.latency_ms
    return dataclasses.replace(cfg, link=dataclasses.replace(link, latency_ms=link.latency_ms / 2),
                               links=dataclasses.replace(links, pp_latency_ms=pp / 2, dp_latency_ms=dp / 2))


def doublings(cfg: RunConfig) -> dict[str, RunConfig]:
    """``cfg`` with each resource doubled (DP only when D > 1): the runs ``with_gains`` needs."""
    return {resource: doubled(cfg, resource) for resource in RESOURCES
            if resource != "DP link" or cfg.mesh.replicas > 1}


def with_gains(cfg: RunConfig, p: Prediction, mask_keep: float | None = None,
               lookup: Callable[[RunConfig, float | None], Prediction] = steady) -> Prediction:
    """``p`` with the steady-state gain of doubling each resource (DP only when D > 1);
    ``lookup``: where the doubled runs' predictions come from (``steady`` unless already run)."""
    base = p.steady_tokens_per_s
    gains = {resource: lookup(c, mask_keep).steady_tokens_per_s / base
             for resource, c in doublings(cfg).items()}
    best = max(gains, key=gains.get)
    binds = best if gains[best] >= 1.05 else "none"
    return dataclasses.replace(p, gains=gains, binds=_oversubscribed(p.window, binds))


PATH_BINDS = 2 * (1 - 1 / 1.05)  # the least share whose halving can gain 5% (``with_path``)


def with_path(cfg: RunConfig, p: Prediction) -> Prediction:
    """``p`` with the resource that binds it read off its steady state's critical path
    (``p.window.path``, from a ``critical_path`` simulation): the one of ``RESOURCES`` with the
    largest share (DP only when D > 1), ``none`` if its share is under ``PATH_BINDS``."""
    path = p.window.path
    if path is None:
        raise ValueError("with_path needs a prediction simulated with critical_path=True")
    candidates = [r for r in RESOURCES if r != "DP link" or cfg.mesh.replicas > 1]
    best = max(candidates, key=path.get)
    binds = best if path[best] >= PATH_BINDS else "none"
    return dataclasses.replace(p, binds=_oversubscribed(p.window, binds))


def _oversubscribed(w: Window, binds: str) -> str:
    for link, share in (("PP link", w.pp_link_share), ("DP link", w.dp_link_share),
                        ("uplink", w.uplink_share)):
        if share > 1.0:  # handed bytes faster than it sends them: its queue only grows
            binds = f"{link} oversubscribed ×{share:.1f}"
    return binds


__all__ = ["PATH_BINDS", "Horizon", "Prediction", "doublings", "horizon", "measure", "period", "predict",
           "segment_lengths", "steady", "with_gains", "with_path"]
