"""A two-host cluster run on one machine, for tests that need real worker processes but no
namespaces: two port agents on 127.0.0.1 (one per host), the control service behind alice's, and
each worker started as its host's launcher would start it (the environment it gives a worker)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tiny import tiny_config

import meshlearn
from meshlearn.cluster.authority import Authority
from meshlearn.cluster.control import ControlService
from meshlearn.cluster.links import KEY_ENV, PORT_SOCKET_ENV, REFUSALS_ENV
from meshlearn.cluster.refusals import REFUSALS_DIR
from meshlearn.cluster.role import HOST_ENV
from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.jsonl import read_records
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.net.counters import Counters
from meshlearn.net.keys import Credentials
from meshlearn.net.port import PortAgent
from meshlearn.net.tls import RunTls
from meshlearn.train import Trainer

HOSTS = ("alice", "bob")
PLACED = {"alice": ("r0s0", "r1s1"), "bob": ("r0s1", "r1s0")}  # every pipeline and DP link crosses
MESH = MeshShape(2, 2)
NAMES = {MESH.rank(w): str(w) for w in MESH.workers()}
HOSTS_OF = {w: host for host, workers in PLACED.items() for w in workers}


def cluster_config(corpus: Path, ports: Mapping[str, int], *overrides: str):
    """P = 2 × D = 2 over alice and bob on 127.0.0.1 (``ports``: each host's agent)."""
    cfg = tiny_config(corpus, "mesh.stages=2", "mesh.replicas=2", "dist.threads=1", "dist.shaping=none",
                      "dist.init_timeout_s=60", "dist.timeout_s=30", *overrides)
    hosts = {h: HostConfig("127.0.0.1", ports[h], PLACED[h]) for h in HOSTS}
    return dataclasses.replace(cfg, backend="dist", cluster=ClusterConfig("alice", hosts))


def control_service(agents: Mapping[str, PortAgent], keys: Path, counters: Counters) -> ControlService:
    """The coordinator's control service, served behind alice's agent."""
    control = ControlService(RunTls(Credentials.in_folder(keys, "alice")),
                             Authority(HOSTS_OF, {name: rank for rank, name in NAMES.items()}, "alice"),
                             counters)
    control.serve(agents["alice"].socket_path)
    return control


def start_workers(config: Path, run_dirs: Mapping[str, Path], agents: Mapping[str, PortAgent], keys: Path,
                  logs: Path, programs: Mapping[str, list[str]] = {},
                  extra_env: Mapping[str, str] = {}) -> list[subprocess.Popen]:
    """Every worker of the run in a process of its own, with its host's port, key and record
    folder; ``programs``: a worker's own command in place of ``python -m meshlearn.entry.worker``."""
    env = os.environ | {"PYTHONPATH": str(Path(meshlearn.__file__).parents[1]), "OMP_NUM_THREADS": "1",
                        "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(agents["alice"].port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "MESHLEARN_BIND_ADDRESS": "127.0.0.1", **extra_env}
    procs = []
    for host in HOSTS:
        for local, worker in enumerate(PLACED[host]):
            rank = MESH.rank(WorkerId(int(worker[1]), int(worker[3])))
            program = programs.get(worker, ["-m", "meshlearn.entry.worker"])
            procs.append(subprocess.Popen(
                [sys.executable, *program, "--config", str(config), "--out", str(run_dirs[host])],
                env=env | {"RANK": str(rank), "LOCAL_RANK": str(local), HOST_ENV: host,
                           PORT_SOCKET_ENV: str(agents[host].socket_path), KEY_ENV: str(keys / f"{host}.key"),
                           REFUSALS_ENV: str(run_dirs[host] / REFUSALS_DIR)},
                stdout=(logs / f"{worker}.log").open("w"), stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout_s: float = 120) -> list[int]:
    """The workers' exit codes; any still running after ``timeout_s`` is killed."""
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def logs_of(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(folder.glob("*.log")))


def losses(run_dir: Path) -> list[float]:
    return [r["train_loss"] for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def simulator_losses(cfg, folder: Path) -> list[float]:
    """The same config's losses from the simulator (the run's reference)."""
    Trainer(dataclasses.replace(cfg, backend="sim", cluster=ClusterConfig()), folder, progress=False).train()
    return losses(folder)
