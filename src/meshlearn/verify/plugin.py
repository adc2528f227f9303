"""The trust layer as a trainer plugin: attacks and SENTINEL join a run through the hooks."""

from __future__ import annotations

from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.train.files import MetricsLog
from meshlearn.verify.trust import TrustLayer


class TrustCallback(Callback):
    """After each step: score the verifier's decisions, carry out bans (between steps), log them;
    every decision also goes to verify.jsonl (per ``verify.decision_log``) for replay and audits."""

    def __init__(self, ctx: PluginContext):
        self.trust = TrustLayer(ctx.cfg, ctx.workers)
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


def trust_plugin(ctx: PluginContext) -> TrustCallback | None:
    """Present when the run verifies or attacks anything (else it leaves no trace in the outputs)."""
    callback = TrustCallback(ctx)
    return callback if callback.trust.active else None
