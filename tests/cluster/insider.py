"""A participant with valid credentials that misbehaves inside a cluster run (issue 27): bob's
worker r1s0, started with this file in place of ``python -m meshlearn.entry.worker`` — the same
worker with bob's real key, plus what a malicious host can add to its own code:

- while its links connect: a hello claiming the link of alice's worker r1s1 into r0s0 (a worker
  it does not own), then, once its own link into r0s0 is up, a second hello for it (a second slot);
- in front of each of its first three DP contributions to r0s0, one more frame: 40× the size, a
  replay of its previous contribution, one whose header does not decode;
- at its first contribution, through its host's authenticated control connection: another
  worker's heartbeat, done mark and link address, another worker's checkpoint entry, the
  coordinator's resume state and another host's security record; two aborts that speak for
  alice's processes (r0s0's own failure, and what r0s0 "noticed" of bob's r0s1); and the joiner
  key the owner also issued it, knocking at the control service.

What each attempt got is appended to ``INSIDER_REPORT`` (JSON lines: ``attack``, ``outcome``).
The patches act only in the process whose ``RANK`` is r1s0's, so a host's launcher can load them
in every process it starts (``insider_site/sitecustomize.py``) and only r1s0 misbehaves.

    INSIDER_REPORT=report.jsonl INSIDER_JOINER=keys/joe.key python insider.py --config … --out …
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from meshlearn.cluster import links
from meshlearn.cluster.control_store import ControlLine
from meshlearn.distributed import collectives
from meshlearn.distributed.groups import collective_hops
from meshlearn.distributed.health import store_client
from meshlearn.distributed.wire import HEADER_ROOM
from meshlearn.entry.worker import main
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.net import port
from meshlearn.net.keys import Credentials
from meshlearn.net.links import dial_link
from meshlearn.net.tls import Refused, RunTls

INSIDER = 2  # r1s0's rank, on bob
VICTIM = 0  # r0s0's rank: r1s0's stage partner, on alice
IMPERSONATED = 3  # r1s1's rank: alice's other worker
MESH = MeshShape(2, 2)


def _insider() -> bool:
    return os.environ.get("RANK") == str(INSIDER)


def report(attack: str, outcome: str) -> None:
    with open(os.environ["INSIDER_REPORT"], "a") as f:
        f.write(json.dumps({"attack": attack, "outcome": outcome}) + "\n")


def _try(attack: str, call) -> None:
    try:
        call()
        report(attack, "accepted")
    except Exception as err:  # noqa: BLE001 — the outcome is what the test reads
        report(attack, f"refused: {type(err).__name__}: {err}")


# --- the links' set-up ---------------------------------------------------------------------------

honest_dial = links.ClusterConnector._dial


def _dial(self, hop, channel, owners, deadline):
    if not _insider() or channel != "collectives" or hop[2] != VICTIM:
        return honest_dial(self, hop, channel, owners, deadline)
    foreign = next(h for h in collective_hops(MESH) if h[1] == IMPERSONATED and h[2] == VICTIM)
    claim = self._link(foreign)
    address, agent_port = self.ports["alice"]
    while time.monotonic() < deadline:  # until r0s0 listens: then its gate reads the hello
        try:
            dial_link(port.dial(address, agent_port, f"{self.names[VICTIM]}/{channel}", 5.0), self.tls, claim,
                      {claim[0]: "bob", claim[1]: "alice"}, time.monotonic() + 5.0, HEADER_ROOM)
            report("claim another worker's link", "accepted")
            break
        except (Refused, OSError) as err:
            if "refused the link" in str(err):
                report("claim another worker's link", f"refused: {err}")
                break
            time.sleep(0.02)
    stream = honest_dial(self, hop, channel, owners, deadline)
    mine = self._link(hop)
    _try("a second hello for its own link", lambda: dial_link(
        port.dial(address, agent_port, f"{self.names[VICTIM]}/{channel}", 5.0), self.tls, mine,
        {mine[0]: "bob", mine[1]: "alice"}, time.monotonic() + 5.0, HEADER_ROOM))
    return stream


# --- the DP contributions --------------------------------------------------------------------------

honest_send = collectives.FramedCollectives._send
sums: list[tuple[bytes, torch.Tensor]] = []  # its honest sum frames to r0s0, as sent


def _send(self, peer, frame, release, op):
    if not _insider() or op != "sum" or peer != VICTIM or len(sums) >= 3:
        return honest_send(self, peer, frame, release, op)
    head, body = frame
    sequence = self.sent[peer]
    header = collectives.HEADER.pack(collectives.MAGIC, collectives.OPS[op], sequence)
    if not sums:
        _control_plane()
        big = torch.zeros(40 * body.numel(), dtype=torch.uint8)
        lie = (collectives.PREFIX.pack(collectives.HEADER.size, big.numel()) + header, big)
    elif len(sums) == 1:
        lie = sums[0]  # the previous step's contribution, byte for byte
    else:
        lie = (head + b"JUNK" + header[4:], body)  # the right size, a header that is none
    self._queues[peer].put((lie[0], lie[1], release))
    sums.append((head + header, body.clone()))
    report(f"dp frame {len(sums)}", "sent in front of the honest one")
    return honest_send(self, peer, frame, release, op)


def _control_plane() -> None:
    store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 10.0)
    victim = str(MESH.worker(VICTIM))
    _try("another worker's heartbeat", lambda: store.add(f"hb/{VICTIM}", 1))
    _try("another worker's done mark", lambda: store.set(f"done/{VICTIM}", "1"))
    _try("another worker's link address", lambda: store.set(f"links/{VICTIM}", "10.6.6.6:1"))
    _try("another worker's checkpoint entry", lambda: store.set(f"cluster/checkpoint/1/shard/{victim}", "{}"))
    _try("the coordinator's resume state", lambda: store.set("resume_state", "{}"))
    _try("another host's security record",
         lambda: store.underlying_store.set("meshlearn-cluster/security/alice", "{}"))
    _try("an abort in another worker's name",
         lambda: store.compare_set("abort", "", f"worker {victim} failed: RuntimeError: the insider says so"))
    noticed = f"worker r0s1 stopped answering (rank 1; noticed by {victim})"
    _try("an abort that another worker noticed", lambda: store.compare_set("abort", "", noticed))
    joiner = Path(os.environ["INSIDER_JOINER"])
    line = ControlLine(RunTls(Credentials.in_folder(joiner.parent, joiner.stem)), os.environ["MASTER_ADDR"],
                       int(os.environ["MASTER_PORT"]), "alice")
    _try("a joiner's key at the control service", lambda: line.reach(5.0))


links.ClusterConnector._dial = _dial
collectives.FramedCollectives._send = _send
assert str(MESH.worker(VICTIM)) == "r0s0" and MESH.worker(IMPERSONATED) == WorkerId(1, 1)
assert MESH.worker(INSIDER) == WorkerId(1, 0)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
