"""A one-line console progress display fed with the same records as metrics.jsonl.

On a terminal the line is a tqdm bar rewritten in place (tqdm clears it, fits it to the terminal's
width and keeps event lines above it); in CI logs and pipes, where ``\\r`` turns into noise, a
full line is printed every ``every`` steps plus the first and last.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

from meshlearn.report.units import as_number, format_count, format_duration

BAR_FORMAT = "{desc} |{bar}| {percentage:3.0f}%"
"""The terminal line: ``format_progress``'s text, then tqdm's bar of steps (cut to the terminal's width)."""


def format_progress(
    step: int,
    total_steps: int,
    *,
    train_loss: float | None = None,
    val_loss: float | None = None,
    wall_tokens_per_s: float | None = None,
    sim_tokens_per_s: float | None = None,
    staleness: list[float] | None = None,
    eta_s: float | None = None,
) -> str:
    """The progress line, e.g.
    ``step 120/300 | loss 2.031 | val 2.104 | 5.3k tok/s wall | 41.2k tok/s sim | ETA 1m12s``.

    Fields not known yet (no eval so far, no timing) are left out rather than shown as 0.
    """
    parts = [f"step {step}/{total_steps}"]
    if train_loss is not None:
        parts.append(f"loss {train_loss:.3f}")
    if val_loss is not None:
        parts.append(f"val {val_loss:.3f}")
    if wall_tokens_per_s is not None:
        parts.append(f"{format_count(wall_tokens_per_s)} tok/s wall")
    if sim_tokens_per_s is not None:
        parts.append(f"{format_count(sim_tokens_per_s)} tok/s sim")
    if staleness:  # async schedule: versions behind per stage
        parts.append("stale " + "/".join(f"{v:.3g}" for v in staleness))
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


EVENT_KINDS = frozenset({"ban", "alert", "wire_reject", "dp_outlier", "event"})
"""Records shown on the console as lines of their own (``event`` ones when they name their event)."""


def format_event(record: dict[str, Any]) -> str:
    """One console line for an event record, e.g. ``! step 12: ban r1s2 (...)``."""
    kind, step = record.get("kind"), record.get("step")
    if kind == "ban":
        what = (f"banned {record.get('worker')} ({record.get('metric')} on {record.get('message')}, "
                f"{record.get('strikes')} strikes); "
                + ("evicted: its row leaves" if record.get("evicted")
                   else f"replaced from {record.get('replaced_from')}"))
    elif kind == "alert":
        what = f"SENTINEL alert: {record.get('worker')}: {record.get('detail')}"
    elif kind == "dp_outlier":
        score = record.get("score")  # null: a non-finite contribution (dp/attribution.py)
        what = (f"DP outlier: {record.get('worker')} (stage {record.get('stage')}: {record.get('count')} "
                f"of its last updates far from the aggregate, score "
                f"{'non-finite' if score is None else format(score, '.3g')}); "
                + ("evicted" if record.get("evicted") else "reported, not evicted"))
    elif kind == "wire_reject":
        what = (f"rejected a {record.get('message')} from {record.get('src')} to {record.get('dst')}: "
                f"{record.get('reason')}")
    else:
        details = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("kind", "step", "event")
                            and not isinstance(v, (dict, list)) and k not in _COUNTERS)
        what = f"{record.get('event')}" + (f" ({details})" if details else "")
    return f"! step {step}: {what}"


_COUNTERS = frozenset({"tokens", "sim_time_s", "wall_time_s", "bytes_pp", "bytes_dp"})


def _rate(amount: float | None, seconds: float | None) -> float | None:
    if amount is None or seconds is None or seconds <= 0:
        return None
    return amount / seconds


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _Bar(tqdm):
    """tqdm without its monitor thread: the trainer redraws on every record, and a thread of its
    own in the process that starts the workers is one more thing to leave behind."""

    monitor_interval = 0


class ProgressLine:
    """Console progress for a training loop: call ``update(record)`` for each record.

    ``total_steps`` is the planned number of optimizer steps. ``stream`` defaults to the
    current ``sys.stdout`` (looked up at construction, so redirections are honoured).
    Throughput is the cumulative average (tokens / cumulative time); the ETA uses the wall
    time per step measured since the first record this object saw, which skips start-up
    cost and stays right for resumed runs.
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.every = every
        self.tty = _is_tty(self.stream)
        self._step: int | None = None
        self._train_loss: float | None = None
        self._val_loss: float | None = None
        self._wall_tok_s: float | None = None
        self._sim_tok_s: float | None = None
        self._staleness: list[float] | None = None
        self._eta_s: float | None = None
        self._first_step: int | None = None
        self._anchor: tuple[int, float] | None = None  # (step, wall_time_s) of first timing
        self._bar: tqdm | None = None  # TTY: opened with the first train record
        self._dirty = False  # non-TTY: state changed since the last printed line
        self._pending = False  # non-TTY: a due line waits for its step's evaluation

    def update(self, record: dict[str, Any]) -> None:
        """Take one metrics record: train and eval records update the line, events (bans, alerts,
        wire rejections, method events) get a line of their own, other kinds are ignored.

        In logs a due line waits for the step's evaluation, if one follows, so it shows that step's
        validation loss, and is printed once."""
        kind = record.get("kind")
        if kind in EVENT_KINDS and (kind != "event" or "event" in record):
            self._event(record)
            return
        if kind == "train" and self._pending:
            self._print_line()  # the previous step had no evaluation after all
        if kind == "train":
            self._take_train(record)
        elif kind == "eval":
            val = as_number(record.get("val_loss"))
            if val is not None:
                self._val_loss = val
        else:
            return
        if self._step is None:
            return
        self._dirty = True
        if self.tty:
            self._redraw()
        elif kind == "train" and self._due():
            self._pending = True
        elif kind == "eval" and self._pending:
            self._print_line()

    def _event(self, record: dict[str, Any]) -> None:
        text = format_event(record)
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # above the bar, which is drawn again below it
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _take_train(self, record: dict[str, Any]) -> None:
        step = as_number(record.get("step"))
        if step is None:
            return
        self._step = int(step)
        if self._first_step is None:
            self._first_step = self._step
        loss = as_number(record.get("train_loss"))
        if loss is not None:
            self._train_loss = loss
        staleness = record.get("staleness")
        self._staleness = staleness if isinstance(staleness, list) else None
        tokens = as_number(record.get("tokens"))
        wall = as_number(record.get("wall_time_s"))
        self._wall_tok_s = _rate(tokens, wall)
        self._sim_tok_s = _rate(tokens, as_number(record.get("sim_time_s")))
        if wall is None:
            return
        if self._anchor is None:
            self._anchor = (self._step, wall)
        anchor_step, anchor_wall = self._anchor
        if self._step > anchor_step:
            per_step = (wall - anchor_wall) / (self._step - anchor_step)
        elif self._step > 0:  # one record so far: cumulative average is all we have
            per_step = wall / self._step
        else:
            return
        self._eta_s = max(0, self.total_steps - self._step) * per_step

    def _due(self) -> bool:
        step = self._step or 0
        return step == self._first_step or step % self.every == 0 or step >= self.total_steps

    def line(self) -> str:
        """The current progress line (empty before the first train record)."""
        if self._step is None:
            return ""
        return format_progress(
            self._step,
            self.total_steps,
            train_loss=self._train_loss,
            val_loss=self._val_loss,
            wall_tokens_per_s=self._wall_tok_s,
            sim_tokens_per_s=self._sim_tok_s,
            staleness=self._staleness,
            eta_s=self._eta_s,
        )

    def _redraw(self) -> None:
        step, text = min(self._step or 0, self.total_steps), self.line()
        if self._bar is None:  # drawn as it opens
            self._bar = _Bar(total=self.total_steps, initial=step, desc=text, file=self.stream,
                             bar_format=BAR_FORMAT, dynamic_ncols=True, leave=True)
        else:
            self._bar.n = step
            self._bar.set_description_str(text)  # redraws
        self._dirty = False

    def _print_line(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._dirty = self._pending = False

    def close(self) -> None:
        """End the line: newline on a TTY; in logs, print the final state if not yet shown."""
        if self._bar is not None:
            self._bar.close()  # leaves the last line on screen, with a newline
            self._bar = None
        elif not self.tty and self._dirty and self._step is not None:
            self._print_line()

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
