"""Which checkpoint an elastic cluster run resumes from, and which slots start: decided by the
coordinator's launcher from what every host's folder holds, before any worker starts.

Why at the launchers: under elastic membership a checkpoint's shards are where the slots' holders
ran at that step (``cluster/elastic_checkpoints.py``), so which processes can start from their own
machine's folder is known only once every host has said what it holds; and a slot that does not
start must be free for joiners from its first quorum on, which its host's launcher arranges.

- Each host's launcher reports ``meshlearn-cluster/resume/<host>``: for every agreed checkpoint in
  its folder, the agreement and the slots whose shard the agreement places on this host and whose
  file is here at the listed size (its SHA-256 is checked by the process that loads it).
- The coordinator's launcher waits for every host of the placement (each must run ``--resume``),
  and picks the newest step of its own folder (whose agreements its own processes recorded from
  the control service: another host's report is only that host's word) whose agreement every
  host that holds one holds identically, whose shards every host of the placement they name holds,
  and that can start a replica of every stage: a slot starts when its shard is on the host the placement
  gives it. Its choice (``meshlearn-cluster/resume``) is the same for every host: the step, and
  the slots that start; or why none can.
- A slot whose shard is not on its placement's host — a joiner from another machine held it when
  the checkpoint was taken, a host of the placement or a newcomer (which sends no report, so its
  holdings go unchecked) — and a slot the checkpoint does not list do not start: they are
  ``absent`` and free for ``meshlearn train --join`` (its joiner heals from a live replica), as on
  one machine (``elastic/membership.resume_absent``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from meshlearn.checkpoint_layout import CHECKPOINT_DIR, step_folders, step_of
from meshlearn.cluster.elastic_checkpoints import read_agreement
from meshlearn.cluster.placement import Placement
from meshlearn.cluster.shared import KEYS
from meshlearn.cluster.slots import SLOT
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId

CHOICE = f"{KEYS}/resume"
STEP = re.compile(r"[0-9]{1,12}")  # a step count as a report names it (ASCII digits, bounded)


@dataclass(frozen=True)
class ResumePlan:
    step: int  # the agreed checkpoint every started slot loads
    start: tuple[str, ...]  # the slots that start from it (in every host); the others are absent
    listed: tuple[str, ...] = ()  # the slots its agreement lists (some may be held off their hosts)


def holdings(run_dir: Path, host: str) -> dict[str, dict]:
    """This folder's agreed checkpoints: step → its agreement and the slots it holds for ``host``."""
    held = {}
    for folder in step_folders(Path(run_dir) / CHECKPOINT_DIR):
        agreement = read_agreement(folder)
        if agreement is None:
            continue
        holds = [slot for slot, entry in sorted(agreement["shards"].items()) if entry.get("host") == host
                 and (shard := folder / f"{slot}.pt").is_file() and shard.stat().st_size == entry.get("size")]
        held[str(step_of(folder))] = {"agreement": agreement, "holds": holds}
    return held


def choose(reports: Mapping[str, dict], hosts_of: Mapping[str, str], stages: int,
           coordinator: str) -> ResumePlan | str:
    """The plan from every host's ``holdings`` (host → report), or why no checkpoint can resume.

    Only the agreements in ``coordinator``'s own folder count: its processes wrote them there from
    its control service after checking each against the shards' own entries, whereas any other
    host's report is that host's word — one running a slot of every stage could otherwise report a
    made-up newer step that lists only its shards. Every report must hold the same agreement."""
    own = reports.get(coordinator, {})
    steps = sorted((int(s) for s in own), reverse=True)
    if not steps:
        return ("no machine's folder holds an agreed checkpoint of this run" if not any(reports.values())
                else f"the coordinator's folder ({coordinator}) holds no agreed checkpoint of this run")
    reasons = []
    for step in steps:
        agreement = own[str(step)]["agreement"]
        why = _unusable(reports, step, agreement, hosts_of, stages)
        if why is None:
            start = tuple(slot for slot, entry in sorted(agreement["shards"].items())
                          if hosts_of.get(slot) == entry["host"])
            return ResumePlan(step, start, tuple(sorted(agreement["shards"])))
        reasons.append(f"step {step}: {why}")
    return "; ".join(reasons[:2])


def _unusable(reports: Mapping[str, dict], step: int, agreement: dict, hosts_of: Mapping[str, str],
              stages: int) -> str | None:
    """Why the agreed checkpoint of ``step`` (the coordinator's copy of its agreement) cannot resume
    the run (None: it can)."""
    if differ := sorted(h for h, report in reports.items()
                        if str(step) in report and report[str(step)]["agreement"] != agreement):
        return f"host {differ[0]}'s agreed.json differs from the coordinator's"
    on: dict[str, list[str]] = {}
    for slot, entry in sorted(agreement["shards"].items()):
        on.setdefault(entry["host"], []).append(slot)
    for host, slots in on.items():
        if host not in reports:
            continue  # a newcomer's (no host of the placement, no report): its slots are absent
        held = reports[host].get(str(step), {}).get("holds", [])
        if lacking := [slot for slot in slots if slot not in held]:
            return (f"host {host}'s folder lacks its agreed shards {', '.join(lacking)} "
                    f"(checkpoints/step-{step:06d})")
    placed = {WorkerId.parse(slot).stage for slot, entry in agreement["shards"].items()
              if hosts_of.get(slot) == entry["host"]}
    if missing := sorted(set(range(stages)) - placed):
        shards = sorted(agreement["shards"].items())
        elsewhere = ", ".join(f"{slot} on {entry['host']}" for slot, entry in shards
                              if WorkerId.parse(slot).stage == missing[0])
        return (f"no shard of stage {missing[0]} is on the host its placement names (a joiner's from "
                f"another machine: {elsewhere})")
    return None


def plan_resume(store, run_dir: Path, placement: Placement, hosts: list[str], stages: int,
                timeout_s: float) -> ResumePlan:
    """Report this host's holdings, let the coordinator choose, and return its choice; ConfigError
    (one line, the same on every host) when no agreed checkpoint can resume the run. ``hosts``:
    every host of the placement (each reports)."""
    store.set(f"{CHOICE}/{placement.host}", json.dumps(holdings(run_dir, placement.host)))
    store.set_timeout(timedelta(seconds=timeout_s))
    if placement.is_coordinator:
        reports = {h: _report(h, store.get(f"{CHOICE}/{h}")) for h in hosts}  # waits for every host
        plan = choose(reports, placement.hosts_of, stages, placement.host)
        store.set(CHOICE, json.dumps({"step": plan.step, "start": plan.start, "listed": plan.listed}
                                     if isinstance(plan, ResumePlan) else {"step": -1, "why": plan}))
    choice = json.loads(store.get(CHOICE))
    if choice["step"] < 0:
        raise ConfigError("--resume", str(run_dir), f"no agreed checkpoint can resume this elastic cluster "
                                                    f"run ({choice['why']}): start it anew")
    return ResumePlan(int(choice["step"]), tuple(choice["start"]), tuple(choice["listed"]))


def _report(host: str, value: bytes) -> dict:
    """A host's holdings as sent (authenticated by the control service, bounded by its value
    limit); one that is not a report of agreements counts as holding nothing (one line)."""
    try:
        report = _usable(json.loads(value))
    except (ValueError, UnicodeDecodeError, RecursionError):
        report = None
    if report is None:
        print(f"meshlearn cluster: host {host}'s resume report is no report of agreed checkpoints "
              '({"<step>": {"agreement": {"shards": {...}}, "holds": [...]}}, steps of at most 12 digits): '
              "it counts as holding none", file=sys.stderr, flush=True)
        return {}
    return report


def _usable(report) -> dict | None:
    """``report`` if every step of it is a held agreement (None: not so)."""
    if not isinstance(report, dict):
        return None
    for step, held in report.items():
        if not (STEP.fullmatch(step) and str(int(step)) == step and isinstance(held, dict)
                and isinstance(held.get("holds"), list) and isinstance(held.get("agreement"), dict)
                and isinstance(shards := held["agreement"].get("shards"), dict)
                and all(SLOT.match(slot) and isinstance(e, dict) and isinstance(e.get("host"), str)
                        for slot, e in shards.items())):
            return None
    return report
