"""SENTINEL (arXiv 2603.03592): trusted verifiers that score every pipeline-boundary message.

One ``BoundaryVerifier`` per boundary and direction (``boundary.py``) keeps an EMA reference of the
accepted traffic, scores each message with the paper's four distances plus two pair distances
(``distances.py``: the sender's output against its own input for the same microbatch) against
robust fences (``fence.py``), and runs sanity checks. ``Sentinel`` owns all of them plus what they
share: the messages each worker received this step (for the pair distances), the per-step skip
lists, the strike ledger with attribution and the ban budget (``ledger.py``), and the verifiers'
CPU clock (``cost.py``). It is the driver's message monitor: ``inspect`` sees each message on
arrival, in its wire form, before the receiving worker does, and returns it unchanged, quarantined,
or marked skipped.

Decisions do not depend on arrival order. Every message of step u is scored against the reference
and fences as they stood after step ``view_step(u)`` closed; accepted messages update them at their
own step's end, in (microbatch, replica) order. Under the flushing schedules ``view_step(u) = u − 1``
(the state at the start of the step). Under ``mesh.schedule = async`` steps overlap: when
``end_step(t)`` runs, messages of steps up to t + lookahead (the driver's feed-ahead) may already
have been inspected, so whether a message of step u saw step u − 1's commit would depend on timing.
There the view lags by the driver's ``lag`` = its lookahead L, reset at every drain point D (the
pipeline is empty there): ``view_step(u) = max(u − 1 − L, D − 1)``. The driver guarantees that
step's end came before any message of step u exists (it feeds at most L steps ahead of the step
it runs), so scores, flags, strikes and bans are the same whatever the interleaving; a message that
arrives too early for its view raises (a driver that breaks the contract, not a verdict).
Strikes are entered and bans decided at the step's end
too, after the **majority check**: if a strict majority of a boundary's senders had a message
flagged by a fence in the same step, the reference went stale (drift, a regime change, mimicry) and
restarts from that step's messages (with 3 or more senders the honest-majority assumption also
voids those strikes; ``verify.majority_rebase``). If the next step is again mostly flagged, the
distances themselves moved: the fences of the metrics that fired **re-warm** (``rewarm_steps``
steps with those fences open, then recalibrated). So no boundary flags a majority of its senders
for more than ``lock_steps`` consecutive steps, plus one if another metric takes over during the
re-warm-up (then every fence re-warms): at most 3 steps by default.

Quarantine (method note, "Algorithm"):

- a flagged **activation** drops its microbatch: the receiver gets the boundary's EMA instead (finite
  and harmless), the message is marked ``skip``, and the last stage gives the microbatch zero loss
  weight. Every later message of the microbatch is neutralized (activations → EMA, gradients → 0)
  and not scored, so one attack does not cascade into flags on honest downstream workers;
- a flagged **gradient** is replaced by zeros (``verify.grad_action``, chosen by measurement,
  issue 31; ``ema`` is the paper's broadcast reference); the microbatch's later gradients are passed
  on but not scored, since they derive from the replacement.

At a ban budget of 0 (2 replicas) a split between the two senders of a boundary that the verifier
cannot decide passes traffic on instead, for as long as the split lasts (``capture.py``).

Usage::

    sentinel = Sentinel(VerifyConfig(name="sentinel"), mesh, codec)
    driver.attach_monitor(sentinel)
    ...  # run step t
    outcome = sentinel.end_step(t)  # decisions, new bans, alerts, rebased and re-warmed references
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from meshlearn.compress.codecs import Codec
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.boundary import ROBUST_GROUP, SANITY, BoundaryVerifier, Verdict, View, combine
from meshlearn.verify.capture import splits, still_split, undecided
from meshlearn.verify.cost import VerifierClock
from meshlearn.verify.ends import EndsWatch, data_explained, mean_share
from meshlearn.verify.ledger import (
    Action,
    Alert,
    Ban,
    Decision,
    Ledger,
    Scored,
    attribute,
    peer_excess,
    upstream_suspects,
)
from meshlearn.verify.settings import (
    DECISION_LOGS,
    GRAD_ACTIONS,
    MONITORS,
    REFERENCE_UPDATES,
    VIEWS,
    VerifyConfig,
)
from meshlearn.verify.wire import reads_coefficients, wire_payload, wire_values

__all__ = ["DECISION_LOGS", "GRAD_ACTIONS", "MONITORS", "REFERENCE_UPDATES", "ROBUST_GROUP", "VIEWS",
           "Alert", "Ban", "BoundaryVerifier", "Decision", "Sentinel", "StepOutcome", "Verdict",
           "VerifyConfig", "combine", "reads_coefficients", "wire_payload", "wire_values"]


@dataclass
class StepOutcome:
    """What ``Sentinel.end_step`` reports."""

    decisions: list[Decision]
    bans: list[Ban]
    rebased: list[str]  # e.g. "s2|s3 act": a majority of senders flagged, reference restarted
    alerts: list[Alert] = dataclasses.field(default_factory=list)
    rewarmed: list[str] = dataclasses.field(default_factory=list)  # "s2|s3 act: gain,l1"


class Sentinel:
    """All verifiers of a mesh, the strike ledger and the skip lists; the driver's message monitor."""

    def __init__(self, cfg: VerifyConfig, mesh: MeshShape, codec: Codec):
        self.cfg = cfg
        self.mesh = mesh
        self.codec = codec
        self.verifiers = {(b, kind): BoundaryVerifier(cfg, cfg.beta_act if kind == "act" else cfg.beta_grad)
                          for b in range(mesh.stages - 1) for kind in ("act", "grad")}
        self.ledger = Ledger(cfg, mesh)
        self.ends = EndsWatch(self.ledger)
        self.clock = VerifierClock()
        # Everything per step is keyed by the message's step, so that end_step(t) closes step t's
        # messages only (under async, later steps' are already arriving).
        self.decisions: list[Decision] = []  # of steps not yet closed
        self.scored: list[Scored] = []  # scored messages of steps not yet closed, for their end
        # (step, replica, microbatch) quarantined: dropped (activation flagged) or patched (a
        # gradient replaced); trusted state, never taken from a worker's skip flag.
        self.dropped: set[tuple[int, int, int]] = set()
        self.patched: set[tuple[int, int, int]] = set()
        # What each worker received, per (step, replica, microbatch, kind, stage): the other half
        # of the pair distances of what it sends next.
        self.received: dict[tuple[int, int, int, str, int], torch.Tensor] = {}
        # The view rule (module docstring): 0 for flushing schedules; the driver's lookahead under
        # async (``set_lag``). ``synced``: the last drain point (steps before it are closed and
        # nothing is in flight); ``closed``: the last step end_step closed; ``views``: each
        # verifier's state after step t closed, for the steps a later message may still need.
        self.lag = 0
        self.synced = 0
        self.closed = -1
        self.views: dict[int, dict[tuple[int, str], View]] = {}
        # Suspensions while fences are open (``verify.warmup_suspend``: the warm-up and every
        # re-warm-up): senders that stood out from their peers in a closed step, quarantined
        # without strikes until they no longer do. Keyed like ``views``: the set as it stood
        # after step t closed.
        self.suspended: frozenset[WorkerId] = frozenset()
        self.suspensions: dict[int, frozenset[WorkerId]] = {}
        self.suspended_steps: dict[WorkerId, int] = {}  # consecutive open-fence steps standing out

    # the ledger's state, under the names the trust layer and older callers use
    @property
    def history(self):
        return self.ledger.history

    @property
    def banned(self) -> dict[WorkerId, Ban]:
        return self.ledger.banned

    @property
    def bans(self) -> list[Ban]:
        return self.ledger.bans

    def inspect(self, message: Message) -> Message:
        """Score one arriving message; return it, or its quarantined replacement marked ``skip``."""
        boundary = min(message.src.stage, message.dst.stage)
        with self.clock.measure(boundary):
            delivered, values = self._inspect(message, boundary)
            if values is not None:
                self.received[(message.step, message.dst.replica, message.microbatch, message.kind,
                               message.dst.stage)] = values
        return delivered

    def set_lag(self, lag: int) -> None:
        """Steps may overlap by up to ``lag`` (the driver's lookahead under async; 0: they don't)."""
        self.lag = max(0, int(lag))

    def view_step(self, step: int) -> int:
        """The closed step whose state scores the messages of ``step``."""
        return max(step - 1 - self.lag, self.synced - 1)

    def drained(self, done: int) -> None:
        """A drain point after ``done`` steps: every step before it is closed and nothing is in
        flight, so the next steps are scored against the live state again."""
        self.synced = done
        self.views.clear()
        self.suspensions.clear()

    def _suspended(self, step: int) -> frozenset[WorkerId]:
        """The senders suspended for messages of ``step``: the set of the step its views come from."""
        if not self.lag or self.view_step(step) >= self.closed:
            return self.suspended
        return self.suspensions[self.view_step(step)]

    def _peer_outliers(self, scored: list[Scored],
                       larger: frozenset[WorkerId] | set[WorkerId] = frozenset()
                       ) -> dict[WorkerId, tuple[int, str]]:
        """Senders all of whose messages on some boundary and direction with open fences (the warm-up,
        or a re-warm-up there) stood out from their peers' in this step: each one's excess
        (``peer_excess``) at least ``verify.ban_margin`` fence-widths, leaving out messages explained
        by an earlier message of their chain that stood out in the same way (the honest worker
        downstream of an attacker). The comparison is among messages of one step, so it holds while
        every distance still trends (the early steps, where a window's fence is far too wide to see an
        attack); "all" because an honest worker's excess is large on a microbatch or two at most
        (measured on the demo: attackers' smallest excess 2.2, honest ones' below 1). At most the
        threat model's minority of a stage (the largest), never the stages assumed honest nor a last
        stage whose larger gradients its row's data explains (``larger``, ``ends.py``). Each with
        the boundary and direction where it stood out most."""
        margin = self.cfg.ban_margin
        explained = upstream_suspects(scored, self.mesh.stages, lambda p: p.excess >= margin)
        excesses: dict[tuple[WorkerId, tuple[int, str]], list[float]] = {}
        for e in scored:
            if (e.open_fences and e.reason not in SANITY and e.reason != "banned"
                    and e.suspicion != float("inf") and id(e) not in explained):
                excesses.setdefault((e.src, e.verifier), []).append(e.excess)
        standing_out: dict[WorkerId, tuple[float, tuple[int, str]]] = {}
        for (src, verifier), values in sorted(excesses.items()):
            excess = min(values)
            if (excess >= margin and not self.ledger.honest_stage(src.stage) and src not in larger
                    and excess > standing_out.get(src, (-1.0, verifier))[0]):
                standing_out[src] = (excess, verifier)
        suspended: dict[WorkerId, tuple[int, str]] = {}
        for stage in sorted({w.stage for w in standing_out}):
            ranked = sorted((w for w in standing_out if w.stage == stage),
                            key=lambda w: (-standing_out[w][0], w))
            suspended |= {w: standing_out[w][1] for w in ranked[:self.ledger.budget]}
        return suspended

    def _view(self, step: int) -> dict[tuple[int, str], View] | None:
        """The verifiers' views for messages of ``step`` (None: the live state)."""
        if not self.lag:  # steps do not overlap: the live state is the start of the step
            return None
        wanted = self.view_step(step)
        if wanted >= self.closed:
            if wanted > self.closed:
                raise RuntimeError(
                    f"SENTINEL: a message of step {step + 1} arrived before step {wanted + 1} was "
                    f"closed; the driver fed more than lag = {self.lag} steps ahead")
            return None
        return self.views[wanted]

    def release_s(self, message: Message, arrival_s: float) -> float:
        """Driver hook (cost.py): when the message just inspected leaves its boundary's verifier,
        on the virtual clock — its CPU time, queued on that verifier's own CPU."""
        return self.clock.release_s(min(message.src.stage, message.dst.stage), arrival_s)

    def end_step(self, step: int) -> StepOutcome:
        """Close step ``step`` (its messages only: later steps' stay pending): update references and
        fences, attribute flags, enter strikes, decide bans (or alerts)."""
        if self.lag:  # keep the state later messages may still be scored against
            self.views[self.closed] = {key: v.view() for key, v in self.verifiers.items()}
            self.suspensions[self.closed] = self.suspended
        scored = [e for e in self.scored if e.decision.step == step]
        self.scored = [e for e in self.scored if e.decision.step != step]
        decisions = [d for d in self.decisions if d.step == step]
        self.decisions = [d for d in self.decisions if d.step != step]
        stale, voided, fired = self._stale_references(scored) if self.cfg.majority_rebase else ({}, set(), {})
        for key in self._stale_norms(scored):
            self.verifiers[key].renorm(step)
        captured, alerts = self._captured(scored, step)
        voided = voided | set(captured)
        rewarmed = []
        # Boundaries that scored nothing this step (every microbatch dropped before reaching them)
        # while another was mostly flagged: the regime change that stales one boundary's state
        # stales theirs too, they just cannot see it yet. Left alone they would lock one after the
        # other as the traffic reaches them (measured: 10 steps of every microbatch dropped on the
        # demo, a boundary at a time), so they re-warm at once. An attacker cannot cause this:
        # blinding a boundary takes a majority of some boundary's senders flagged.
        blind = set(self.verifiers) - {e.verifier for e in scored} if stale else set()
        # Where every replica's sender was scored and none flagged: the anchor moves (capture.py).
        # A step whose other messages were dropped upstream is no consensus: one sender alone.
        senders: dict[tuple[int, str], set[int]] = {}
        for e in scored:
            senders.setdefault(e.verifier, set()).add(e.src.replica)
        consensus = ({key for key, replicas in senders.items() if len(replicas) == self.mesh.replicas}
                     - {e.verifier for e in scored if e.flagged})
        for key, verifier in self.verifiers.items():
            if key in blind and not verifier.rewarming:
                verifier.rewarm(list(verifier.fences), step + 1 + self.cfg.rewarm_steps)
                verifier.locked = 0
                rewarmed.append(f"s{key[0]}|s{key[0] + 1} {key[1]}: all (blind)")
            if (key not in captured and verifier.passing is not None
                    and not still_split(scored, key, verifier.passing)):
                verifier.passing = None  # nothing renewed it: flags are quarantined again (capture.py)
            if key in captured:  # undecided split (capture.py): restart from both, pass flags on
                verifier.rebase(step)
                verifier.passing = captured[key].replica
            elif key not in stale:
                verifier.locked = 0
                verifier.commit(step)
                if key in consensus:
                    verifier.anchor = verifier.reference
            elif self.view_step(step) < verifier.reacted_at:
                # Scored against a view from before this boundary's last rebase or re-warm-up
                # (async lag): an echo of the state already reacted to, not new evidence. Refresh
                # the reference from the newer messages; the lock count does not move.
                verifier.rebase(step)
            else:
                verifier.locked += 1
                verifier.reacted_at = step
                verifier.rebase(step)
                if verifier.locked >= self.cfg.lock_steps or verifier.rewarming:
                    # Rebased and still mostly flagged (or flagged again while re-warming): the
                    # distances moved, not only the reference. Every fence re-warms if one already is.
                    metrics = list(verifier.fences) if verifier.rewarming else sorted(fired[key])
                    verifier.rewarm(metrics, step + 1 + self.cfg.rewarm_steps)
                    verifier.locked = 0
                    rewarmed.append(f"s{key[0]}|s{key[0] + 1} {key[1]}: {','.join(metrics)}")
            verifier.end_rewarm(step, self.cfg.fpr_target)
        if step == self.cfg.warmup_steps - 1 and self.cfg.fpr_target > 0:
            for verifier in self.verifiers.values():
                verifier.calibrate(self.cfg.fpr_target)
        attribute(scored, self.mesh.stages, self.cfg.explain_level)
        larger: set[WorkerId] = set()
        if not self.ledger.honest_stage(self.mesh.stages - 1):  # the last stage's blame rule (ends.py)
            larger = data_explained(scored, self.mesh.stages, self.cfg.ends_norm_ratio,
                                    self.cfg.ends_mean_share)
            alerts += self.ends.enter(step, scored, larger)
        peer_excess(scored)
        bans, strike_alerts = self.ledger.enter(step, scored, voided)
        alerts += strike_alerts
        # Only while fences are open somewhere (the warm-up, a re-warm-up): elsewhere the fences
        # decide and the peer check would be wasted work.
        warming = self.cfg.warmup_suspend and any(e.open_fences for e in scored)
        outliers = self._peer_outliers(scored, larger) if warming else {}
        self.suspended = frozenset(outliers)
        self.suspended_steps = {w: self.suspended_steps.get(w, 0) + 1 for w in outliers}
        for wid, (boundary, kind) in sorted(outliers.items()):
            # Standing out from its peers for ``strikes`` open-fence steps in a row is a ban: the
            # evidence is one sender against the honest majority, not a fence still uncalibrated.
            if (self.cfg.ban and wid not in self.banned
                    and self.suspended_steps[wid] >= self.cfg.strikes):
                ban, alert = self.ledger.decide(wid, step, self.suspended_steps[wid], "peers",
                                                f"s{boundary}|s{boundary + 1}", kind)
                bans += [ban] if ban is not None else []
                alerts += [alert] if alert is not None else []
        outcome = StepOutcome(decisions, bans, [f"s{b}|s{b + 1} {kind}" for b, kind in sorted(stale)],
                              alerts, rewarmed)
        self.dropped = {k for k in self.dropped if k[0] > step}
        self.patched = {k for k in self.patched if k[0] > step}
        self.received = {k: v for k, v in self.received.items() if k[0] > step}
        self.closed = max(self.closed, step)
        oldest = self.view_step(step + 1)  # the oldest view a message still to come may need
        self.views = {t: v for t, v in self.views.items() if t >= oldest}
        self.suspensions = {t: v for t, v in self.suspensions.items() if t >= oldest}
        return outcome

    def readmit(self, wid: WorkerId) -> None:
        """A replacement took over a banned slot: it starts with a clean record."""
        self.ledger.readmit(wid)
        self.ends.readmit(wid)
        self.suspended = self.suspended - {wid}
        self.suspended_steps.pop(wid, None)

    # --- internals ---------------------------------------------------------------------------

    def _inspect(self, message: Message, boundary: int) -> tuple[Message, torch.Tensor | None]:
        """The message to deliver, and the values its receiver gets (None: not kept for pairing)."""
        key = (message.step, message.src.replica, message.microbatch)
        verifier = self.verifiers[(boundary, message.kind)]
        views = self._view(message.step)
        view = views[(boundary, message.kind)] if views is not None else verifier.view()
        values = wire_values(message.payload, message.kind, self.codec, self.cfg.view, message.context())
        if key in self.dropped:
            self._decide(message, "skip", "dropped")
            fill = values.new_zeros(values.shape) if message.kind == "grad" else None
            return self._replace(message, view, values, fill), None
        if message.kind == "grad" and key in self.patched:
            self._decide(message, "skip", "patched")
            return dataclasses.replace(message, skip=True), None
        if message.src in self.banned:
            # Decided (and, under async, pending its replacement at the next drain point): every
            # message it sends until then is quarantined, whatever its step.
            self._decide(message, "banned", "banned")
            return self._quarantine(message, view, values, key)
        # Fences open once the view is past warm-up (calibrated): under async, lag steps later.
        warm = (message.step < self.cfg.warmup_steps
                or self.view_step(message.step) < self.cfg.warmup_steps - 1)
        open_fences = warm or bool(view.rewarming)
        received = self.received.get((*key, message.kind, message.src.stage))
        verdict, summary = verifier.check(values, fences_on=not warm, received=received, view=view)
        flagged = verdict.flagged(self.cfg.min_metrics)
        reason = verdict.reason(view.thresholds) if flagged else ""
        if open_fences and not flagged and message.src in self._suspended(message.step):
            flagged, reason = True, "suspended"
        action: Action = "flag" if flagged else ("warmup" if warm else "accept")
        decision = self._decide(message, action, reason, verdict.distances, view.thresholds)
        decision.norm = verdict.norm
        order = (message.microbatch, message.src.replica)
        if action != "warmup" or self.cfg.warmup_suspend:  # warm-up messages: for the peer check
            suspicion = float("inf") if verdict.sanity else verifier.score(verdict.distances, view)
            last = message.kind == "grad" and message.src.stage == self.mesh.stages - 1
            share = mean_share(values) if last and not self.ledger.honest_stage(message.src.stage) else None
            self.scored.append(Scored(message.src, message.microbatch, message.kind,
                                      (boundary, message.kind), flagged, reason, suspicion, decision,
                                      provisional=reason == "suspended" or action == "warmup",
                                      open_fences=open_fences, mean_share=share))
        if flagged:
            verifier.reject(order, summary, verdict.gain, step=message.step,
                            off_norm=verdict.norm if verdict.sanity == "norm" else None)
            if view.passing is not None and not verdict.sanity and reason != "suspended":
                decision.delivered = True  # an undecided boundary passes fence flags on (capture.py)
                return message, values
            return self._quarantine(message, view, values, key)
        verifier.accept(order, tuple(values.shape), summary, verdict.distances, verdict.norm, verdict.gain,
                        step=message.step)
        return message, values

    def _decide(self, message: Message, action: Action, reason: str,
                distances: dict[str, float] | None = None,
                thresholds: dict[str, float] | None = None) -> Decision:
        distances = dict(distances or {})
        thresholds = {m: thresholds[m] for m in distances} if thresholds else {}
        decision = Decision(message.step, message.microbatch, message.kind, message.src,
                            message.dst, action, reason, distances, thresholds)
        self.decisions.append(decision)
        return decision

    def _stale_references(self, scored: list[Scored]) -> tuple[dict, set, dict]:
        """Verifiers where a strict majority of (2 or more) senders had a message flagged by a fence
        this step (sanity failures say nothing about the reference), the metrics that fired there,
        and among them those with 3 or more senders, whose strikes are voided.

        With 2 senders, one attacker plus one honest false positive make such a "majority": voiding
        then let an adaptive attacker rebase the reference every step and never be banned (measured).
        """
        senders: dict[tuple[int, str], dict[WorkerId, bool]] = {}
        fired: dict[tuple[int, str], set[str]] = {}
        for e in scored:
            fence_flag = e.flagged and e.reason not in (*SANITY, "banned", "suspended")
            by_sender = senders.setdefault(e.verifier, {})
            by_sender[e.src] = by_sender.get(e.src, False) or fence_flag
            if fence_flag:
                fired.setdefault(e.verifier, set()).update(e.reason.split(","))
        stale = {key: by_sender for key, by_sender in senders.items()
                 if len(by_sender) >= 2 and 2 * sum(by_sender.values()) > len(by_sender)}
        return stale, {key for key in stale if len(senders[key]) >= 3}, fired

    def _captured(self, scored: list[Scored], step: int) -> tuple[dict, list[Alert]]:
        """At a ban budget of 0, the splits of this step that cannot be decided (``capture.py``):
        boundary → the flagged sender; and the alerts they raise. A decided split ends a
        boundary's passing."""
        captured: dict[tuple[int, str], WorkerId] = {}
        alerts: list[Alert] = []
        if self.ledger.budget > 0:
            return captured, alerts
        for key, (bad, good) in sorted(splits(scored).items()):
            verifier = self.verifiers[key]
            if not undecided(verifier, step, bad, good):
                verifier.passing = None
                continue
            captured[key] = bad
            alert = self.ledger.undecided(bad, step, (
                f"s{key[0]}|s{key[0] + 1} {key[1]}: {bad} flagged, {good} accepted, but {good}'s "
                f"messages moved at least as far from where both last agreed; with "
                f"{self.mesh.replicas} replicas nothing says which one lies: the reference restarts "
                "from both and flags there are passed on (alerts only) until a split is decided"))
            alerts += [alert] if alert is not None else []
        return captured, alerts

    @staticmethod
    def _stale_norms(scored: list[Scored]) -> set[tuple[int, str]]:
        """Verifiers where the norm check refused a message of a strict majority of (2 or more)
        senders this step: the norm median went stale, not the senders (``BoundaryVerifier.renorm``).
        With 2 senders an attacker alone cannot cause it (the honest one must be refused too)."""
        senders: dict[tuple[int, str], dict[WorkerId, bool]] = {}
        for e in scored:
            by_sender = senders.setdefault(e.verifier, {})
            by_sender[e.src] = by_sender.get(e.src, False) or e.reason == "norm"
        return {key for key, by_sender in senders.items()
                if len(by_sender) >= 2 and 2 * sum(by_sender.values()) > len(by_sender)}

    def _quarantine(self, message: Message, view: View, values: torch.Tensor,
                    key: tuple[int, int, int]) -> tuple[Message, torch.Tensor | None]:
        if message.kind == "act":
            self.dropped.add(key)
            return self._replace(message, view, values, None), None
        self.patched.add(key)
        fill = values.new_zeros(values.shape) if self.cfg.grad_action == "zero" else None
        return self._replace(message, view, values, fill), None

    def _replace(self, message: Message, view: View, values: torch.Tensor,
                 fill: torch.Tensor | None) -> Message:
        """The message with ``fill`` (default: the view's reference broadcast) as payload, marked skip."""
        if fill is None:
            fill = (torch.zeros(tuple(values.shape)) if view.reference is None
                    else view.reference.mean.expand(tuple(values.shape)).contiguous())
        payload = wire_payload(fill, message.payload, message.kind, self.codec, self.cfg.view,
                               message.context())
        return dataclasses.replace(message, payload=payload, skip=True)

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """At a drain point (every step closed, no view kept): the live state is all there is."""
        return {"verifiers": {f"{b}:{k}": v.state_dict() for (b, k), v in self.verifiers.items()},
                "ledger": self.ledger.state_dict(), "clock": self.clock.state_dict(),
                "ends": self.ends.state_dict(),
                "synced": self.synced, "closed": self.closed,
                "suspended": sorted(str(w) for w in self.suspended),
                "suspended_steps": {str(w): n for w, n in sorted(self.suspended_steps.items())}}

    def load_state_dict(self, state: dict) -> None:
        for (b, k), verifier in self.verifiers.items():
            verifier.load_state_dict(state["verifiers"][f"{b}:{k}"])
        self.ledger.load_state_dict(state.get("ledger", state))  # older checkpoints: flat
        if "clock" in state:
            self.clock.load_state_dict(state["clock"])
        self.ends.load_state_dict(state.get("ends", {}))
        self.synced, self.closed = state.get("synced", 0), state.get("closed", -1)
        self.suspended = frozenset(WorkerId.parse(w) for w in state.get("suspended", []))
        self.suspended_steps = {WorkerId.parse(w): n for w, n in state.get("suspended_steps", {}).items()}
        self.views.clear()
        self.suspensions.clear()
