"""Wall clock, real processes: a cluster run's links authenticated and encrypted (mutual TLS 1.3
through each host's one port, ``cluster/links.py``) against plain framed streams and gloo, on the
same shaped links (issue 27: the goal is at most 5% slower than plain streams at 200 Mbit/s).

Two "hosts" on this machine (127.0.0.1, each with its own port agent and credential), a P=2 × D=2
mesh placed so that every pipeline and DP link crosses hosts, the same config three ways:

- ``gloo``: pipeline links and the DP all-reduce over gloo (``dist.links = collective``,
  ``dist.trusted_links = "true"``);
- ``plain``: everything over framed TCP streams, no process group (``tcp``, ``"false"``), each
  receiver listening on its own port (``streams.PlainConnector``);
- ``auth``: the same framed streams, each dialed through the receiver host's port and
  authenticated with the run's certificates (the launcher's ``MESHLEARN_PORT_SOCKET`` and
  ``MESHLEARN_KEY`` set), and the rendezvous on the coordinator's control service behind its
  port, as a keyed cluster run has it (the other two arms rendezvous on a TCPStore).

Links shaped in process (``dist.shaping = sender``) to 200 Mbit/s and 10 ms. The number is the
median ``step_wall_s`` of the records after the first three steps; the arms alternate
``--repeats`` times so all see the same machine load, and each arm's number is the median over
its repeats. The load average is recorded.

    OMP_NUM_THREADS=1 python bench/auth_links_wall.py [--steps 30] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, demo_config, markdown_table, write_results

from meshlearn.cluster.authority import Authority
from meshlearn.cluster.control import ControlService
from meshlearn.cluster.links import KEY_ENV, PORT_SOCKET_ENV
from meshlearn.cluster.role import HOST_ENV
from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.config import save_config
from meshlearn.net.counters import Counters
from meshlearn.net.keys import Credentials, create_run
from meshlearn.net.port import PortAgent
from meshlearn.net.tls import RunTls

MESH = ["model.n_layer=4", "model.d_model=64", "model.n_head=2", "model.seq_len=32", "mesh.stages=2",
        "mesh.replicas=2", "mesh.microbatches=2", "train.batch_size=8", "train.warmup_steps=1",
        "train.eval_batches=1", "train.checkpoint_every=0", "link.bandwidth_mbit=200",
        "link.latency_ms=10", "dist.shaping=sender", "dist.threads=1", "dist.init_timeout_s=120"]
ARMS = {"gloo": ("collective", "true"), "plain": ("tcp", "false"), "auth": ("tcp", "false")}
PLACED = {"alice": ("r0s0", "r1s1"), "bob": ("r0s1", "r1s0")}  # every pipeline and DP link crosses
RANKS = {"r0s0": 0, "r0s1": 1, "r1s0": 2, "r1s1": 3}  # replica · P + stage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(arm: str, steps: int, keys: Path, agents: dict[str, PortAgent]) -> dict:
    """One run of ``arm``: the four workers started as each host's launcher would."""
    links, trusted = ARMS[arm]
    cfg = demo_config(*MESH, f"train.steps={steps}", f"train.eval_every={steps}", f"dist.links={links}",
                      f"dist.trusted_links={trusted}", "backend=dist")
    hosts = {h: HostConfig("127.0.0.1", agents[h].port, PLACED[h]) for h in PLACED}
    cfg = dataclasses.replace(cfg, cluster=ClusterConfig("alice", hosts))
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-auth-wall-"))
    save_config(cfg, run_dir / "run.toml")
    control = None
    if arm == "auth":  # the coordinator's control service behind alice's port: the rendezvous
        hosts_of = {w: h for h, placed in PLACED.items() for w in placed}
        control = ControlService(RunTls(Credentials.in_folder(keys, "alice")),
                                 Authority(hosts_of, RANKS, "alice"), Counters())
        control.serve(agents["alice"].socket_path)
    master = agents["alice"].port if control is not None else _free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "4",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master),
                        "MESHLEARN_BIND_ADDRESS": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    if control is not None:  # the store exists (the service), as under a host's launcher
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    procs = []
    for host, workers in PLACED.items():
        for local, worker in enumerate(workers):
            mine = {"RANK": str(RANKS[worker]), "LOCAL_RANK": str(local), HOST_ENV: host}
            if arm == "auth":
                mine |= {PORT_SOCKET_ENV: str(agents[host].socket_path), KEY_ENV: str(keys / f"{host}.key")}
            log = (run_dir / f"{worker}.log").open("w")
            procs.append(subprocess.Popen([sys.executable, "-m", "meshlearn.entry.worker", "--config",
                                           str(run_dir / "run.toml"), "--out", str(run_dir / host)],
                                          env=env | mine, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=1800) for p in procs]
    if control is not None:
        control.close()
    if any(codes):
        raise SystemExit(f"the {arm} run failed (exit codes {codes}); see {run_dir}")
    records = [json.loads(line) for line in (run_dir / "alice" / "metrics.jsonl").read_text().splitlines()]
    walls = [r["step_wall_s"] for r in records if r["kind"] == "train"][3:]
    final = [r["train_loss"] for r in records if r["kind"] == "train"][-1]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"arm": arm, "median_step_wall_s": statistics.median(walls), "final_train_loss": final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ml-auth-"))  # short: AF_UNIX paths stop at 107 bytes
    create_run(scratch / "keys", list(PLACED), "auth-links-wall")
    agents = {h: PortAgent("127.0.0.1", 0, scratch / h / "agent.sock") for h in PLACED}
    for agent in agents.values():
        agent.start()
    load_before = os.getloadavg()
    runs = [measure(arm, args.steps, scratch / "keys", agents) for _ in range(args.repeats) for arm in ARMS]
    refused = {h: a.counters.as_dict() for h, a in agents.items()}
    for agent in agents.values():
        agent.close()
    shutil.rmtree(scratch)
    rows = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        walls = [r["median_step_wall_s"] for r in mine]
        rows.append({"arm": arm, "median_step_wall_s": statistics.median(walls),
                     "runs_s": [round(r["median_step_wall_s"], 4) for r in mine],
                     "final_train_loss": mine[-1]["final_train_loss"]})
    plain = next(r for r in rows if r["arm"] == "plain")["median_step_wall_s"]
    for row in rows:
        row["vs_plain"] = row["median_step_wall_s"] / plain - 1
    payload = {"steps": args.steps, "repeats": args.repeats, "mesh": MESH, "placed": PLACED, "rows": rows,
               "runs": runs, "agent_counters": refused, "cpu_count": os.cpu_count(),
               "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    table = markdown_table(rows, [("arm", "links", ""), ("median_step_wall_s", "median s/step", ".4f"),
                                  ("vs_plain", "vs plain", "+.1%"),
                                  ("final_train_loss", "final train loss", ".5f")])
    write_results("auth_links_wall", payload,
                  f"A cluster run's links at 200 Mbit/s, 10 ms (shaped in process): gloo vs plain framed "
                  f"streams vs framed streams authenticated and encrypted through each host's port "
                  f"(mutual TLS 1.3). Two hosts on one machine, P=2 × D=2, every link crossing "
                  f"hosts, demo corpus, d 64, 4 layers, seq 32, batch 8, {args.steps} steps, median of "
                  f"{args.repeats} alternating runs per arm on {os.cpu_count()} cores (load average "
                  f"{load_before[0]:.1f} at start, {payload['load_avg_after'][0]:.1f} at the end); "
                  f"`OMP_NUM_THREADS=1 python bench/auth_links_wall.py --steps {args.steps} "
                  f"--repeats {args.repeats}`\n\n{table}")


if __name__ == "__main__":
    main()
