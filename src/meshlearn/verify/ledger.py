"""Blame and bans: who a flag counts against, when a worker is banned, and when SENTINEL stops banning.

Three rules make the defence fail safe (issue 17: without them, attacks whose damage shows
downstream got honest workers banned by the hundred, first stage included):

- **Attribution.** The six messages of one (step, microbatch, replica) form a causal chain: the
  activations s0→s1→…→s(P−1), then the gradients back. A message depends on every earlier one.
  A flagged message earns its sender a strike only if no earlier message of its chain, sent by
  another worker, was *suspect* — scored at least ``verify.explain_level`` of the way from its
  window's median to its fence. Otherwise the anomaly is explained upstream (for a gradient, also
  downstream: the gradients it back-propagated) and the message is quarantined without blame.
  Failures of the pair distance ``coh`` (a worker's output against its own input) and sanity
  failures are never explained away: they concern the sender alone.
- **A ban budget from the threat model**: never the first or last stage where ``verify.trusted_ends``
  assumes them honest, and per stage at most ``VerifyConfig.budget(D)`` bans over the run
  (default ⌈D/2⌉ − 1, a strict minority: 0 at 2 replicas, 1 at 4). Evidence beyond that raises an
  ``Alert`` instead: the worker keeps its
  slot and its flagged messages are still quarantined one by one.
- **Outliers among peers.** A strike also needs the message to stand out from its peers: its
  suspicion at least ``verify.ban_margin`` fence-widths above the median suspicion of the other
  senders' messages on the same boundary in the same step. A benign change that moves every
  sender towards the fence (measured: a 10% scale change on all senders once banned an honest
  replica at 3 replicas) flags the unlucky one without striking it; an attacker's flags sit far out.
- **A strike is a step's evidence, not a message's.** Statistical flags count once per boundary and
  direction, when they are a strict majority of the sender's messages there in the step; a pair
  distance or sanity failure (the sender's own fault) is a strike by itself (``step_strikes``).
  ``strikes`` within the sender's last ``strike_history`` steps ban it.
- **Strikes enter at the step's end** in a fixed order, after the majority check (see
  ``Sentinel``), so decisions do not depend on arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from meshlearn.compress.codecs import Kind
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.settings import VerifyConfig

Action = Literal["accept", "warmup", "flag", "banned", "skip"]
BanKind = Literal["act", "grad", "dp"]
"""What a ban's evidence was on: a pipeline message's kind, or ``dp`` (a DP outlier report,
``dp/attribution.py``, decided under the same budget)."""
UNEXPLAINABLE = ("coh", "shape", "nonfinite", "norm")
"""Reasons that concern the sender alone (its output against its own input, or a sanity failure)."""


@dataclass
class Decision:
    """What the verifier did with one message, with the evidence (replayable from the log).

    ``accept``/``flag`` are fence decisions; ``warmup`` is accepted before the fences apply;
    ``banned`` is quarantined because its sender is banned; ``skip`` belongs to a microbatch an
    earlier flag already quarantined and is not scored. ``explained_by`` names the earlier suspect
    message of the same microbatch that took the blame off a flagged one (no strike).
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
    explained_by: str = ""
    delivered: bool = False  # a flag passed on unchanged (an undecided boundary, ``capture.py``)
    norm: float = 0.0  # the message's norm (the last stage's blame rule compares it with its peers')

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
                "action": self.action, "reason": self.reason, "explained_by": self.explained_by,
                "delivered": self.delivered, "norm": self.norm,
                "distances": self.distances,
                "thresholds": {m: t if t != float("inf") else None for m, t in self.thresholds.items()}}


@dataclass
class Ban:
    """A banned worker, the step (0-based index, like ``attack.start_step``) and the evidence."""

    worker: WorkerId
    step: int
    metric: str  # the metric that fired on the deciding strike (largest distance / fence)
    boundary: str  # e.g. "s1|s2"; a DP eviction: "s1 dp"
    kind: BanKind
    strikes: int  # a DP eviction: its marks in the attribution window

    def record(self) -> dict:
        """The ``banned_workers`` entry of summary.json; ``step`` is 1-based as in metrics.jsonl."""
        return {"worker": str(self.worker), "step": self.step + 1, "metric": self.metric,
                "boundary": self.boundary, "message": self.kind, "strikes": self.strikes}


@dataclass
class Alert:
    """Evidence SENTINEL will not act on: a ban the threat model does not allow."""

    worker: WorkerId
    step: int  # 0-based
    cause: Literal["budget", "honest_stage", "undecided", "ends"]
    strikes: int
    detail: str

    def record(self) -> dict:
        """A metrics.jsonl / summary.json record (1-based step)."""
        return {"kind": "alert", "step": self.step + 1, "worker": str(self.worker),
                "cause": self.cause, "strikes": self.strikes, "detail": self.detail}


@dataclass
class Scored:
    """One scored message, as the ledger sees it at the step's end."""

    src: WorkerId
    microbatch: int
    kind: Kind
    verifier: tuple[int, Kind]  # (boundary, kind)
    flagged: bool
    reason: str
    suspicion: float  # BoundaryVerifier.score: 0 at the windows' medians, 1 at the fences
    decision: Decision
    excess: float = float("inf")  # suspicion minus the median of the same step's peer messages
    provisional: bool = False  # a warm-up message (accepted, or quarantined as suspended): no strike
    open_fences: bool = False  # scored while some of its fences were open (warm-up or re-warm-up)
    mean_share: float | None = None  # a verified last stage's gradients: ``ends.mean_share``

    def chain_index(self, stages: int) -> int:
        """Position in its microbatch's causal chain: activations by stage, then gradients back."""
        s = self.src.stage
        return s if self.kind == "act" else 2 * (stages - 1) - s + 1

    @property
    def own_fault(self) -> bool:
        return any(r in UNEXPLAINABLE for r in self.reason.split(","))


def peer_excess(scored: list[Scored]) -> None:
    """Set each message's excess: its suspicion minus the median suspicion of the other senders'
    messages on the same boundary and direction this step (its own suspicion without peers)."""
    by_verifier: dict[tuple[int, str], list[Scored]] = {}
    for e in scored:
        by_verifier.setdefault(e.verifier, []).append(e)
    for group in by_verifier.values():
        for e in group:
            peers = sorted(p.suspicion for p in group if p.src != e.src)
            median = 0.0 if not peers else (peers[(len(peers) - 1) // 2] + peers[len(peers) // 2]) / 2
            e.excess = e.suspicion - median


def upstream_suspects(scored: list[Scored], stages: int,
                      suspect: Callable[[Scored], bool]) -> dict[int, Scored]:
    """For each message (by ``id``) with an earlier ``suspect`` message of its chain from another
    worker, the most suspicious of them: what explains its anomaly."""
    chains: dict[tuple[int, int, int], list[Scored]] = {}
    for e in scored:
        chains.setdefault((e.decision.step, e.src.replica, e.microbatch), []).append(e)
    worst: dict[int, Scored] = {}
    for chain in chains.values():
        chain.sort(key=lambda e: e.chain_index(stages))
        for i, e in enumerate(chain):
            suspects = [p for p in chain[:i] if p.src != e.src and suspect(p)]
            if suspects:
                worst[id(e)] = max(suspects, key=lambda p: p.suspicion)
    return worst


def attribute(scored: list[Scored], stages: int, level: float) -> None:
    """Mark flagged messages whose anomaly an earlier suspect message of their chain explains."""
    suspects = upstream_suspects(scored, stages, lambda p: p.suspicion >= level)
    for e in scored:
        if e.flagged and not e.own_fault and id(e) in suspects:
            e.decision.explained_by = f"{suspects[id(e)].src} {suspects[id(e)].kind}"


class Ledger:
    """Strike histories, bans, the per-stage ban budget and alerts."""

    def __init__(self, cfg: VerifyConfig, mesh: MeshShape):
        self.cfg = cfg
        self.mesh = mesh
        self.budget = cfg.budget(mesh.replicas)
        # strikes per closed step in which the worker had non-provisional scored messages
        self.history: dict[WorkerId, deque[int]] = {}
        self.banned: dict[WorkerId, Ban] = {}  # banned and not yet replaced
        self.bans: list[Ban] = []
        self.alerts: list[Alert] = []
        self.alerted: set[tuple[WorkerId, str]] = set()  # one alert per worker and cause

    def honest_stage(self, stage: int) -> bool:
        """A stage the threat model assumes honest: never banned nor suspended (``verify.trusted_ends``)."""
        return stage in (0, self.mesh.stages - 1) and self.cfg.ends_trusted(self.mesh.replicas)

    def stage_bans(self, stage: int) -> int:
        return sum(b.worker.stage == stage for b in self.bans)

    def enter(self, step: int, scored: list[Scored],
              voided: set[tuple[int, str]]) -> tuple[list[Ban], list[Alert]]:
        """Add the step's strikes to each sender's history (``step_strikes``) in a fixed order; ban
        at ``strikes`` within its last ``strike_history`` steps, within the budget; alert beyond it."""
        bans, alerts = [], []
        for src, (count, evidence) in sorted(self.step_strikes(scored, voided).items()):
            history = self.history.setdefault(src, deque(maxlen=self.cfg.strike_history))
            history.append(count)
            total = sum(history)
            if not (self.cfg.ban and count and total >= self.cfg.strikes
                    and step >= self.cfg.warmup_steps and src not in self.banned):
                continue
            boundary, kind = evidence.verifier
            ban, alert = self.decide(src, step, total, evidence.reason.split(",")[0],
                                     f"s{boundary}|s{boundary + 1}", kind)
            bans += [ban] if ban is not None else []
            alerts += [alert] if alert is not None else []
        return bans, alerts

    def step_strikes(self, scored: list[Scored],
                     voided: set[tuple[int, str]]) -> dict[WorkerId, tuple[int, Scored | None]]:
        """Each scored sender's strikes this step, with the strongest piece of evidence.

        A flagged message is *eligible* when its boundary was not voided, nothing earlier in its
        chain explains it and it stands out from its peers (``ban_margin``). An eligible message
        whose fault is its own (``own_fault``: a pair distance or a sanity failure, which honest
        traffic almost never trips) is one strike. Statistical flags (the four distances, the gain)
        count once per boundary and direction, and only when they are a strict majority of the
        sender's scored messages there this step (leaving out those explained upstream and its
        own-fault strikes): honest gradients are heavy-tailed, and an honest last-stage replica
        whose fence sat a little low collected 3 single flags in 5 steps of a clean run (measured,
        seed 1 at 4 replicas: an alert, a ban one stage earlier), while an attack the distances see
        is flagged on (nearly) all of its messages."""
        margin = self.cfg.ban_margin
        own: dict[WorkerId, list[Scored]] = {}
        groups: dict[tuple[WorkerId, tuple[int, Kind]], list[int]] = {}  # [scored, eligible]
        strongest: dict[tuple[WorkerId, tuple[int, Kind]], Scored] = {}
        for e in scored:
            if e.provisional:  # only the peer check reads it (Sentinel._peer_outliers)
                continue
            eligible = (e.flagged and e.verifier not in voided and not e.decision.explained_by
                        and (margin <= 0 or e.excess >= margin))
            own.setdefault(e.src, [])
            if e.flagged and e.decision.explained_by:  # another worker's evidence, not this one's
                continue
            if eligible and e.own_fault:
                own[e.src].append(e)
                continue
            group = groups.setdefault((e.src, e.verifier), [0, 0])
            group[0] += 1
            if eligible:
                group[1] += 1
                best = strongest.get((e.src, e.verifier))
                if best is None or e.suspicion > best.suspicion:
                    strongest[(e.src, e.verifier)] = e
        result: dict[WorkerId, tuple[int, Scored | None]] = {}
        for src, mine in own.items():
            majorities = [strongest[key] for key, (n, k) in sorted(groups.items())
                          if key[0] == src and 2 * k > n]
            evidence = mine + majorities
            result[src] = (len(evidence), max(evidence, key=lambda e: e.suspicion, default=None))
        return result

    def decide(self, wid: WorkerId, step: int, strikes: int, metric: str, boundary: str,
               kind: BanKind, kept: str = "its flagged messages are still quarantined"
               ) -> tuple[Ban | None, Alert | None]:
        """Ban ``wid`` on ``strikes`` pieces of evidence, unless the threat model forbids it (a
        stage assumed honest, or the stage's ban budget spent): then alert, once per cause, saying
        what still holds the worker back (``kept``)."""
        stage = wid.stage
        if self.honest_stage(stage):
            return None, self.alert(wid, step, "honest_stage", strikes,
                                     f"{strikes} strikes against a worker of stage {stage}, which the "
                                     "threat model assumes honest: not banned (false positives or an "
                                     "attack the statistics attribute wrongly)")
        if self.stage_bans(stage) >= self.budget:
            minority = " (no honest majority at 2 replicas)" if self.mesh.replicas <= 2 else ""
            return None, self.alert(wid, step, "budget", strikes,
                                     f"stage {stage} has {self.mesh.replicas} replicas and "
                                     f"{self.stage_bans(stage)} ban(s) already; the ban budget is "
                                     f"{self.budget} (a strict minority): not banned, {kept}"
                                     + minority)
        ban = Ban(wid, step, metric, boundary, kind, strikes)
        self.banned[wid] = ban
        self.bans.append(ban)
        return ban, None

    def count(self, ban: Ban) -> None:
        """A ban decided by another ledger (the dist verifier's, carried out here): it spends this
        stage's budget here too, so one budget holds for SENTINEL's bans and DP evictions."""
        self.bans.append(ban)

    def undecided(self, wid: WorkerId, step: int, detail: str) -> Alert | None:
        """An undecided split (``capture.py``): flagged, but nothing says it is the one that lies."""
        return self.alert(wid, step, "undecided", 0, detail)

    def alert(self, wid: WorkerId, step: int, cause: str, strikes: int, detail: str) -> Alert | None:
        """A new alert, or None when ``wid`` already has one for ``cause`` (one per worker and cause)."""
        if (wid, cause) in self.alerted:
            return None
        self.alerted.add((wid, cause))
        alert = Alert(wid, step, cause, strikes, detail)
        self.alerts.append(alert)
        return alert

    def readmit(self, wid: WorkerId) -> None:
        """A replacement took over a banned slot: it starts with a clean record."""
        self.banned.pop(wid, None)
        self.history.pop(wid, None)
        self.alerted = {(w, c) for w, c in self.alerted if w != wid}

    def state_dict(self) -> dict:
        return {"history_unit": "steps", "history": {str(w): list(h) for w, h in self.history.items()},
                "banned": [str(w) for w in self.banned],
                "bans": [vars(b) | {"worker": str(b.worker)} for b in self.bans],
                "alerts": [vars(a) | {"worker": str(a.worker)} for a in self.alerts]}

    def load_state_dict(self, state: dict) -> None:
        # Before session 6 a history held one flag per message: not comparable with per-step
        # strike counts, so such a record restarts clean rather than banning on old evidence.
        histories = state["history"] if state.get("history_unit") == "steps" else {}
        self.history = {WorkerId.parse(w): deque(h, maxlen=self.cfg.strike_history)
                        for w, h in histories.items()}
        self.bans = [Ban(**(b | {"worker": WorkerId.parse(b["worker"])})) for b in state["bans"]]
        self.alerts = [Alert(**(a | {"worker": WorkerId.parse(a["worker"])}))
                       for a in state.get("alerts", [])]
        self.alerted = {(a.worker, a.cause) for a in self.alerts}
        by_worker = {b.worker: b for b in self.bans}
        self.banned = {WorkerId.parse(w): by_worker[WorkerId.parse(w)] for w in state["banned"]}
