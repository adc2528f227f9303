"""A bounded record of what every worker did during a few chosen steps: the data of the report's
pipeline timeline (a Gantt of compute, sends and idle time per worker).

Drivers hold an optional ``TimelineRecorder`` (``driver.timeline``, None by default). For every
forward, backward and update of a chosen step the driver calls ``compute``, and for every transfer
it puts on a link on behalf of such a step ``send``; elsewhere each call site costs one ``is None``
check and a set lookup. The number of events is capped (``max_events``), so a long window cannot
grow without bound: a capped record says so (``truncated``) and the Gantt shows what it holds.

Times are the driver's clock: virtual seconds under the simulator, ``time.monotonic()`` seconds
under ``--backend dist`` (each process records its own worker; processes on one host share that
clock, so their files line up).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlearn.atomic import atomic_write_text
from meshlearn.mesh.network import Link, Network
from meshlearn.mesh.topology import WorkerId

TIMELINE_FILE = "timeline.json"
MAX_EVENTS = 20_000
MAX_TIMELINE_STEPS = 8


@dataclass
class TimelineRecorder:
    """Events of the steps in ``steps`` (0-based); ``arm``/``disarm`` bracket a step's run."""

    steps: frozenset[int]
    clock: str  # "virtual" or "wall"
    max_events: int = MAX_EVENTS
    events: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False

    def wants(self, step: int) -> bool:
        """Whether events of ``step`` (0-based) are recorded."""
        return step in self.steps and not self.truncated

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) >= self.max_events:
            self.truncated = True
            return
        self.events.append(event)

    def compute(self, worker: str, kind: str, step: int, microbatch: int, t0: float, t1: float) -> None:
        """A forward (F), backward (B) or update (U) of ``worker`` from ``t0`` to ``t1``."""
        self._add({"kind": kind, "worker": worker, "step": step, "mb": microbatch, "t0": t0, "t1": t1})

    def send(self, src: str, dst: str, axis: str, what: str, step: int, nbytes: int, t0: float,
             t_sent: float, t1: float | None) -> None:
        """A transfer on link src→dst for ``step``: on the wire from ``t0`` to ``t_sent``
        (serialization, after any queueing on the link), delivered at ``t1`` (None where the sender
        cannot know)."""
        self._add({"kind": "send", "worker": src, "dst": dst, "axis": axis, "what": what, "step": step,
                   "bytes": nbytes, "t0": t0, "t_sent": t_sent, "t1": t1})

    def payload(self, workers: list[str], meta: dict[str, Any]) -> dict[str, Any]:
        """The JSON object of timeline.json (steps 1-based, as in metrics.jsonl)."""
        return {"clock": self.clock, "steps": sorted(s + 1 for s in self.steps),
                "workers": workers, "truncated": self.truncated, **meta,
                "events": [e | {"step": e["step"] + 1} for e in self.events]}

    def write(self, path: Path, workers: list[str], meta: dict[str, Any]) -> Path:
        """Write the record atomically (a temporary name, then a rename)."""
        atomic_write_text(path, json.dumps(self.payload(workers, meta)))
        return path


def computed(timeline: TimelineRecorder | None, worker: object, action, microbatches: int, t0: float,
             t1: float) -> None:
    """``worker``'s forward, backward or update ``action`` (a ``schedule.Action``) ran from ``t0``
    to ``t1``: recorded if its step is (every runtime's compute goes through here)."""
    step = action.microbatch // microbatches
    if timeline is not None and timeline.wants(step):
        timeline.compute(str(worker), action.kind, step, action.microbatch, t0, t1)


def transfer(timeline: TimelineRecorder | None, step: int, src: object, dst: object, link: Link, what: str,
             nbytes: int, now: float, send: Callable[[], Any] | None = None, epoch: float = 0.0,
             known: bool = True) -> Any:
    """Put a transfer of ``nbytes`` on ``link`` at ``now`` (``send()``, or the link model's
    ``transmit``, whose result is returned) and, when ``step`` is recorded, its times by the link
    model: its queued start, the end of its serialization and (``known``: the sender knows it) its
    delivery. Every runtime records a transfer here: the simulator on its virtual clock, dist on
    seconds since ``epoch``."""
    recorded = timeline is not None and timeline.wants(step)
    start = max(now, link.queue_free_at) if recorded else now
    result = link.transmit(now, nbytes) if send is None else send()
    if recorded:
        timeline.send(str(src), str(dst), link.axis, what, step, nbytes, epoch + start, epoch + link.free_at,
                      epoch + link.last_arrival if known else None)
    return result


def all_gather(timeline: TimelineRecorder | None, step: int, network: Network, senders: list[WorkerId],
               members: list[WorkerId], nbytes: int, start: float,
               epoch: float = 0.0) -> dict[WorkerId, float]:
    """A robust rule's all-gather on the link model (``dp.robust``), as every runtime charges it:
    from ``start`` each of ``senders`` sends its ``nbytes`` to every other of ``members`` on that
    pair's link (queued like any message, on the sender's uplink where access is shared); returns
    when the last contribution reached each member (``start`` where none did)."""
    done = dict.fromkeys(members, start)
    for src in senders:
        for dst in members:
            if src != dst:
                link = network.link(src, dst)
                arrival = transfer(timeline, step, src, dst, link, "allgather", nbytes, start, epoch=epoch)
                done[dst] = max(done[dst], arrival)
    return done


def parse_timeline_steps(value: str, total_steps: int) -> list[int]:
    """``report.timeline_steps`` → 0-based step indices. ``auto``: the middle step of the run and
    the one after it (steady state, and a step boundary between them); ``off`` or empty: none; else
    comma-separated 1-based steps. Raises ValueError with what is allowed."""
    text = value.strip().lower()
    if text in ("", "off", "none"):
        return []
    if text == "auto":
        first = max(1, total_steps // 2)
        return sorted({first - 1, min(first + 1, total_steps) - 1})
    try:
        steps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError("expected auto, off, or comma-separated step numbers such as 5,6") from None
    if not steps or steps[0] < 1 or steps[-1] > total_steps:
        raise ValueError(f"step numbers must lie in [1, train.steps = {total_steps}]")
    if len(steps) > MAX_TIMELINE_STEPS:
        raise ValueError(f"at most {MAX_TIMELINE_STEPS} steps (the timeline is for a close look)")
    return [s - 1 for s in steps]

