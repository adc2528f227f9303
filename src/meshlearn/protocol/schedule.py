"""When morphs happen: every N steps, every N training tokens, or every N seconds of the run's
clock, always at a drain point (``protocol.every_steps | every_tokens | every_seconds``).

Steps and tokens are known ahead, so the plugin names its drain points exactly: after ``done``
steps when ``done`` is a multiple of ``every_steps``, or when ``done`` steps' tokens cross a
multiple of ``every_tokens`` (``protocol.every_tokens = 0.5M`` is the paper's training interval).

Seconds are not known ahead: the clock is the simulator's virtual clock (``sim_time_s``, what the
run would take on the modelled mesh; the wall clock of this process would make a run depend on the
machine). A morph becomes *due* at the end of the step where the clock passes the mark (the run's
start + N seconds, then the previous morph + N). The plugin then asks for a drain point after
``lookahead`` more steps: the driver may already have handed out work that far, and no drain can
come before it. If another drain point (evaluation, checkpoint) comes first, the morph happens
there. So morphs are at least N seconds apart, and late by at most the lookahead's steps.
"""

from __future__ import annotations

from collections.abc import Callable

from meshlearn.protocol.settings import ProtocolConfig


class MorphSchedule:
    """``clock()``: the run's clock in seconds (virtual); ``lookahead``: steps the driver may feed
    ahead of the one it runs (``SimDriver.lookahead``)."""

    def __init__(self, cfg: ProtocolConfig, tokens_per_step: int, clock: Callable[[], float],
                 lookahead: int):
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.clock = clock
        self.lookahead = lookahead
        self.mark_s = cfg.every_seconds  # the clock reading at which the next morph is due
        self.request: int | None = None  # seconds: the drain point asked for (steps done)

    @property
    def unit(self) -> str:
        return "tokens" if self.cfg.every_tokens else "seconds" if self.cfg.every_seconds else "steps"

    def drains_after(self, done: int) -> bool:
        """Whether the plugin needs a drain point after ``done`` steps (deterministic per step)."""
        if self.unit == "steps":
            return done % self.cfg.every_steps == 0
        if self.unit == "tokens":
            n = self.cfg.every_tokens
            return done * self.tokens_per_step // n > (done - 1) * self.tokens_per_step // n
        return done == self.request

    def step_end(self, done: int) -> None:
        """After every step: a seconds morph that fell due asks for its drain point."""
        if self.unit == "seconds" and self.request is None and self.clock() >= self.mark_s:
            self.request = done + self.lookahead

    def due(self, done: int) -> bool:
        """At a drain point after ``done`` steps: morph here?"""
        if self.unit == "seconds":
            return self.clock() >= self.mark_s
        return self.drains_after(done)

    def morphed(self) -> None:
        if self.unit == "seconds":
            self.mark_s = self.clock() + self.cfg.every_seconds
            self.request = None

    def state_dict(self) -> dict:
        return {"mark_s": self.mark_s, "request": self.request}

    def load_state_dict(self, state: dict) -> None:
        self.mark_s, self.request = state["mark_s"], state["request"]
