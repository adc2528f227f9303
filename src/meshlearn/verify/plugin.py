"""The trust layer as a trainer plugin: attacks and SENTINEL join a run through the hooks."""

from __future__ import annotations

from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.jsonl import MetricsLog
from meshlearn.verify.capabilities import RemoteVerdicts
from meshlearn.verify.trust import TrustLayer
from meshlearn.verify.verdicts import RemoteSentinel


def remote_sentinel(ctx: PluginContext) -> RemoteSentinel | None:
    """The verifier process's verdicts when SENTINEL runs in a process of its own (dist)."""
    return ctx.driver.remote_sentinel if isinstance(ctx.driver, RemoteVerdicts) else None


class TrustCallback(Callback):
    """After each step: score the verifier's decisions, carry out bans (between steps), log them;
    every decision also goes to verify.jsonl (per ``verify.decision_log``) for replay and audits."""

    def __init__(self, ctx: PluginContext):
        self.trust = TrustLayer(ctx.cfg, ctx.workers, remote=remote_sentinel(ctx))
        self.trust.attach(ctx.driver)
        self.decision_log = None
        if self.trust.sentinel is not None and ctx.cfg.verify.decision_log != "none" and ctx.writer:
            self.decision_log = MetricsLog(ctx.run_dir / "verify.jsonl", keep_until_step=ctx.resume_step)

    def on_step_end(self, step: int, report) -> StepOutput:
        verified = self.trust.end_step(step)
        if self.decision_log:
            for decision in verified.decisions:
                self.decision_log.write(decision)
        fields = ({"verify_flags": verified.flags, "verify_skipped": verified.skipped}
                  if self.trust.sentinel is not None else {})
        return StepOutput(fields, verified.events)

    def drains_after(self, done: int) -> bool:
        return self.trust.drains_after(done)

    def on_drain(self, done: int) -> list[dict]:
        return self.trust.on_drain(done)

    def state_dict(self) -> dict | None:
        return self.trust.state_dict() if self.trust.active else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.trust.active and state is not None:
            self.trust.load_state_dict(state)

    def summary(self) -> dict:
        return self.trust.summary()

    def close(self) -> None:
        if self.decision_log:
            self.decision_log.close()


class WireRejectsCallback(Callback):
    """Every message a receiver's guard refused (``compress.wire_checks``) becomes a
    ``wire_reject`` record in metrics.jsonl, a ``wire_rejects`` count in the step's train record and
    a total in summary.json. Present in every run: honest peers never trip it, and a lying one must
    leave a trace even when nothing verifies or attacks on purpose."""

    def __init__(self, ctx: PluginContext):
        remote = remote_sentinel(ctx)  # dist: the verifier process guards
        self.guards = [remote] if remote is not None else [w.guard for w in ctx.workers.values()
                                                           if w.guard is not None]
        self.total = 0

    def on_step_end(self, step: int, report) -> StepOutput:
        records = [r.record() for guard in self.guards for r in guard.pop_rejections()]
        self.total += len(records)
        return StepOutput({"wire_rejects": len(records)} if records else {}, records)

    def state_dict(self) -> int:
        return self.total

    def load_state_dict(self, state: int | None) -> None:
        self.total = state or 0

    def summary(self) -> dict:
        return {"wire_rejections": self.total}


def wire_rejects_plugin(ctx: PluginContext) -> WireRejectsCallback | None:
    """Where this process sees every receiver's rejections: the simulator's, or under dist the
    writer's when a verifier relays (its guard checks every pipeline message first). A dist process
    without a verifier logs its own rejections to stderr."""
    sees_all = ctx.driver.shard is None or remote_sentinel(ctx) is not None
    return WireRejectsCallback(ctx) if ctx.driver.writes_records and sees_all else None


def trust_plugin(ctx: PluginContext) -> TrustCallback | None:
    """Present when the run verifies or attacks anything (else it leaves no trace in the outputs)."""
    callback = TrustCallback(ctx)
    return callback if callback.trust.active else None
