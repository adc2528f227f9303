"""Wall clock, real processes: one model run on ONE machine vs TWO vs THREE emulated machines.

The same small mesh (P=3 stages × D=2 replicas, 6 processes, demo corpus, d 64, 3 layers, seq 32,
batch 8) and the same config, three ways:

- one machine: a plain ``meshlearn train --backend dist`` (no ``[cluster]``), every process here;
- two and three machines: network namespaces (``bench/wan.py``), each its own folder and its own
  credential, one ``meshlearn train --backend dist --host NAME --key FILE`` per machine, placed so
  that every pipeline link and every DP link crosses machines. Every pair of machines has its own
  link at 200 Mbit/s each way (``tc tbf``); one pair (alice–bob of two, alice–carol of three) is
  80 ms RTT through the TUN relay. Also the same with no added delay, for reference.

All arms use the framed streams without process groups (``dist.trusted_links = false``, what a
cluster run uses by default) and no in-process shaping (the links are real). The numbers per arm:
the median ``step_wall_s`` of the coordinator's records after the first ``--warmup`` steps,
tokens/s from it, the final train loss (every arm's losses are asserted equal to the simulator's,
step by step, ≤ 1e-5), and beside them the simulator's *device model* prediction for the same
links (an RTX 4090 at 40% of peak, links as configured, per-link latency overrides for the slow
pair). The load average is recorded before and after each run: the 2 cores are shared, and the CPU
compute of this small model dominates its wall time, so the wall numbers are not a throughput
claim; the device model's are.

``--elastic-pair`` measures elastic membership across machines instead: the two-machine placement
with its 80 ms RTT pair, fixed membership against ``elastic.enabled`` with ``elastic.membership =
"control"`` (the stage quorums on the coordinator's control service, docs/elastic.md), same config
otherwise, and the elastic step's overhead against issue 26's goal (≤ 10% of the fixed step). An
elastic run clips per stage (docs/elastic.md, "Clipping"), so its losses are not the simulator's
and are not checked against them; its device-model columns are the fixed membership's. With
``--rtt-ms 0`` the same pair has no added delay: what elastic membership costs in CPU alone.

``--machines 1,2,3`` with it measures the same on one, two and three machines (each count's fixed
and elastic runs side by side; one pair at ``--rtt-ms`` wherever there are two or more).

    sudo OMP_NUM_THREADS=1 python bench/cluster.py [--steps 30] [--warmup 5]
        [--elastic-pair [--rtt-ms 80] [--machines 1,2,3]]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DEMO, ROOT, demo_config, markdown_table, write_results
from wan import Machine, machines, rtt_ms, unavailable

from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.config import RunConfig, save_config
from meshlearn.jsonl import read_records
from meshlearn.net.keys import create_run
from meshlearn.train import Trainer

MESH = ["model.n_layer=3", "model.d_model=64", "model.n_head=2", "model.seq_len=32", "mesh.stages=3",
        "mesh.replicas=2", "mesh.microbatches=2", "train.batch_size=8", "train.warmup_steps=1",
        "train.eval_batches=1", "train.checkpoint_every=0", "dist.threads=1", "dist.shaping=none",
        "dist.links=tcp", "dist.trusted_links=false", "dist.init_timeout_s=120"]
RATE_MBIT = 200
SLOW_RTT_MS = 80
PORT = 29561
HOSTS = ("alice", "bob", "carol")
# Every pipeline link (r·s → r·s+1) and every DP link (r0sX ↔ r1sX) crosses machines in both.
PLACEMENTS: dict[int, dict[str, tuple[str, ...]]] = {
    2: {"alice": ("r0s0", "r0s2", "r1s1"), "bob": ("r0s1", "r1s0", "r1s2")},
    3: {"alice": ("r0s0", "r1s1"), "bob": ("r0s1", "r1s2"), "carol": ("r0s2", "r1s0")},
}
SLOW_PAIR = {2: (0, 1), 3: (0, 2)}  # machine indices (into HOSTS) of the 80 ms RTT pair
# An elastic run's coordinator runs a last-stage worker (it starts the run's records): the
# elastic mode's three machines, fixed and elastic alike, with every link still across machines.
ELASTIC_PLACEMENTS: dict[int, dict[str, tuple[str, ...]]] = {
    2: PLACEMENTS[2],
    3: {"alice": ("r0s0", "r1s2"), "bob": ("r0s1", "r1s0"), "carol": ("r0s2", "r1s1")},
}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One placement at one delay: ``count`` machines, the slow pair's one-way delay."""

    count: int
    one_way_ms: float
    elastic: bool = False  # elastic.membership = "control" instead of fixed membership
    elastic_mode: bool = False  # placed as the elastic mode places it (ELASTIC_PLACEMENTS)

    @property
    def placement(self) -> dict[str, tuple[str, ...]]:
        return (ELASTIC_PLACEMENTS if self.elastic_mode else PLACEMENTS)[self.count]

    @property
    def label(self) -> str:
        membership = ", elastic (control membership)" if self.elastic else ""
        if self.count == 1:
            return "1 machine (loopback)" + membership
        return f"{self.count} machines, " + (f"one pair {2 * self.one_way_ms:.0f} ms RTT" if self.one_way_ms
                                             else "no added delay") + membership


def slow_overrides(placement: dict[str, tuple[str, ...]], pair: tuple[int, int], one_way_ms: float) -> str:
    """``links.overrides`` giving every pair of workers across the slow pair's machines its delay
    (a pair that shares no pipeline or DP link still carries the global clip's norms)."""
    a, b = (placement[HOSTS[i]] for i in pair)
    ends = [(x, y) for x in a for y in b] + [(y, x) for x in a for y in b]
    return "; ".join(f"{src}->{dst}: latency_ms={one_way_ms:g}" for src, dst in ends)


def link_settings(arm: Arm) -> list[str]:
    """The links the simulator models for ``arm``: loopback on one machine (unlimited, no delay);
    across machines the tbf rate, and the slow pair's delay. Of two machines every link is on the
    slow pair: its delay is the default; of three, the default is no delay and the slow pair's
    links get theirs by ``links.overrides`` (the simulator charges the global clip's exchange of
    norms the slowest pair's latency, ``Network.exchange_latency_s``)."""
    if arm.count == 1:
        return ["link.bandwidth_mbit=inf", "link.latency_ms=0"]
    if arm.count == 2:
        return [f"link.bandwidth_mbit={RATE_MBIT}", f"link.latency_ms={arm.one_way_ms:g}"]
    sets = [f"link.bandwidth_mbit={RATE_MBIT}", "link.latency_ms=0"]
    if arm.one_way_ms:
        slow = slow_overrides(arm.placement, SLOW_PAIR[arm.count], arm.one_way_ms)
        sets.append(f"links.overrides={slow}")
    return sets


ELASTIC = ["elastic.enabled=true", "elastic.membership=control", "backend=dist"]


def arm_config(arm: Arm, steps: int) -> RunConfig:
    return demo_config(*MESH, *link_settings(arm), f"train.steps={steps}", f"train.eval_every={steps}",
                       *(ELASTIC if arm.elastic else []))


def placed(cfg: RunConfig, arm: Arm, hosts: list[Machine]) -> RunConfig:
    """``cfg`` with the ``[cluster]`` placement of ``arm`` on ``hosts`` (alice the coordinator)."""
    table = {name: HostConfig(m.address, PORT, arm.placement[name])
             for name, m in zip(HOSTS, hosts, strict=False)}
    return dataclasses.replace(cfg, backend="dist", cluster=ClusterConfig("alice", table))


def train_records(run: Path) -> list[dict]:
    return [r for r in read_records(run / "metrics.jsonl") if r["kind"] == "train"]


def step_numbers(records: list[dict], warmup: int, cfg: RunConfig, key: str) -> dict:
    """Median seconds per step of ``key`` after ``warmup`` steps, its tokens/s, every step's loss."""
    median = statistics.median(r[key] for r in records[warmup:])
    return {"median_s_per_step": median, "tokens_per_s": cfg.train.batch_size * cfg.model.seq_len / median,
            "losses": [r["train_loss"] for r in records]}


def predict(cfg: RunConfig, warmup: int) -> dict:
    """The simulator's run of ``cfg`` (placement ignored): its losses and its device-model step time."""
    run = Path(tempfile.mkdtemp(prefix="meshlearn-cluster-sim-"))
    Trainer(dataclasses.replace(cfg, backend="sim", cluster=ClusterConfig()), run, progress=False).train()
    numbers = step_numbers(train_records(run), warmup, cfg, "step_sim_s")
    shutil.rmtree(run, ignore_errors=True)
    return numbers


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _wait(procs: dict[str, subprocess.Popen], logs: Path, limit_s: float) -> None:
    """Every launcher's end; SystemExit naming the failed ones (their logs kept) otherwise."""
    end = time.monotonic() + limit_s
    try:
        codes = {name: p.wait(timeout=max(1.0, end - time.monotonic())) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(codes.values()):
        raise SystemExit(f"a run failed (exit codes {codes}); logs in {logs}")


def run_one_machine(cfg: RunConfig, scratch: Path) -> tuple[Path, None]:
    """The plain dist run: every process here, on loopback. Returns its run folder (and no RTT)."""
    save_config(dataclasses.replace(cfg, backend="dist"), scratch / "run.toml")
    with (scratch / "launcher.log").open("w") as log:
        procs = {"local": subprocess.Popen([sys.executable, "-m", "meshlearn", "train", "--backend", "dist",
                                            "--config", "run.toml", "--out", "runs/x"], cwd=scratch,
                                           env=_env(), stdout=log, stderr=subprocess.STDOUT)}
        _wait(procs, scratch, 900)
    return scratch / "runs" / "x", None


def run_machines(cfg: RunConfig, arm: Arm, scratch: Path) -> tuple[Path, float]:
    """The cluster run on ``arm.count`` namespaces, each launcher in its own folder with its own
    key. Returns the coordinator's run folder and the slow pair's RTT measured before the run."""
    names = HOSTS[:arm.count]
    create_run(scratch / "owner", list(names), "cluster-bench")
    delays = {SLOW_PAIR[arm.count]: arm.one_way_ms} if arm.one_way_ms else {}
    with machines(arm.count, f"{RATE_MBIT}mbit", delays) as hosts, contextlib.ExitStack() as logs:
        rtt = rtt_ms(*(hosts[i] for i in SLOW_PAIR[arm.count]))
        run_cfg = placed(cfg, arm, hosts)
        procs = {}
        for name, host in zip(names, hosts, strict=True):
            folder = scratch / name
            (folder / "keys").mkdir(parents=True)
            for file in (f"{name}.key", f"{name}.crt", "ca.crt", "ca.crl"):
                shutil.copy(scratch / "owner" / file, folder / "keys" / file)  # the key keeps mode 0600
            save_config(run_cfg, folder / "run.toml")
            log = logs.enter_context((scratch / f"{name}.log").open("w"))
            procs[name] = host.popen([sys.executable, "-m", "meshlearn", "train", "--backend", "dist",
                                      "--config", "run.toml", "--host", name, "--key", f"keys/{name}.key",
                                      "--out", "runs/x"], cwd=folder, env=_env(), stdout=log,
                                     stderr=subprocess.STDOUT)
        _wait(procs, scratch, 900)
    return scratch / "alice" / "runs" / "x", rtt


def measure(arm: Arm, steps: int, warmup: int) -> dict:
    """One run of ``arm`` and the simulator's of the same config: the row, its losses checked
    against the simulator's (SystemExit where they differ, or where the run stopped early)."""
    cfg = arm_config(arm, steps)
    scratch = Path(tempfile.mkdtemp(prefix="ml-cb-"))  # short: AF_UNIX paths stop at 107 bytes
    load_before = os.getloadavg()
    start = time.monotonic()
    run, rtt = run_one_machine(cfg, scratch) if arm.count == 1 else run_machines(cfg, arm, scratch)
    wall = time.monotonic() - start
    measured = step_numbers(train_records(run), warmup, cfg, "step_wall_s")
    load_after = os.getloadavg()
    shutil.rmtree(scratch, ignore_errors=True)
    sim = predict(dataclasses.replace(cfg, elastic=dataclasses.replace(cfg.elastic, enabled=False)), warmup)
    diff = max(abs(a - b) for a, b in zip(measured["losses"], sim["losses"], strict=True))
    if len(measured["losses"]) != steps or (diff > 1e-5 and not arm.elastic):
        raise SystemExit(f"{arm.label}: losses differ from the simulator's by {diff:.3g} "
                         f"({len(measured['losses'])} of {steps} steps)")
    return {"arm": arm.label, "machines": arm.count, "elastic": arm.elastic,
            "slow_pair_rtt_ms": 2 * arm.one_way_ms,
            "slow_pair_measured_rtt_ms": rtt, "rtt": "—" if rtt is None else f"{rtt:.2f}",
            "median_s_per_step": measured["median_s_per_step"], "tokens_per_s": measured["tokens_per_s"],
            "final_train_loss": measured["losses"][-1], "losses": measured["losses"],
            "max_abs_diff_vs_sim": diff, "sim_s_per_step": sim["median_s_per_step"],
            "sim_ms_per_step": 1000 * sim["median_s_per_step"], "sim_tokens_per_s": sim["tokens_per_s"],
            "run_wall_s": wall,
            "load_before": f"{load_before[0]:.2f}", "load_after": f"{load_after[0]:.2f}",
            "load_avg_before": load_before, "load_avg_after": load_after}


def arms(reference: bool) -> list[Arm]:
    """One machine, then two and three at 80 ms RTT on the slow pair; with ``reference`` two and
    three again with no added delay."""
    slow = [Arm(n, SLOW_RTT_MS / 2) for n in (2, 3)]
    return [Arm(1, 0.0), *slow, *([Arm(n, 0.0) for n in (2, 3)] if reference else [])]


COLUMNS = [("arm", "placement", ""), ("rtt", "slow pair RTT, ms (measured)", ""),
           ("median_s_per_step", "median s/step", ".3f"), ("tokens_per_s", "tokens/s", ".0f"),
           ("sim_ms_per_step", "device model ms/step", ".3f"),
           ("sim_tokens_per_s", "device model tokens/s", ".0f"),
           ("final_train_loss", "final train loss", ".5f"), ("load_before", "load before", ""),
           ("load_after", "load after", "")]
COST_COLUMNS = [("machines", "machines", "d"), ("rtt_ms", "slow pair RTT, ms", ".0f"),
                ("measured_s", "added s/step, measured", ".3f"),
                ("device_model_s", "added s/step, device model", ".3f")]
HEADER = """\
One model on 1 vs 2 vs 3 machines (network namespaces, each its own folder and key; every machine
pair its own {rate} Mbit/s link, one pair {rtt} ms RTT through the TUN relay; every pipeline and DP
link crossing machines). P=3 × D=2, demo corpus, d 64, 3 layers, seq 32, batch 8, {steps} steps,
median after {warmup}; framed streams, no process group, no in-process shaping; {cores} shared cores
(1-minute load average before/after each run). Every row's losses equal the simulator's step by
step (max diff {spread:.1g} across placements). **Wall time here is CPU-bound** (6 processes of a
small model on {cores} cores): it is not a throughput claim; the *device model* columns (the
simulator: an RTX 4090 at 40% of peak, the same links) are. Elastic membership across machines:
`--elastic-pair` (docs/results/cluster_elastic.md).
`sudo OMP_NUM_THREADS=1 python bench/cluster.py --steps {steps} --warmup {warmup}`

{table}

What the slow pair adds per step (its row minus the same machines with no added delay, so the CPU
time cancels):

{costs}
"""


ELASTIC_HEADER = """\
Elastic membership on {machines} machine(s): fixed membership against `elastic.membership =
"control"` on each (two machines: alice `r0s0 r0s2 r1s1`, bob `r0s1 r1s0 r1s2`; three: alice `r0s0
r1s2`, bob `r0s1 r1s0`, carol `r0s2 r1s1`, the coordinator holding a last stage as an elastic run
needs: every pipeline and DP link across machines; one pair at {rtt} ms RTT, {rate} Mbit/s; one
machine: loopback), P=3 × D=2, demo corpus, d 64, 3 layers, seq 32, batch 8, {steps} steps, median
after {warmup}; {cores} shared cores (load average before/after each run). The elastic run clips
per stage, so its losses are its own (not checked against the simulator); the device model columns
are the fixed membership's.
`sudo OMP_NUM_THREADS=1 python bench/cluster.py --elastic-pair --steps {steps} --warmup {warmup}{options}`

{table}

Elastic step overhead (elastic ÷ fixed − 1, the same machines){goal}:

{overheads}
"""
OVERHEAD_COLUMNS = [("machines", "machines", "d"), ("rtt", "slow pair RTT, ms", ""),
                    ("overhead", "elastic step overhead", "+.1%")]


def elastic_main(args: argparse.Namespace) -> None:
    """``--elastic-pair``: fixed vs elastic (control) membership on each of ``--machines`` (by
    default the two machines' pair at ``--rtt-ms``, 80 ms RTT: issue 26's goal,
    ``results/cluster_elastic``; other machine counts or RTTs go to a results file of their own)."""
    rows, overheads = [], []
    for count in args.machines:
        one_way = args.rtt_ms / 2 if count > 1 else 0.0
        fixed, elastic = (measure(Arm(count, one_way, e, elastic_mode=True), args.steps, args.warmup)
                          for e in (False, True))
        rows += [fixed, elastic]
        overheads.append({"machines": count, "rtt": f"{2 * one_way:g}" if count > 1 else "—",
                          "overhead": elastic["median_s_per_step"] / fixed["median_s_per_step"] - 1})
    goal = args.rtt_ms == SLOW_RTT_MS
    default = goal and args.machines == [2]
    options = "".join([f" --machines {','.join(map(str, args.machines))}" if args.machines != [2] else "",
                       "" if goal else f" --rtt-ms {args.rtt_ms:g}"])
    payload = {"steps": args.steps, "warmup": args.warmup, "mesh": MESH, "elastic": ELASTIC,
               "placements": {n: ELASTIC_PLACEMENTS[n] for n in args.machines if n > 1},
               "rate_mbit": RATE_MBIT,
               "rtt_ms": args.rtt_ms, "rows": rows, "overheads": overheads,
               "goal": "<= +10% at 80 ms RTT (issue 26)" if goal else None, "cpu_count": os.cpu_count()}
    markdown = ELASTIC_HEADER.format(machines=", ".join(map(str, args.machines)), rate=RATE_MBIT,
                                     rtt=f"{args.rtt_ms:g}", steps=args.steps, warmup=args.warmup,
                                     cores=os.cpu_count(), table=markdown_table(rows, COLUMNS),
                                     overheads=markdown_table(overheads, OVERHEAD_COLUMNS), options=options,
                                     goal=" (issue 26's goal at 80 ms RTT: ≤ +10%)" if goal else "")
    name = "cluster_elastic" + ("" if default else "".join(
        [f"_m{''.join(map(str, args.machines))}" if args.machines != [2] else "",
         "" if goal else f"_rtt{args.rtt_ms:g}"]))
    write_results(name, payload, markdown)


def machine_counts(text: str) -> list[int]:
    """``--machines 1,2,3``: distinct counts among 1, 2 and 3, in the order given."""
    counts = [part.strip() for part in text.split(",")]
    if not counts or any(c not in ("1", "2", "3") for c in counts) or len(set(counts)) != len(counts):
        raise SystemExit(f"--machines = {text!r}: distinct machine counts among 1, 2, 3, e.g. 1,2,3")
    return [int(c) for c in counts]


def delay_costs(rows: list[dict]) -> list[dict]:
    """What the slow pair adds per step, measured and predicted: each delayed row minus the row of
    the same machines with no added delay (the CPU time, the same in both, cancels)."""
    plain = {r["machines"]: r for r in rows if r["machines"] > 1 and not r["slow_pair_rtt_ms"]}
    return [{"machines": r["machines"], "rtt_ms": r["slow_pair_rtt_ms"],
             "measured_s": r["median_s_per_step"] - plain[r["machines"]]["median_s_per_step"],
             "device_model_s": (r["sim_ms_per_step"] - plain[r["machines"]]["sim_ms_per_step"]) / 1000}
            for r in rows if r["slow_pair_rtt_ms"] and r["machines"] in plain]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--no-reference", action="store_true", help="skip the arms with no added delay")
    parser.add_argument("--elastic-pair", action="store_true",
                        help="fixed vs elastic (control) membership on the two machines' 80 ms RTT pair")
    parser.add_argument("--rtt-ms", type=float, default=SLOW_RTT_MS,
                        help="--elastic-pair: the pair's added round trip, ms (0: none, the CPU cost alone)")
    parser.add_argument("--machines", default="2",
                        help="--elastic-pair: the machine counts, e.g. 1,2,3 (default 2: the pair)")
    args = parser.parse_args()
    args.machines = machine_counts(args.machines)
    why = unavailable()
    if why is not None:
        raise SystemExit(f"bench/cluster.py: {why} (run it as root on Linux)")
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup = {args.warmup}: must be in [0, --steps = {args.steps})")
    if args.rtt_ms < 0:
        raise SystemExit(f"--rtt-ms = {args.rtt_ms:g}: must be >= 0 (0: no added delay)")
    if args.elastic_pair:
        elastic_main(args)
        return
    rows = [measure(arm, args.steps, args.warmup) for arm in arms(not args.no_reference)]
    first = rows[0]["losses"]
    spread = max(max(abs(a - b) for a, b in zip(row["losses"], first, strict=True)) for row in rows)
    if spread > 1e-5:
        raise SystemExit(f"the losses differ across placements by {spread:.3g}")
    costs = delay_costs(rows)
    payload = {"steps": args.steps, "warmup": args.warmup, "mesh": MESH,
               "config": str(DEMO.relative_to(ROOT)),
               "rate_mbit": RATE_MBIT, "placements": PLACEMENTS,
               "slow_pair": {n: [HOSTS[i] for i in p] for n, p in SLOW_PAIR.items()}, "rows": rows,
               "slow_pair_cost": costs, "max_loss_diff_across_placements": spread,
               "losses_bit_identical": len({tuple(row["losses"]) for row in rows}) == 1,
               "cpu_count": os.cpu_count(),
               "elastic": "measured by --elastic-pair (results/cluster_elastic)"}
    markdown = HEADER.format(rate=RATE_MBIT, rtt=SLOW_RTT_MS, steps=args.steps, warmup=args.warmup,
                             cores=os.cpu_count(), spread=spread, table=markdown_table(rows, COLUMNS),
                             costs=markdown_table(costs, COST_COLUMNS))
    write_results("cluster", payload, markdown)

if __name__ == "__main__":
    main()
