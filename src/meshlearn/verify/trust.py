"""A run's trust layer: attacks on workers, SENTINEL on the driver, bans carried out, and the scorecard.

The trainer owns one ``TrustLayer``. It installs each attack as its worker's ``tamper`` hook and the
``Sentinel`` as the driver's message monitor; after every step it collects the verifier's decisions,
scores them against the ground truth only a simulation has (each attack records which messages it
actually changed), and carries out bans.

A ban is realized as in SWARM, where peers come and go: the banned slot is taken over by a fresh,
honest peer that downloads the stage's weights and optimizer state from an honest replica of the
same stage (the one with the cleanest recent record), and starts with a clean strike history. The
banned worker's attack ends with it. The download is not charged to the virtual clock (a one-off cost
per ban). Until the step ends, the banned worker's remaining messages are quarantined.

Under ``mesh.schedule = async`` a worker is idle (and its state can be copied) only at a drain
point. A ban decided at the end of step t is then *pending*: the layer asks the trainer for a drain
after the last step the driver has fed (``drain_at = fed + 1`` steps done; a drain earlier than
that would contradict work already handed out, see train/signals.py for the same rule), every
message of the worker is quarantined meanwhile, and ``on_drain`` carries the replacement out.

Under ``backend = "dist"`` each worker process holds a layer over its own worker: the attacks of
its own worker are installed there (they run in the attacker's process), the others are kept for
scoring only; ``Sentinel`` runs in the verifier process and the layer holds a ``RemoteSentinel``
(``verify/verdicts.py``) that returns the verifier's published outcome of each step. The driver
supplies what crosses processes: ``exchange_truth`` (each attacker's ground truth, for the
process that writes the records) and ``copy_worker_state`` (a donor's state over the stage's DP
group, at the step's end, where every worker of a flushing schedule is idle; under async at the
drain point). An elastic driver supplies ``evict`` instead: the banned worker's row leaves the
run and nobody takes the slot (``elastic/evictions.py``). An async dist run reports its steps only
at drain points, so there the drain a ban needs comes from verdicts the driver read ahead
(``RemoteSentinel.ban_drain_due``).

A DP outlier report (``dp/attribution.py``, issue 32) is the other source of bans: ``evict``
decides it with the same ledger rules (``Ledger.decide``: never a stage assumed honest, at most
``verify.budget(D)`` bans per stage, SENTINEL's and DP's together) and carries it out here, the
same way. Every process decides it from the same step report, so sim and dist agree on it; the
budget's ledger is SENTINEL's own in the simulator and, where the verifier runs elsewhere (dist) or
nothing verifies, one of this layer's, which counts every ban carried out.

Per-worker attacks from Python::

    register_builtin_plugins()  # meshlearn.entry.plugins
    trainer = Trainer(cfg, run_dir)
    trust = trainer.plugins["trust"].trust
    trust.add_attack(WorkerId(1, 2), build_attack("zeros", AttackConfig(start_step=100), seed=1))
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from meshlearn.compress.registry import build_codec
from meshlearn.dp.settings import evicts_dp_outliers
from meshlearn.mesh.driver import Driver, MessageMonitors
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.verify.attacks import Attack, build_attacks
from meshlearn.verify.capabilities import BanNotices, Evictor, RemoteVerdicts
from meshlearn.verify.ledger import Ledger
from meshlearn.verify.sentinel import Alert, Ban, Decision, Sentinel
from meshlearn.verify.verdicts import RemoteSentinel, ban_from_record


@dataclass
class Confusion:
    """Message-level counts: a positive is a message its sender's attack actually changed."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0

    def add(self, flagged: bool, malicious: bool) -> None:
        if flagged:
            self.tp += malicious
            self.fp += not malicious
        else:
            self.fn += malicious
            self.tn += not malicious

    def __add__(self, other: Confusion) -> Confusion:
        return Confusion(self.tp + other.tp, self.fp + other.fp, self.fn + other.fn, self.tn + other.tn)

    def report(self) -> dict:
        """Counts plus precision, recall, F1 and false-positive rate (None where undefined)."""
        precision = self.tp / (self.tp + self.fp) if self.tp + self.fp else None
        recall = self.tp / (self.tp + self.fn) if self.tp + self.fn else None
        f1 = (2 * precision * recall / (precision + recall)
              if precision is not None and recall is not None and precision + recall else None)
        fpr = self.fp / (self.fp + self.tn) if self.fp + self.tn else None
        return {"tp": self.tp, "fp": self.fp, "fn": self.fn, "tn": self.tn, "precision": precision,
                "recall": recall, "f1": f1, "fpr": fpr}


@dataclass
class WorkerTally:
    scored: int = 0
    flags: int = 0
    malicious: int = 0  # messages its attack changed (scored or not)


@dataclass
class StepTrust:
    """What one step's verification produced, for the trainer's logs."""

    decisions: list[dict] = field(default_factory=list)  # verify.jsonl records (per verify.decision_log)
    events: list[dict] = field(default_factory=list)  # metrics.jsonl records: bans, alerts, rebases
    flags: int = 0
    skipped: int = 0


class TrustLayer:
    """``cfg``: the run's RunConfig. ``workers``: this process's workers (all of them in the
    simulator). ``remote``: the verdicts of a verifier in another process, used instead of a
    ``Sentinel`` of its own (dist)."""

    def __init__(self, cfg: Any, workers: dict[WorkerId, Worker], remote: RemoteSentinel | None = None):
        self.cfg = cfg
        self.mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
        self.workers = workers
        self.sentinel: Sentinel | RemoteSentinel | None = None
        if cfg.verify.name == "sentinel":
            self.sentinel = remote or Sentinel(cfg.verify, self.mesh, build_codec(cfg.codec, cfg.model))
        # The ban budget's ledger: SENTINEL's own when it runs here, else this layer's (see above).
        self.own_ledger = not isinstance(self.sentinel, Sentinel)
        self.ledger = Ledger(cfg.verify, self.mesh) if self.own_ledger else self.sentinel.ledger
        self.dp_evictions = evicts_dp_outliers(cfg)  # DP outlier reports may evict (dp/attribution.py)
        self.attacks: dict[WorkerId, Attack] = {}
        for wid, attack in build_attacks(cfg.attack, cfg.verify, self.mesh, cfg.seed).items():
            self.add_attack(wid, attack)
        self.messages = {"act": Confusion(), "grad": Confusion()}
        # per boundary and direction ("s1|s2 act") and per sending stage ("s2"), for the tables
        self.boundaries: dict[str, Confusion] = {}
        self.stages: dict[str, Confusion] = {}
        self.alerts: list[dict] = []
        self.explained = {"malicious": 0, "honest": 0}  # flags attribution took off their sender
        self.warmup_messages = 0
        self.skipped = {"malicious": 0, "honest": 0}
        self.passed = {"malicious": 0, "honest": 0}  # flagged but delivered (capture.py)
        self.tallies: dict[WorkerId, WorkerTally] = {w: WorkerTally() for w in self.mesh.workers()}
        self.banned: list[dict] = []
        self.honest_bans = 0  # bans of a slot with no running attack (ground truth, not evidence)
        self.rebases = 0
        self.rewarms = 0
        self.caught: set[WorkerId] = set()  # attackers banned while their attack ran
        self.driver: Driver | None = None
        self.deferred = cfg.mesh.schedule == "async"  # workers are idle only at drain points
        self.pending_bans: list[Ban] = []  # decided, carried out at the next drain point
        self.drain_at: int | None = None  # steps done after which that drain comes

    @property
    def active(self) -> bool:
        """Whether this run verifies, attacks or may evict anything (else it leaves no trace in the
        outputs)."""
        return self.sentinel is not None or bool(self.attacks) or self.dp_evictions

    def attach(self, driver: Driver) -> None:
        """Install SENTINEL as the driver's monitor (a runtime where every message passes this
        process: ``MessageMonitors``). Its cost is CPU time on the verifiers' own nodes, charged by
        a driver that calls ``Sentinel.release_s`` for the delivery time (one that says so with
        ``monitor_release = True``; see verify/cost.py). A driver that would add the inspection's
        wall time to the virtual clock instead — this machine's CPU time mixed into the GPU device
        model — is not asked to charge anything."""
        self.driver = driver
        if self.sentinel is not None and not isinstance(self.sentinel, RemoteSentinel):
            if not isinstance(driver, MessageMonitors):
                raise RuntimeError(f"{type(driver).__name__} takes no message monitor: SENTINEL runs "
                                   "in a verifier process of its own there")
            driver.attach_monitor(self.sentinel, self.cfg.verify.charge_time and driver.monitor_release)
            if self.deferred:  # steps overlap by up to the driver's feed-ahead (sentinel.py)
                self.sentinel.set_lag(driver.lookahead)

    def add_attack(self, wid: WorkerId, attack: Attack) -> None:
        """Make worker ``wid`` adversarial; not in a stage the threat model keeps honest (the first and
        last, while ``verify.trusted_ends`` says so for this replica count)."""
        if wid not in self.mesh.workers():
            raise ValueError(f"worker {wid} is not in the {self.mesh.replicas}×{self.mesh.stages} mesh")
        if (wid.stage in (0, self.mesh.stages - 1)
                and self.cfg.verify.ends_trusted(self.mesh.replicas)):
            raise ValueError(f"worker {wid}: the first and last stages are honest in SENTINEL's threat "
                             f"model at {self.mesh.replicas} replicas; attack a stage in "
                             f"1..{self.mesh.stages - 2}")
        self.attacks[wid] = attack
        if wid in self.workers:  # dist: installed in the attacker's own process, scored everywhere
            self.workers[wid].tamper = attack
            self.workers[wid].forge = attack.forge

    # --- after each step ---------------------------------------------------------------------

    def end_step(self, step: int) -> StepTrust:
        """Score step ``step``'s decisions against the ground truth and carry out new bans."""
        changed = {wid: attack.pop_changed(step) for wid, attack in self.attacks.items()
                   if wid in self.workers}
        if isinstance(self.driver, RemoteVerdicts):  # dist: the other processes' attackers (for the writer)
            changed = self.driver.exchange_truth(step, changed, sorted(self.attacks))
        for wid, keys in changed.items():
            self.tallies[wid].malicious += len(keys)
        out = StepTrust()
        if self.sentinel is None:
            return out
        outcome = self.sentinel.end_step(step)
        if self.own_ledger:  # the verifier's bans and alerts spend this ledger's budget too
            for ban in outcome.bans:
                self.ledger.count(ban)
            self.ledger.alerted |= {(a.worker, a.cause) for a in outcome.alerts}
        decisions = outcome.decisions
        for d in decisions:
            self._score(d, (d.kind, d.step, d.microbatch) in changed.get(d.src, ()))
        out.flags = sum(d.flagged for d in decisions)
        out.skipped = sum(d.action == "skip" for d in decisions)
        level = self.cfg.verify.decision_log
        out.decisions = [d.record() for d in decisions if level == "all" or level == "flags" and d.flagged]
        if self.deferred and outcome.bans:
            self.pending_bans += outcome.bans
            fed = self.driver.fed
            self.drain_at = max(self.drain_at or 0, max(fed, step) + 1)
            # 1-based, as in metrics.jsonl: fed_step = the last step handed out when decided
            out.events = [{"kind": "ban_pending", "step": step + 1, "worker": str(b.worker),
                           "fed_step": fed + 1, "drain_after_step": self.drain_at} for b in outcome.bans]
        else:
            out.events = [self._carry_out(ban) for ban in outcome.bans]
        out.events += [{"kind": "rebase", "step": step + 1, "verifier": v} for v in outcome.rebased]
        out.events += [{"kind": "rewarm", "step": step + 1, "verifier": v} for v in outcome.rewarmed]
        out.events += [self._raise(alert) for alert in outcome.alerts]
        self.rebases += len(outcome.rebased)
        self.rewarms += len(outcome.rewarmed)
        return out

    def drains_after(self, done: int) -> bool:
        """A pending ban asks for a drain point once the fed work is done (never earlier). Under
        dist the verdicts are read ahead, before the step ends here (``RemoteSentinel``)."""
        if self.pending_bans and done >= self.drain_at:
            return True
        remote = isinstance(self.sentinel, RemoteSentinel)
        return self.deferred and remote and self.sentinel.ban_drain_due(done)

    def on_drain(self, done: int) -> list[dict]:
        """At a drain point: carry out pending bans (the workers are idle now) and restart the
        verifiers' view lag (nothing is in flight)."""
        records = []
        if self.pending_bans:
            assert done >= self.drain_at, f"drain after {done} steps, before the fed work ({self.drain_at})"
            records = [self._carry_out(ban) | {"replaced_after_step": done} for ban in self.pending_bans]
            self.pending_bans, self.drain_at = [], None
        if self.sentinel is not None:
            self.sentinel.drained(done)
        return records

    def _raise(self, alert: Alert) -> dict:
        """An alert goes to metrics.jsonl (and from there to the console's progress line) and summary."""
        record = alert.record()
        self.alerts.append(record)
        return record

    def _score(self, d: Decision, malicious: bool) -> None:
        if d.action == "skip":
            self.skipped["malicious" if malicious else "honest"] += 1
        elif d.action == "warmup":
            self.warmup_messages += 1
        else:
            self.messages[d.kind].add(d.flagged, malicious)
            boundary = min(d.src.stage, d.dst.stage)
            self.boundaries.setdefault(f"s{boundary}|s{boundary + 1} {d.kind}", Confusion()).add(
                d.flagged, malicious)
            self.stages.setdefault(f"s{d.src.stage}", Confusion()).add(d.flagged, malicious)
            if d.explained_by:
                self.explained["malicious" if malicious else "honest"] += 1
            if d.delivered:
                self.passed["malicious" if malicious else "honest"] += 1
            tally = self.tallies[d.src]
            tally.scored += 1
            tally.flags += d.flagged

    def evict(self, wid: WorkerId, step: int, marks: int, donor: WorkerId) -> tuple[bool, list[dict]]:
        """A DP outlier report of ``wid`` at step ``step`` (0-based; ``marks`` in its window) as a
        ban: decided by the ledger's rules and budget, carried out like SENTINEL's (``donor``: the
        replica whose state the replacement loads, chosen by the caller from what every process
        knows). Whether it was evicted, and the records (the ban, or the alert that refused it)."""
        ban, alert = self.ledger.decide(wid, step, marks, "dp_score", f"s{wid.stage} dp", "dp",
                                        kept="its DP contributions are still reduced robustly")
        if ban is None:
            return False, [] if alert is None else [self._raise(alert)]
        return True, [self._carry_out(ban, donor)]

    def announce(self, step: int, bans: list[dict]) -> None:
        """The DP evictions (``ban`` records) of ``step``, to a verifier that runs elsewhere (dist),
        whose ledger must count them too; every step, so it can wait for them."""
        if isinstance(self.driver, BanNotices):
            self.driver.post_bans(step, bans)

    def _carry_out(self, ban: Ban, donor: WorkerId | None = None) -> dict:
        """A fresh honest peer takes the banned slot, with an honest replica's weights and optimizer
        (``donor``; for SENTINEL's bans, the verifier's choice); under elastic membership (a driver
        with ``evict``) the banned worker's row leaves instead."""
        wid = ban.worker
        evicts = isinstance(self.driver, Evictor)
        if evicts:  # elastic/evictions.py: no replacement, the slot stays closed
            donor = None
            self.driver.evict(ban)
        elif isinstance(self.driver, RemoteVerdicts):  # dist: the state crosses processes
            donor = donor or self.sentinel.donor(wid)  # the verifier's verdicts came through the driver
            self.driver.copy_worker_state(donor, wid)  # a collective of the stage's replicas
        else:
            donor = donor or choose_donor(self.sentinel, self.mesh, wid)
            state = copy.deepcopy(self.workers[donor].state_dict())  # no tensor may be shared between peers
            self.workers[wid].load_state_dict(state)
        if wid in self.workers:
            self.workers[wid].tamper = self.workers[wid].forge = None
        attack = self.attacks.get(wid)
        running = attack is not None and attack.stopped_at is None and ban.step >= attack.start_step
        self.honest_bans += not running  # every ban of a worker not attacking at the time
        if running:
            self.caught.add(wid)
        if attack is not None and attack.stopped_at is None:
            attack.stop(ban.step)
        if self.sentinel is not None:
            self.sentinel.readmit(wid)
        if self.own_ledger:
            self.ledger.readmit(wid)
        entry = ban.record() | {"replaced_from": None if donor is None else str(donor), "honest": not running}
        if evicts:
            entry["evicted"] = True
        self.banned.append(entry)
        return {"kind": "ban"} | entry

    # --- reporting ---------------------------------------------------------------------------

    def summary(self) -> dict:
        """``banned_workers`` (the verifier's evidence) and ``trust`` (scored against ground truth)."""
        if not self.active:
            return {}
        total = self.messages["act"] + self.messages["grad"]
        attackers = []
        for wid, attack in sorted(self.attacks.items()):
            banned_at = attack.stopped_at if wid in self.caught else None
            attackers.append({  # steps 1-based, as in metrics.jsonl: attack.start_step = 5 → 6
                "worker": str(wid), "attack": attack.name, "start_step": attack.start_step + 1,
                "ban_step": None if banned_at is None else banned_at + 1,
                "steps_to_ban": None if banned_at is None else banned_at - attack.start_step,
                "changed_messages": self.tallies[wid].malicious})
        caught = len(self.caught)
        # Worker level: a ban of a running attacker is a true positive; every other ban (an honest
        # worker, a replacement, an attacker before its attack began) a false one.
        workers = Confusion(tp=caught, fp=self.honest_bans, fn=len(self.attacks) - caught)
        stages = {}
        for stage in range(self.mesh.stages):
            name = f"s{stage}"
            entries = [b for b in self.banned if WorkerId.parse(b["worker"]).stage == stage]
            stages[name] = {"messages": self.stages.get(name, Confusion()).report(),
                            "bans": len(entries), "honest_bans": sum(b.get("honest", False) for b in entries),
                            "attackers": sum(w.stage == stage for w in self.attacks),
                            "alerts": sum(WorkerId.parse(a["worker"]).stage == stage for a in self.alerts)}
        trust = {
            "verify": self.cfg.verify.name,
            "messages": {"all": total.report()} | {k: c.report() for k, c in self.messages.items()},
            "warmup_messages": self.warmup_messages,
            "skipped_messages": dict(self.skipped),
            "passed_flags": dict(self.passed),
            "workers": {k: v for k, v in workers.report().items() if k not in ("tn", "fpr")},
            "bans": len(self.banned),
            "rebased_references": self.rebases,
            "rewarmed_fences": self.rewarms,
            "alert": bool(self.alerts),
            "alerts": list(self.alerts),
            "explained_flags": dict(self.explained),
            "stages": stages,
            "boundaries": {k: c.report() for k, c in sorted(self.boundaries.items())},
            "attackers": attackers,
            "flags_per_worker": {str(w): {"scored": t.scored, "flags": t.flags,
                                          "malicious": w in self.attacks}
                                 for w, t in self.tallies.items() if t.scored or w in self.attacks},
        }
        summary = {"trust": trust}
        if self.sentinel is not None or self.dp_evictions:
            summary["banned_workers"] = list(self.banned)
        if self.sentinel is not None:
            trust["verifier_cost"] = self.sentinel.clock.summary()
        return summary

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Checkpoints are drain points, where on_drain has carried out every pending ban.
        assert not self.pending_bans, "trust state is saved at drain points, after pending bans"
        return {"sentinel": None if self.sentinel is None else self.sentinel.state_dict(),
                "attacks": {str(w): a.state_dict() for w, a in self.attacks.items()},
                "messages": {k: vars(c).copy() for k, c in self.messages.items()},
                "warmup_messages": self.warmup_messages, "skipped": dict(self.skipped),
                "tallies": {str(w): vars(t).copy() for w, t in self.tallies.items()},
                "banned": list(self.banned), "honest_bans": self.honest_bans, "rebases": self.rebases,
                "rewarms": self.rewarms, "caught": [str(w) for w in self.caught],
                "alerts": list(self.alerts), "explained": dict(self.explained),
                "boundaries": {k: vars(c).copy() for k, c in self.boundaries.items()},
                "stages": {k: vars(c).copy() for k, c in self.stages.items()}}

    def load_state_dict(self, state: dict) -> None:
        if self.sentinel is not None and state["sentinel"] is not None:
            self.sentinel.load_state_dict(state["sentinel"])
        for w, attack_state in state["attacks"].items():
            wid = WorkerId.parse(w)
            if wid in self.attacks:
                self.attacks[wid].load_state_dict(attack_state)
                if self.attacks[wid].stopped_at is not None and wid in self.workers:  # dist: its process
                    self.workers[wid].tamper = self.workers[wid].forge = None
        self.messages = {k: Confusion(**c) for k, c in state["messages"].items()}
        self.warmup_messages = state["warmup_messages"]
        self.skipped = dict(state["skipped"])
        self.tallies = {WorkerId.parse(w): WorkerTally(**t) for w, t in state["tallies"].items()}
        self.banned = list(state["banned"])
        self.honest_bans, self.rebases = state["honest_bans"], state["rebases"]
        self.rewarms = state.get("rewarms", 0)
        self.caught = {WorkerId.parse(w) for w in state.get("caught", [])}
        self.alerts = list(state.get("alerts", []))
        self.explained = dict(state.get("explained", self.explained))
        self.boundaries = {k: Confusion(**c) for k, c in state.get("boundaries", {}).items()}
        self.stages = {k: Confusion(**c) for k, c in state.get("stages", {}).items()}
        if self.own_ledger:  # its budget, from the bans carried out (all of them, at a checkpoint)
            self.ledger.bans = [ban_from_record(b) for b in self.banned]
            self.ledger.alerted = {(WorkerId.parse(a["worker"]), a["cause"]) for a in self.alerts}


def choose_donor(sentinel: Sentinel | Ledger, mesh: MeshShape, wid: WorkerId) -> WorkerId:
    """The replica of banned ``wid``'s stage with the fewest recent strikes (itself if it has no
    peer): the one whose state the replacement loads. The dist verifier chooses with this too (on
    a copy of the ledger, whose ``banned`` and ``history`` these are, for a drain still to come)."""
    peers = [w for w in mesh.stage_replicas(wid.stage) if w != wid and w not in sentinel.banned]
    if not peers:
        return wid
    return min(peers, key=lambda w: (sum(sentinel.history.get(w, ())), w.replica))
