"""What the commit vote and the row agreement cost an elastic step over a WAN, before and after
``elastic/peer_vote.py`` (issue 26 item 4).

Two emulated machines (network namespaces, ``bench/wan.py``: 200 Mbit/s, ``--delay-ms`` each way
through the TUN relay). P = 2 × D = 2 stage replicas under ``elastic.membership = "control"``,
each a process with the real pieces (``ControlQuorum`` on the run's store, its sums over framed
streams, the row agreement, the vote): stage 0 (r0s0, r1s0) and the run's store on machine 0,
stage 1 (r0s1, r1s1) on machine 1 — so the pipeline and every store request of stage 1 cross the
slow link, as the coordinator's store does for every machine but its own in a cluster run. No
model: each step is the quorum (its fast path), one sum of 1,000 numbers over the stage, then the
row agreement and the vote, timed on their own. Two arms:

- ``store``: the row agreement and ``CommitVote`` on the store every step (before);
- ``peers``: ``ReusedRows`` and ``PeerVote`` (after): the rows agreed once, the vote's two
  rounds over the members' streams.

Per arm, over steps 2..N (the first forms the quorums, the rows and the vote's streams): the median
of the slowest member's vote + rows seconds, the median of the most store requests a member made
for them (a stage that waits for the other polls the store), and the load average before and after
(2 shared cores).

    sudo env PYTHONPATH=src OMP_NUM_THREADS=1 python bench/vote_wan.py --steps 20 --delay-ms 40

(as root: namespaces and the relay's TUN devices need it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import ROOT, load_average, markdown_table, write_results
from wan import Machine, machines, rtt_ms, unavailable

MEMBERS = (("r0s0", 0), ("r1s0", 0), ("r0s1", 1), ("r1s1", 1))  # worker, machine
PORT = 29671
SUM_NUMBERS = 1000


def member(args) -> None:
    """One stage replica (inside its machine's namespace): prints its per-step timings as JSON."""
    import torch
    import torch.distributed as dist

    from meshlearn.distributed.health import store_client
    from meshlearn.distributed.streams import PlainConnector
    from meshlearn.elastic.control_quorum import ControlQuorum, CountingStore, SettlingVote
    from meshlearn.elastic.peer_vote import PeerVote, ReusedRows
    from meshlearn.elastic.quorum import CommitVote
    from meshlearn.elastic.rows import RowAgreement
    from meshlearn.elastic.settings import ElasticTimeouts
    from meshlearn.mesh.topology import MeshShape, WorkerId

    mesh, me = MeshShape(replicas=2, stages=2), WorkerId.parse(args.member)
    timeouts = ElasticTimeouts(heartbeat_s=10.0, join_s=10.0, quorum_s=60.0, collective_s=30.0)
    host, port = args.store.rsplit(":", 1)

    def client(prefix: str):
        return dist.PrefixStore(prefix, store_client(host, int(port), timeouts.quorum_s))
    stage = CountingStore(client(f"elastic/q/s{me.stage}"))
    quorum = ControlQuorum(mesh, me, f"{me}.0", stage, client(f"elastic/q/s{me.stage}"),
                           PlainConnector(stage, args.address), timeouts, 1, lambda: {}, lambda state: None,
                           joining=False)
    shared = CountingStore(client("elastic/"))
    vote = CommitVote(shared, mesh.stages, timeouts.collective_s)
    rows = RowAgreement(shared, mesh.stages, mesh.replicas, timeouts.quorum_s)
    if args.arm == "peers":
        connecting = PlainConnector(client("elastic/"), args.address)  # a thread's: its own client
        peers = PeerVote(shared, connecting, mesh, me, vote, timeouts.collective_s, timeouts.quorum_s,
                         steady=quorum.unchanged)
        vote, rows = peers, ReusedRows(rows, peers)
    vote = SettlingVote(vote, quorum)
    shared.add("started", 1)  # every member asked to join before anyone forms the first record
    while int(shared.add("started", 0)) < len(MEMBERS):
        time.sleep(0.01)
    held, steps = None, []
    for step in range(args.steps):
        began = time.monotonic()
        current = quorum.begin()
        quorum.sum(torch.ones(SUM_NUMBERS))
        summed, before = time.monotonic(), shared.requests
        agreed = rows.agree(step, me, current.participants, held)
        row = agreed.row_of(me)
        held = None if row is None else (row, agreed.linked_at[row])  # it links as agreed
        committed = vote.decide(step, me, current.participants, quorum.should_commit())
        ended = time.monotonic()
        steps.append({"step_s": ended - began, "vote_rows_s": ended - summed, "committed": committed,
                      "vote_rows_requests": shared.requests - before, "quorum_requests": current.requests})
    shared.add("finished", 1)  # nobody closes its streams while another still votes on them
    while int(shared.add("finished", 0)) < len(MEMBERS):
        time.sleep(0.01)
    vote.close()
    quorum.shutdown()
    print(json.dumps({"member": args.member, "steps": steps}), flush=True)


def arm(name: str, hosts: list[Machine], steps: int, port: int) -> dict:
    """One arm: a store on machine 0, the four members; their records merged per step."""
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    store_code = ("import sys, time, datetime, torch.distributed as d; "
                  "s = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False, "
                  "timeout=datetime.timedelta(seconds=120)); print('ready', flush=True); time.sleep(3600)")
    store = hosts[0].popen([sys.executable, "-c", store_code, hosts[0].address, str(port)],
                           stdout=subprocess.PIPE, text=True, env=env)
    load_before = load_average()
    try:
        if store.stdout.readline().strip() != "ready":
            raise RuntimeError("the store did not start")
        argv = [sys.executable, __file__, "--arm", name, "--steps", str(steps), "--store",
                f"{hosts[0].address}:{port}"]
        procs = [hosts[m].popen([*argv, "--member", w, "--address", hosts[m].address], stdout=subprocess.PIPE,
                                text=True, env=env) for w, m in MEMBERS]
        outputs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        store.kill()
        store.wait(timeout=10)
    per_step = list(zip(*[o["steps"] for o in outputs], strict=True))
    assert all(len({s["committed"] for s in step}) == 1 for step in per_step), "members disagree"
    later = per_step[1:]  # the first step forms the quorums, the rows and the vote's streams
    return {"arm": name, "steps": steps, "committed": sum(step[0]["committed"] for step in per_step),
            "first_vote_rows_s": max(s["vote_rows_s"] for s in per_step[0]),
            "vote_rows_s": statistics.median(max(s["vote_rows_s"] for s in step) for step in later),
            "step_s": statistics.median(max(s["step_s"] for s in step) for step in later),
            "vote_rows_requests": statistics.median(max(s["vote_rows_requests"] for s in step)
                                                    for step in later),
            "quorum_requests": statistics.median(max(s["quorum_requests"] for s in step) for step in later),
            "load_before": load_before, "load_after": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--delay-ms", type=float, default=40.0, help="one way, between the two machines")
    parser.add_argument("--member", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=("store", "peers"), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member:
        member(args)
        return
    if (why := unavailable()) is not None:
        sys.exit(f"bench/vote_wan.py: {why}")
    with machines(2, "200mbit", {(0, 1): args.delay_ms}) as hosts:
        rtt = rtt_ms(hosts[1], hosts[0])
        rows = [arm(name, hosts, args.steps, PORT + i) for i, name in enumerate(("store", "peers"))]
    for row in rows:
        row["rtt_ms"] = rtt
    command = f"sudo env PYTHONPATH=src OMP_NUM_THREADS=1 python bench/vote_wan.py --steps {args.steps} " \
              f"--delay-ms {args.delay_ms:g}"
    table = markdown_table(rows, [("arm", "vote and rows", ""), ("rtt_ms", "RTT, ms (measured)", ".1f"),
                                  ("vote_rows_s", "median vote + rows s/step", ".3f"),
                                  ("vote_rows_requests", "median store requests/step (most of a member)",
                                   ".0f"),
                                  ("first_vote_rows_s", "first step's vote + rows s", ".3f"),
                                  ("step_s", "median step s (quorum, sum, vote, rows)", ".3f"),
                                  ("committed", "steps committed", "d"),
                                  ("load_before", "load before", ""), ("load_after", "load after", "")])
    text = (f"The commit vote and the row agreement over a WAN: P = 2 × D = 2 under elastic.membership = "
            f"control, stage 0 and the store on one machine, stage 1 on another ({rtt:.1f} ms RTT, 200 "
            f"Mbit/s); no model (each step: the quorum, one sum over the stage, the row agreement, the "
            f"vote); the slowest member per step, median over steps 2..{args.steps}. `store`: both on the "
            f"run's store every step; `peers`: elastic/peer_vote.py. `{command}`\n\n{table}\n")
    write_results("vote_wan", {"command": command, "rows": rows}, text)


if __name__ == "__main__":
    main()
