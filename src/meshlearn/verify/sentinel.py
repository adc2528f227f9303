"""SENTINEL (arXiv 2603.03592): trusted verifiers that score every pipeline-boundary message.

One ``BoundaryVerifier`` per boundary and direction keeps an EMA reference of the accepted traffic,
scores each message with four distances (``distances.py``) against adaptive Tukey fences
(``fence.py``), and runs sanity checks. ``Sentinel`` owns all of them plus what they share: the
strike ledger (s strikes within a worker's last h scored messages → ban) and the per-step skip lists.
It is the driver's message monitor: ``inspect`` sees each message on arrival, in its wire form,
before the receiving worker does, and returns it unchanged, quarantined, or marked skipped.

Decisions do not depend on arrival order. During a step every message is scored against the
reference and fences as they stood at the start of the step; accepted messages update them at the
step's end, in (microbatch, replica) order. Real verifiers see messages in whatever order the network
delivers them, and the simulator's order can shift with timing, so this keeps runs replayable.
Strikes are entered and bans decided at the step's end too, after one check the paper does not
describe: if a strict majority of a boundary's senders were flagged in the same step, the reference
went stale (drift, an adaptive attacker's mimicry) and restarts from that step's messages; with 3 or
more senders the honest-majority assumption also voids those strikes (``verify.majority_rebase``).

Quarantine (method note, "Algorithm"):

- a flagged **activation** drops its microbatch: the receiver gets the boundary's EMA instead (finite
  and harmless), the message is marked ``skip``, and the last stage gives the microbatch zero loss
  weight. Every later message of the microbatch is neutralized (activations → EMA, gradients → 0)
  and not scored, so one attack does not cascade into flags on honest downstream workers;
- a flagged **gradient** is replaced by its EMA broadcast over samples (the paper's choice;
  ``verify.grad_action = zero`` sends zeros instead); the microbatch's later gradients are passed on
  but not scored, since they derive from the replacement.

Usage::

    sentinel = Sentinel(VerifyConfig(name="sentinel"), mesh, codec)
    driver.attach_monitor(sentinel)
    ...  # run step t
    outcome = sentinel.end_step(t)  # decisions, new bans, rebased references
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from meshlearn.compress.codecs import Codec, Encoded, Kind
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.distances import (
    Summary,
    ema,
    message_distances,
    quantile_levels,
    summarize,
    swd_directions,
)
from meshlearn.verify.fence import TukeyFence

MONITORS = ("none", "sentinel")
GRAD_ACTIONS = ("ema", "zero")
REFERENCE_UPDATES = ("mean", "median")
ROBUST_GROUP = 3
"""Summaries of one microbatch needed for the median: with fewer, one bad sender is a "majority"."""
VIEWS = ("auto", "decoded")
DECISION_LOGS = ("all", "flags", "none")


@dataclass(frozen=True)
class VerifyConfig:
    """Verification of pipeline-boundary traffic. Config keys under ``verify.``.

    The defaults are sized for the demo (4 stages × 2 replicas × 4 microbatches, 300 steps): each
    boundary and direction sees 8 messages per step, so a window of 256 holds the last 32 steps.
    """

    name: str = "none"
    """``sentinel`` verifies every boundary message; ``none`` trusts them all."""
    warmup_steps: int = 80
    """Steps that build the references and fill the windows before any fence or ban applies (the
    paper uses ~1000 on far longer runs). Only sanity checks quarantine messages meanwhile. Make it
    at least window / (replicas · microbatches) steps, so the early, fast-moving distances have left
    the windows when fences start; attacks that begin earlier poison the reference. Measured on the
    demo with 50: most false flags of a clean run fell in the 30 steps after warm-up, while the
    loss still falls fast."""
    beta_act: float = 0.9
    """EMA factor of the forward-activation reference, per accepted message (paper: 0.9)."""
    beta_grad: float = 0.8
    """EMA factor of the backward-gradient reference (paper: 0.8; gradients drift faster)."""
    statistic: str = "position_mean"
    """φ: ``position_mean`` (batch mean per position, (n, c)) or ``global_mean`` (mean over batch and
    positions, (c,); blind to attacks on a few positions)."""
    metrics: str = "l1,l2n,sfr,swd"
    """Comma-separated distances that vote: l1, l2n (normalized L2), sfr (sign-flip ratio), swd
    (sliced Wasserstein)."""
    min_metrics: int = 1
    """A message is flagged when at least this many metrics exceed their fences (1 = any; the paper's
    ablation favours all four OR-ed; 2 halves false positives at some recall)."""
    fence_k: float = 3.0
    """Tukey fence Q3 + k·IQR: the smallest k any metric uses (see ``fpr_target``)."""
    fpr_target: float = 0.01
    """At the end of warm-up each fence raises its k until at most fpr_target / (number of metrics)
    of its window's clean distances lie above it (the method note's calibration; 0 keeps
    ``fence_k``). Measured on the demo: clean-run false positives sit just above a k = 3 fence."""
    window: int = 256
    """Accepted distances per metric kept for the fence (and message norms for the sanity check)."""
    strikes: int = 3
    """Flags within a worker's last ``strike_history`` scored messages that ban it (1 = ban at once)."""
    strike_history: int = 20
    """Length of the per-worker history the strikes are counted in."""
    ban: bool = True
    """False keeps flagging and quarantining messages but never bans: the attacker keeps sending, so
    the detector is measured per message over a whole attack (the bench's message-level numbers)."""
    swd_directions: int = 64
    """Random unit directions L of the sliced Wasserstein distance."""
    swd_quantiles: int = 64
    """Quantiles Q per direction of the sliced Wasserstein distance."""
    norm_ratio: float = 100.0
    """Sanity check, also during warm-up: quarantine a message whose norm is more than this factor
    above or below the median norm of recently accepted messages."""
    majority_rebase: bool = True
    """When a strict majority of a boundary's senders are flagged in one step, the reference went
    stale: restart it from that step's messages. Without it, a reference that drifted (an adaptive
    attacker, a regime change) flags every honest replacement forever, since flagged messages never
    update it. With 3 or more senders the honest majority of the threat model also voids those
    strikes; with 2, a flagged "majority" may be the attacker plus one false positive, so the strikes
    stand (otherwise the attacker could shield itself)."""
    reference_update: str = "median"
    """How a step's accepted messages enter the reference: ``median`` folds in, per microbatch, the
    element-wise median of its replicas' summaries when there are 3 or more (one EMA step of weight
    β^count), so a minority of senders pulls the reference no further than the honest spread (the
    threat model's honest majority), however far off its accepted messages are; with fewer it falls
    back to ``mean``, the paper's rule: one EMA step per message, in (microbatch, replica) order."""
    grad_action: str = "ema"
    """What replaces a flagged gradient: ``ema`` (the reference, broadcast over samples) or ``zero``."""
    view: str = "auto"
    """What is verified: ``auto`` reads the coefficients a compressing codec puts on the wire
    (subspace, lowrank) and decodes the others; ``decoded`` always decodes with the trusted codec."""
    charge_time: bool = True
    """Add each inspection's measured wall time to the message's arrival on the virtual clock
    (verifiers sit on the path). False keeps the virtual clock bit-reproducible."""
    decision_log: str = "all"
    """Decisions written to the run's ``verify.jsonl``: ``all``, ``flags`` (flags and bans) or ``none``."""
    seed: int = 0
    """Seed of the sliced-Wasserstein directions."""

    def metric_names(self) -> list[str]:
        return [m.strip() for m in self.metrics.split(",") if m.strip()]


# --- the wire form ---------------------------------------------------------------------------


def reads_coefficients(payload: Encoded, view: str) -> bool:
    """Compressing codecs put k-dim coefficients on the wire; ``auto`` verifies those directly."""
    return view == "auto" and "coeffs" in payload.tensors


def wire_values(payload: Encoded, kind: Kind, codec: Codec, view: str) -> torch.Tensor:
    """The message as the verifier reads it: (b, n, c) values — coefficients or decoded."""
    if reads_coefficients(payload, view):
        return payload.tensors["coeffs"].float()
    return codec.decode(payload, kind).float()


def wire_payload(values: torch.Tensor, template: Encoded, kind: Kind, codec: Codec,
                 view: str) -> Encoded:
    """A replacement message built from verifier-side values, in the template's wire format."""
    if reads_coefficients(template, view):
        coeffs = template.tensors["coeffs"]
        tensors = template.tensors | {"coeffs": values.to(coeffs.dtype).reshape(coeffs.shape)}
        return Encoded(tensors, template.shape, template.dtype, dict(template.meta))
    return codec.encode(values.reshape(template.shape).to(template.dtype), kind,
                        template.tensors.get("ids"))


def combine(summaries: list[Summary], how: str) -> Summary:
    """The element-wise mean or median of several summaries (``median``: robust to a minority)."""
    means, tables = torch.stack([s.mean for s in summaries]), torch.stack([s.table for s in summaries])
    if how == "median":
        return Summary(torch.quantile(means, 0.5, dim=0), torch.quantile(tables, 0.5, dim=0))
    return Summary(means.mean(0), tables.mean(0))


# --- decisions -------------------------------------------------------------------------------

Action = Literal["accept", "warmup", "flag", "banned", "skip"]


@dataclass
class Decision:
    """What the verifier did with one message, with the evidence (replayable from the log).

    ``accept``/``flag`` are fence decisions; ``warmup`` is accepted before the fences apply;
    ``banned`` is quarantined because its sender is banned; ``skip`` belongs to a microbatch an
    earlier flag already quarantined and is not scored.
    """

    step: int
    microbatch: int
    kind: Kind
    src: WorkerId
    dst: WorkerId
    action: Action
    reason: str = ""  # fired metrics ("l2n,sfr") or a sanity failure ("nonfinite", "shape", "norm")
    distances: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)

    @property
    def scored(self) -> bool:
        """A fence decision counted in precision/recall (warm-up and skipped messages are not)."""
        return self.action in ("accept", "flag", "banned")

    @property
    def flagged(self) -> bool:
        return self.action in ("flag", "banned")

    def record(self) -> dict:
        """JSON-ready, with the 1-based step of metrics.jsonl."""
        return {"kind": "decision", "step": self.step + 1, "microbatch": self.microbatch,
                "message": self.kind, "src": str(self.src), "dst": str(self.dst),
                "action": self.action, "reason": self.reason,
                "distances": self.distances,
                "thresholds": {m: t if t != float("inf") else None for m, t in self.thresholds.items()}}


@dataclass
class Ban:
    """A banned worker, the step (0-based index, like ``attack.start_step``) and the evidence."""

    worker: WorkerId
    step: int
    metric: str  # the metric that fired on the deciding strike (largest distance / fence)
    boundary: str  # e.g. "s1|s2"
    kind: Kind
    strikes: int

    def record(self) -> dict:
        """The ``banned_workers`` entry of summary.json; ``step`` is 1-based as in metrics.jsonl."""
        return {"worker": str(self.worker), "step": self.step + 1, "metric": self.metric,
                "boundary": self.boundary, "message": self.kind, "strikes": self.strikes}


@dataclass
class StepOutcome:
    """What ``Sentinel.end_step`` reports: the step's decisions, new bans and rebased references."""

    decisions: list[Decision]
    bans: list[Ban]
    rebased: list[str]  # e.g. "s2|s3 act": a majority of senders flagged, strikes voided


@dataclass
class Verdict:
    distances: dict[str, float]
    fired: list[str]
    sanity: str  # "" when the sanity checks pass
    norm: float

    def flagged(self, min_metrics: int) -> bool:
        return bool(self.sanity) or len(self.fired) >= min_metrics

    def reason(self, thresholds: dict[str, float]) -> str:
        """The sanity failure, or the fired metrics, the strongest (distance / fence) first."""
        if self.sanity:
            return self.sanity
        ratio = {m: self.distances[m] / max(thresholds[m], 1e-30) for m in self.fired}
        return ",".join(sorted(self.fired, key=lambda m: -ratio[m]))


# --- one boundary, one direction -------------------------------------------------------------


class BoundaryVerifier:
    """The reference EMA, one fence per metric and the sanity state of one boundary and direction.

    ``check`` scores a message against the state frozen at the start of the step; ``accept`` queues
    an accepted message; ``commit`` (at the step's end) folds the queue into the EMA and windows.
    A flagged message is never queued, so flags are inert.
    """

    def __init__(self, cfg: VerifyConfig, beta: float):
        self.cfg = cfg
        self.beta = beta
        self.metrics = cfg.metric_names()
        self.levels = quantile_levels(cfg.swd_quantiles)
        self.directions: torch.Tensor | None = None  # (c, L), made when the channel count is known
        self.reference: Summary | None = None
        self.fences = {m: TukeyFence(cfg.fence_k, cfg.window) for m in self.metrics}
        self.thresholds = {m: float("inf") for m in self.metrics}
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.median_norm: float | None = None
        self.shape: tuple[int, ...] | None = None
        self.pending: list[tuple[tuple[int, int], Summary, dict[str, float], float]] = []
        self.rejected: list[tuple[tuple[int, int], Summary]] = []  # flagged this step, for a rebase

    def summarize(self, values: torch.Tensor) -> Summary:
        if self.directions is None:
            self.directions = swd_directions(values.shape[-1], self.cfg.swd_directions, self.cfg.seed)
        return summarize(values, self.cfg.statistic, self.directions, self.levels)

    def sanity(self, values: torch.Tensor, norm: float) -> str:
        """A shape other than the boundary's, non-finite values, or a norm far off the median."""
        if self.shape is not None and tuple(values.shape) != self.shape:
            return "shape"
        if not math.isfinite(norm):  # one NaN or inf entry (or an overflowing one) makes the norm so
            return "nonfinite"
        if self.median_norm is not None:
            ratio = self.cfg.norm_ratio
            if not self.median_norm / ratio <= norm <= self.median_norm * ratio:
                return "norm"
        return ""

    def distances(self, summary: Summary) -> dict[str, float]:
        if self.reference is None:
            return {}
        return message_distances(summary, self.reference, self.metrics)

    def check(self, values: torch.Tensor, fences_on: bool) -> tuple[Verdict, Summary | None]:
        """Score a message; the summary is None when a sanity check failed before it was computed."""
        norm = values.norm().item()
        sanity = self.sanity(values, norm)
        if sanity:
            return Verdict({}, [], sanity, norm), None
        summary = self.summarize(values)
        distances = self.distances(summary)
        fired = [m for m, d in distances.items() if fences_on and d > self.thresholds[m]]
        return Verdict(distances, fired, "", norm), summary

    def accept(self, order: tuple[int, int], shape: tuple[int, ...], summary: Summary,
               distances: dict[str, float], norm: float) -> None:
        if self.shape is None:
            self.shape = shape
        self.pending.append((order, summary, distances, norm))

    def reject(self, order: tuple[int, int], summary: Summary | None) -> None:
        """A flagged message: kept aside only in case this step's reference turns out stale."""
        if summary is not None:
            self.rejected.append((order, summary))

    def commit(self) -> None:
        """Fold the step's accepted messages into the reference, windows and norm median."""
        accepted = sorted(self.pending, key=lambda p: p[0])
        for _, _, distances, norm in accepted:
            for m, d in distances.items():
                self.fences[m].add(d)
            self.norms.append(norm)
        by_microbatch: dict[int, list[Summary]] = {}
        for (microbatch, _), summary, _, _ in accepted:
            by_microbatch.setdefault(microbatch, []).append(summary)
        for summaries in by_microbatch.values():
            if self.cfg.reference_update == "median" and len(summaries) >= ROBUST_GROUP:
                median = combine(summaries, "median")
                self.reference = ema(self.reference, median, self.beta ** len(summaries))
            else:
                for summary in summaries:
                    self.reference = ema(self.reference, summary, self.beta)
        self._close_step()

    def rebase(self) -> None:
        """Restart the reference from this step's messages, accepted or flagged, combined as in
        ``reference_update`` (an EMA started afresh would lean on the first one and flag the next
        step again); the windows keep their history (this step's distances were measured against a
        stale reference)."""
        groups: dict[int, list[Summary]] = {}
        for (microbatch, _), summary in [(o, s) for o, s, _, _ in self.pending] + self.rejected:
            groups.setdefault(microbatch, []).append(summary)
        robust = any(len(g) >= ROBUST_GROUP for g in groups.values())
        if self.cfg.reference_update == "median" and robust:  # per microbatch, then averaged
            self.reference = combine([combine(g, "median" if len(g) >= ROBUST_GROUP else "mean")
                                      for g in groups.values()], "mean")
        elif groups:
            self.reference = combine([s for g in groups.values() for s in g], "mean")
        self.norms.extend(norm for _, _, _, norm in self.pending)
        self._close_step()

    def calibrate(self, fpr_target: float) -> None:
        """End of warm-up: raise each fence's k so its metric's share of false flags fits the target."""
        for fence in self.fences.values():
            fence.calibrate(fpr_target / len(self.fences))
        self.thresholds = {m: f.threshold() for m, f in self.fences.items()}

    def _close_step(self) -> None:
        self.pending.clear()
        self.rejected.clear()
        self.thresholds = {m: f.threshold() for m, f in self.fences.items()}
        self.median_norm = statistics.median(self.norms) if self.norms else None

    def placeholder(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The reference broadcast to a message's (b, n, c) shape: what replaces a quarantined one."""
        if self.reference is None:
            return torch.zeros(shape)
        return self.reference.mean.expand(shape).contiguous()

    def state_dict(self) -> dict:
        """Everything, including accepted messages not yet folded in (a shadow verifier commits lazily)."""
        return {"reference": None if self.reference is None else dataclasses.asdict(self.reference),
                "fences": {m: f.state_dict() for m, f in self.fences.items()},
                "norms": list(self.norms), "shape": self.shape,
                "pending": [(order, dataclasses.asdict(summary), distances, norm)
                            for order, summary, distances, norm in self.pending],
                "rejected": [(order, dataclasses.asdict(summary)) for order, summary in self.rejected]}

    def load_state_dict(self, state: dict) -> None:
        ref = state["reference"]
        self.reference = None if ref is None else Summary(**ref)
        for m, f in self.fences.items():
            f.load_state_dict(state["fences"][m])
        self.norms.clear()
        self.norms.extend(state["norms"])
        self.shape = None if state["shape"] is None else tuple(state["shape"])
        self.pending = []
        self.commit()  # recompute the frozen thresholds and median from the restored windows
        self.pending = [(tuple(order), Summary(**summary), distances, norm)
                        for order, summary, distances, norm in state["pending"]]
        self.rejected = [(tuple(order), Summary(**summary)) for order, summary in state["rejected"]]


# --- the whole mesh --------------------------------------------------------------------------


class Sentinel:
    """All verifiers of a mesh, the strike ledger and the skip lists; the driver's message monitor."""

    def __init__(self, cfg: VerifyConfig, mesh: MeshShape, codec: Codec):
        self.cfg = cfg
        self.codec = codec
        self.verifiers = {(b, kind): BoundaryVerifier(cfg, cfg.beta_act if kind == "act" else cfg.beta_grad)
                          for b in range(mesh.stages - 1) for kind in ("act", "grad")}
        self.history: dict[WorkerId, deque[bool]] = {}
        self.banned: dict[WorkerId, Ban] = {}  # banned and not yet replaced
        self.bans: list[Ban] = []
        self.decisions: list[Decision] = []
        # This step's scored messages as (sender, (microbatch, kind), verifier key, flagged, reason):
        # strikes enter the histories (and bans are decided) at the step's end, after the majority check.
        self.scored: list[tuple[WorkerId, tuple[int, str], tuple[int, str], bool, str]] = []
        # (step, replica, microbatch) quarantined this step: dropped (activation flagged) or
        # patched (a gradient replaced); trusted state, never taken from a worker's skip flag.
        self.dropped: set[tuple[int, int, int]] = set()
        self.patched: set[tuple[int, int, int]] = set()

    def inspect(self, message: Message) -> Message:
        """Score one arriving message; return it, or its quarantined replacement marked ``skip``."""
        key = (message.step, message.src.replica, message.microbatch)
        boundary = min(message.src.stage, message.dst.stage)
        verifier = self.verifiers[(boundary, message.kind)]
        values = wire_values(message.payload, message.kind, self.codec, self.cfg.view)
        if key in self.dropped:
            self._decide(message, "skip", "dropped")
            fill = values.new_zeros(values.shape) if message.kind == "grad" else None
            return self._replace(message, verifier, values, fill)
        if message.kind == "grad" and key in self.patched:
            self._decide(message, "skip", "patched")
            return dataclasses.replace(message, skip=True)
        if message.src in self.banned:
            self._decide(message, "banned", "banned")
            return self._quarantine(message, verifier, values, key)
        warm = message.step < self.cfg.warmup_steps
        verdict, summary = verifier.check(values, fences_on=not warm)
        flagged = verdict.flagged(self.cfg.min_metrics)
        reason = verdict.reason(verifier.thresholds) if flagged else ""
        action: Action = "flag" if flagged else ("warmup" if warm else "accept")
        self._decide(message, action, reason, verdict.distances, verifier.thresholds)
        order = (message.microbatch, message.src.replica)
        self.scored.append((message.src, (message.microbatch, message.kind), (boundary, message.kind),
                            flagged, reason))
        if flagged:
            verifier.reject(order, summary)
            return self._quarantine(message, verifier, values, key)
        verifier.accept(order, tuple(values.shape), summary, verdict.distances, verdict.norm)
        return message

    def end_step(self, step: int) -> StepOutcome:
        """Close step ``step``: update references and fences, enter strikes, decide bans."""
        stale, voided = self._stale_references() if self.cfg.majority_rebase else (set(), set())
        for key, verifier in self.verifiers.items():
            if key in stale:
                verifier.rebase()
            else:
                verifier.commit()
        if step == self.cfg.warmup_steps - 1 and self.cfg.fpr_target > 0:
            for verifier in self.verifiers.values():
                verifier.calibrate(self.cfg.fpr_target)
        bans = self._enter_strikes(step, voided)
        outcome = StepOutcome(self.decisions, bans, [f"s{b}|s{b + 1} {kind}" for b, kind in sorted(stale)])
        self.decisions, self.scored = [], []
        self.dropped.clear()
        self.patched.clear()
        return outcome

    def readmit(self, wid: WorkerId) -> None:
        """A replacement took over a banned slot: it starts with a clean record."""
        self.banned.pop(wid, None)
        self.history.pop(wid, None)

    # --- internals ---------------------------------------------------------------------------

    def _decide(self, message: Message, action: Action, reason: str,
                distances: dict[str, float] | None = None,
                thresholds: dict[str, float] | None = None) -> None:
        distances = dict(distances or {})
        thresholds = {m: thresholds[m] for m in distances} if thresholds else {}
        self.decisions.append(Decision(message.step, message.microbatch, message.kind, message.src,
                                       message.dst, action, reason, distances, thresholds))

    def _stale_references(self) -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
        """Verifiers where a strict majority of (2 or more) senders had a message flagged this step,
        and among them those with 3 or more senders, whose strikes are voided.

        With 2 senders, one attacker plus one honest false positive make such a "majority": voiding
        then let an adaptive attacker rebase the reference every step and never be banned (measured).
        """
        senders: dict[tuple[int, str], dict[WorkerId, bool]] = {}
        for wid, _, key, flagged, _ in self.scored:
            by_sender = senders.setdefault(key, {})
            by_sender[wid] = by_sender.get(wid, False) or flagged
        stale = {key for key, by_sender in senders.items()
                 if len(by_sender) >= 2 and 2 * sum(by_sender.values()) > len(by_sender)}
        return stale, {key for key in stale if len(senders[key]) >= 3}

    def _enter_strikes(self, step: int, voided: set[tuple[int, str]]) -> list[Ban]:
        """Append the step's results to each sender's history in a fixed order; ban at s strikes."""
        bans = []
        for wid, _, (boundary, kind), flagged, reason in sorted(self.scored, key=lambda e: (e[0], e[1])):
            history = self.history.setdefault(wid, deque(maxlen=self.cfg.strike_history))
            strike = flagged and (boundary, kind) not in voided
            history.append(strike)
            count = sum(history)
            if self.cfg.ban and strike and count >= self.cfg.strikes \
                    and step >= self.cfg.warmup_steps and wid not in self.banned:
                ban = Ban(wid, step, reason.split(",")[0], f"s{boundary}|s{boundary + 1}", kind, count)
                self.banned[wid] = ban
                bans.append(ban)
        self.bans += bans
        return bans

    def _quarantine(self, message: Message, verifier: BoundaryVerifier, values: torch.Tensor,
                    key: tuple[int, int, int]) -> Message:
        if message.kind == "act":
            self.dropped.add(key)
            return self._replace(message, verifier, values, None)
        self.patched.add(key)
        fill = values.new_zeros(values.shape) if self.cfg.grad_action == "zero" else None
        return self._replace(message, verifier, values, fill)

    def _replace(self, message: Message, verifier: BoundaryVerifier, values: torch.Tensor,
                 fill: torch.Tensor | None) -> Message:
        """The message with ``fill`` (default: the reference placeholder) as payload, marked skip."""
        if fill is None:
            fill = verifier.placeholder(tuple(values.shape))
        payload = wire_payload(fill, message.payload, message.kind, self.codec, self.cfg.view)
        return dataclasses.replace(message, payload=payload, skip=True)

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"verifiers": {f"{b}:{k}": v.state_dict() for (b, k), v in self.verifiers.items()},
                "history": {str(w): list(h) for w, h in self.history.items()},
                "banned": [str(w) for w in self.banned],
                "bans": [dataclasses.asdict(b) | {"worker": str(b.worker)} for b in self.bans]}

    def load_state_dict(self, state: dict) -> None:
        for (b, k), verifier in self.verifiers.items():
            verifier.load_state_dict(state["verifiers"][f"{b}:{k}"])
        self.history = {WorkerId.parse(w): deque(h, maxlen=self.cfg.strike_history)
                        for w, h in state["history"].items()}
        self.bans = [Ban(**(b | {"worker": WorkerId.parse(b["worker"])})) for b in state["bans"]]
        by_worker = {b.worker: b for b in self.bans}
        self.banned = {WorkerId.parse(w): by_worker[WorkerId.parse(w)] for w in state["banned"]}

