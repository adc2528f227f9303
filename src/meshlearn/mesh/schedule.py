"""Pipeline schedules as data: for each stage, the ordered list of forward/backward actions.

Both drivers execute these tables; a worker runs its list in order and waits only for the inputs an
action needs (an activation for F on stages > 0, a gradient for B on stages < P-1). Reference
tables for GPipe and 1F1B are kept in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    """F = forward of a microbatch, B = backward of it."""

    kind: Literal["F", "B"]
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


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


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def schedule_table(name: str, stages: int, microbatches: int) -> list[list[Action]]:
    """The per-stage action lists of a named schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"mesh.schedule = {name!r} is unknown; registered schedules: {sorted(SCHEDULES)}")
    return [SCHEDULES[name](s, stages, microbatches) for s in range(stages)]


def format_table(table: list[list[Action]]) -> str:
    """One line per stage, e.g. ``F0 F1 B0 B1`` — handy in tests and docs."""
    return "\n".join(" ".join(str(a) for a in row) for row in table)
