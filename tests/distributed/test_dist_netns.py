"""Optional integration test: two worker processes in two network namespaces, joined by a real slow
link — ``tc tbf`` for the rate and a user-space TUN relay for the one-way delay (this kernel has no
netem). In-process shaping is off (``dist.shaping=none``): the kernel does it. The workers start
the way a cluster starts them (plain env:// rendezvous, rank 0 hosting the store, GLOO_SOCKET_IFNAME
naming the link), with no launcher.

Needs root, ``ip``/``tc`` and /dev/net/tun; skipped with the reason otherwise. All traffic stays in
the test's own namespaces; the namespaces and the relay are removed in the finalizer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from dist_helpers import records
from netns import missing, wan_link
from tiny import tiny_config

from meshlearn.config import save_config
from meshlearn.train import Trainer

DELAY_MS = 20
RATE = "100mbit"

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


@pytest.fixture
def wan():
    with wan_link(DELAY_MS, RATE) as link:
        yield link


# tcp: each listens on its namespace's own address; untrusted: no process group, the gathers and
# barriers over framed streams too
@pytest.mark.parametrize("links", ["auto", "tcp", "untrusted"])
def test_workers_in_two_namespaces_over_a_shaped_link_match_the_simulator(wan, tiny_corpus, tmp_path, links):
    carried = "dist.trusted_links=false" if links == "untrusted" else f"dist.links={links}"
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=1", "train.steps=4",
                      f"link.latency_ms={DELAY_MS}", "link.bandwidth_mbit=100", "dist.shaping=none",
                      "dist.threads=1", "dist.init_timeout_s=60", "dist.timeout_s=30", carried)
    config = tmp_path / "cfg.toml"
    save_config(cfg, config)
    run = tmp_path / "dist"
    port = "29517"  # a fresh namespace has nothing listening
    procs = []
    try:
        for rank, (ns, dev) in enumerate(zip(wan.namespaces, wan.devices, strict=True)):
            env = os.environ | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": wan.addresses[0],
                                "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": dev}
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store, as without torchrun
            log = (tmp_path / f"rank{rank}.log").open("w")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "meshlearn.entry.worker",
                 "--config", str(config), "--out", str(run)], env=env, stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + 120
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2))
    assert [p.returncode for p in procs] == [0, 0], logs

    sim = tmp_path / "sim"
    Trainer(cfg, sim, progress=False).train()
    a, b = records(sim), records(run)
    assert max(abs(ra["train_loss"] - rb["train_loss"]) for ra, rb in zip(a, b, strict=True)) <= 1e-5
    # The link was really slow: every step sends an activation one way and a gradient back (plus
    # the end-of-step gather), so it lasts at least two one-way delays. A lower bound, not a timing.
    assert min(r["step_wall_s"] for r in b) >= 2 * DELAY_MS / 1000
