"""The dist package's pure parts, without processes: wire format, pacing, deadlines, checkpoints."""

from __future__ import annotations

import functools
import json
import random
from types import SimpleNamespace

import pytest
import torch

from meshlearn.checkpoint_layout import latest_complete
from meshlearn.compress.codecs import Encoded, IdentityCodec
from meshlearn.compress.wire_checks import WireGuard
from meshlearn.config import load_config
from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.health import WorkerFailure
from meshlearn.distributed.pipeline_refusals import PipelineRefusals
from meshlearn.distributed.settings import DistConfig, derive_deadlines, links_of
from meshlearn.distributed.shaping import Pacer
from meshlearn.distributed.wire import WireError, pack, prefix, unpack
from meshlearn.errors import ConfigError
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Link, LinkProfile, build_network
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.net.counters import Counters
from meshlearn.train.checkpoint import ShardedCheckpoint, load_run_state

CPU = torch.device("cpu")


def test_a_message_survives_the_wire_bit_for_bit():
    payload = Encoded({"values": torch.randn(2, 3, 4), "ids": torch.arange(6).reshape(2, 3),
                       "q": torch.randint(-9, 9, (7,), dtype=torch.int8),
                       "half": torch.randn(5).bfloat16(), "empty": torch.zeros(0)},
                      (2, 3, 4), torch.float32, {"rank": 3, "name": "x"})
    sent = Message("grad", 7, 1, WorkerId(1, 2), WorkerId(1, 1), payload, skip=True)
    buffer = pack(sent, CPU)
    padded = torch.cat([buffer, torch.full((100,), 7, dtype=torch.uint8)])  # a larger receive buffer
    got = unpack(padded, peer=WorkerId(1, 2))
    assert (got.kind, got.step, got.microbatch, got.src, got.dst, got.skip) == ("grad", 7, 1, WorkerId(1, 2),
                                                                               WorkerId(1, 1), True)
    assert got.payload.meta == payload.meta and got.payload.shape == (2, 3, 4)
    for name, tensor in payload.tensors.items():
        assert got.payload.tensors[name].dtype == tensor.dtype
        assert torch.equal(got.payload.tensors[name], tensor), name


def test_a_header_beyond_the_room_receivers_allow_fails_at_its_honest_sender():
    """A receiver refuses a header over HEADER_ROOM as a lie (streams.py): an honest message that
    large must fail where it is packed, naming the limit, never reach a verifier as a forgery."""
    many = {f"blocks.{i}.mlp.w": torch.zeros(1) for i in range(2000)}
    src, dst = WorkerId(0, 0), WorkerId(2, 0)
    message = Message("anchor_weights", 3, 0, src, dst, Encoded(many, (), torch.float32))
    with pytest.raises(WireError, match=r"header .*may take 65536 bytes"):
        pack(message, CPU)
    deep = dict(list(many.items())[:300])
    fits = Message("anchor_weights", 3, 0, src, dst, Encoded(deep, (), torch.float32))
    assert len(unpack(pack(fits, CPU), src).payload.tensors) == 300  # a deep stage's snapshot


def test_bad_bytes_name_the_peer_they_came_from():
    message = Message("act", 0, 0, WorkerId(0, 0), WorkerId(0, 1), Encoded({"v": torch.ones(3)}, (3,),
                                                                             torch.float32))
    buffer = pack(message, CPU)
    with pytest.raises(WireError, match="from r0s2 claims"):
        unpack(buffer, peer=WorkerId(0, 2))  # a worker posing as another
    with pytest.raises(WireError, match="malformed message from r0s0"):
        unpack(buffer[:-5], peer=WorkerId(0, 0))  # truncated
    garbage = torch.tensor(list(b'{"kind": 1}'), dtype=torch.uint8)
    with pytest.raises(WireError, match="malformed message from r0s0"):
        unpack(torch.cat([prefix(len(garbage), 0, CPU), garbage]), peer=WorkerId(0, 0))
    lying = torch.cat([prefix(len(garbage), 0, CPU), garbage])  # a length past the buffer
    lying[:8] = prefix(10**6, 0, CPU)[:8]
    with pytest.raises(WireError, match="prefix claims"):
        unpack(lying, peer=WorkerId(0, 0))



_HEADER = {"kind": "act", "step": 0, "microbatch": 0, "src": "r0s0", "dst": "r0s1", "skip": False,
           "version": 0, "shape": [1], "dtype": "float32", "meta": {}, "tensors": []}


@pytest.mark.parametrize("lie", [
    {"tensors": [["v", "float32", [-2, 2]]]},  # torch: invalid shape dimension
    {"tensors": [["v", "float32", [0, -5]]]},  # torch: negative dimension
    {"tensors": [["v", "float32", [0, float("inf")]]]},  # int(): infinity (json writes Infinity)
    {"step": float("inf")},
    {"src": 5},  # not a string: WorkerId.parse
])
def test_a_header_that_breaks_torch_or_int_is_a_wire_error_too(lie):
    """The transport refuses a WireError as a lie (``Forged``) and takes any other error for a
    broken link: every undecodable header must be a WireError."""
    header = json.dumps(_HEADER | lie).encode()
    body = bytes(16)
    buffer = torch.cat([prefix(len(header), len(body), CPU),
                        torch.frombuffer(bytearray(header + body), dtype=torch.uint8)])
    with pytest.raises(WireError, match="malformed message from r0s0"):
        unpack(buffer, peer=WorkerId(0, 0))
    with pytest.raises(WireError, match="malformed message from r0s0"):
        unpack(torch.zeros(3, dtype=torch.uint8), peer=WorkerId(0, 0))  # shorter than a prefix


def test_a_worker_takes_a_message_s_kind_and_sender_from_its_link_never_from_its_header():
    """A gradient that calls itself an activation (and the reverse) is refused by the worker's guard
    with the link's sender in the record and a stand-in of the kind the link carries, which is what
    its receiver waits for (before: the guard inferred the sender from the header's kind, blamed the
    other neighbour and stood in with the wrong kind). A pipeline kind on a DP link has no stand-in:
    it ends the run naming the sender."""
    me, up, down, peer = WorkerId(0, 1), WorkerId(0, 0), WorkerId(0, 2), WorkerId(1, 1)
    shape = (1, 2, 3)
    guard = WireGuard(IdentityCodec(), seq_len=shape[1], d_model=shape[2], vocab_size=8)
    worker = SimpleNamespace(id=me, guard=guard, work={0: SimpleNamespace(microbatch_size=1)},
                             microbatches=1, context=lambda kind, j, arriving: None)
    received: list[Message] = []
    worker.admit = functools.partial(Worker.admit, worker)
    worker.receive = received.append
    driver = DistDriver.__new__(DistDriver)
    driver.me, driver.prev, driver.next, driver.worker = me, up, down, worker
    driver.health = SimpleNamespace(abort=lambda message: message)
    driver.refusals = PipelineRefusals(str(me), driver.health, Counters(), {})

    def arrival(kind: str, src: WorkerId) -> Message:
        message = Message(kind, 0, 0, src, me, IdentityCodec().encode(torch.ones(shape), kind))
        message.link = (src, me)  # as the transport marks it
        return message

    with pytest.raises(WorkerFailure, match="worker r1s1 sent a 'act' message on its link to r0s1, which "
                                            "carries 'dp' messages"):
        driver._deliver(arrival("act", peer))
    for kind, src in (("act", up), ("grad", down), ("act", down), ("grad", up)):
        driver._deliver(arrival(kind, src))
    assert [(m.kind, m.src, m.skip) for m in received] == [
        ("act", up, False), ("grad", down, False), ("grad", down, True), ("act", up, True)]
    assert driver.refusals.total == 2 and driver.refusals.counters.as_dict() == {"message_refused": 2}
    assert not received[2].payload.tensors["values"].any()  # the stand-in's zeros


def test_pacer_releases_each_message_when_the_simulator_says_it_arrives():
    """The same Link arithmetic as the simulator: FIFO at the bandwidth, then the latency. A fake
    clock stands still between the two sends, so the check is exact on any machine load."""
    profile = LinkProfile(bandwidth_mbit=8.0, latency_ms=50.0, jitter_ms=3.0)  # 1 MB/s
    sim = Link(WorkerId(0, 0), WorkerId(0, 1), "pp", profile, random.Random("s"))
    real = Link(WorkerId(0, 0), WorkerId(0, 1), "pp", profile, random.Random("s"))
    now = [0.0]
    pacer = Pacer(real, epoch=0.0, enabled=True, clock=lambda: now[0])
    # Two messages queued at the same moment: the second waits for the first to leave.
    first, second = pacer.release_at(100_000), pacer.release_at(100_000)
    assert first == sim.transmit(0.0, 100_000)  # the same jitter draws
    assert second == sim.transmit(0.0, 100_000)
    assert second - first == pytest.approx(0.1, abs=0.004)  # 100 kB at 1 MB/s, plus jitter
    assert real.bytes_sent == 200_000 and real.busy_s == pytest.approx(0.2)
    now[0] = 5.0
    unshaped = Pacer(Link(WorkerId(0, 0), WorkerId(0, 1), "pp", profile, random.Random(1)), 0.0, False,
                     clock=lambda: now[0])
    assert unshaped.release_at(10**9) == 5.0  # unshaped: now, but still accounted
    assert unshaped.link.bytes_sent == 10**9


def test_a_workers_pacers_share_its_uplink():
    """``links.access = uplink``: the Pacers the driver builds, one per peer over one network, are
    one queue (the worker's access link): messages to the next stage and to a DP peer handed over
    at the same moment leave one after the other; without it each link paces on its own."""
    me, up_next, dp_peer = WorkerId(0, 1), WorkerId(0, 2), WorkerId(1, 1)
    for access, gap in (("uplink", 0.1), ("off", 0.0)):
        cfg = load_config(None, [f"links.access={access}", "link.bandwidth_mbit=8", "link.latency_ms=50"])
        network = build_network(cfg.link, cfg.links, MeshShape(2, 3), cfg.seed)
        pacers = {peer: Pacer(network.link(me, peer), 0.0, True, clock=lambda: 0.0)
                  for peer in (up_next, dp_peer)}
        first, second = pacers[up_next].release_at(100_000), pacers[dp_peer].release_at(100_000)  # 0.1 s each
        assert (first, second) == (pytest.approx(0.15), pytest.approx(0.15 + gap)), access


def test_deadlines_grow_with_what_the_link_needs():
    dist = DistConfig(timeout_s=5.0, dead_after_s=2.0)
    fast = derive_deadlines(dist, LinkProfile(float("inf"), 0.0), 10**6, 8, 10**7, 2)
    slow = derive_deadlines(dist, LinkProfile(10.0, 100.0), 10**6, 8, 10**7, 2)
    assert fast.message_s == 5.0 and fast.dead_after_s == 2.0
    # 8 messages of 1 MB at 10 Mbit/s (0.8 s each) plus 100 ms each, doubled.
    assert slow.message_s == pytest.approx(5.0 + 2 * 8 * 0.9)
    assert slow.collective_s > slow.message_s and slow.dead_after_s == pytest.approx(2.2)


def test_dist_settings_are_checked_up_front():
    with pytest.raises(ConfigError, match="dist.dead_after_s"):
        load_config(None, ["dist.heartbeat_s=5", "dist.dead_after_s=6"])
    with pytest.raises(ConfigError, match="backend"):
        load_config(None, ["backend=mpi"])
    load_config(None, ["backend=dist", "verify.name=sentinel"])  # the verifier process relays
    load_config(None, ["backend=dist", "verify.name=sentinel", "mesh.schedule=async"])
    for overrides, key in [(["attack.kind=zeros", "attack.workers=r0s1", "mesh.stages=4"], "attack.kind"),
                           (["verify.name=sentinel", "dp.name=diloco"], "dp.name"),
                           (["verify.name=sentinel", "dist.comm=nccl"], "dist.comm")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ["backend=dist", *overrides])


def test_what_carries_the_links_auto_resolves_and_bad_values_are_refused():
    """``dist.links = auto``: tcp where a verifier relays (a lying frame must not abort it),
    collective otherwise and in elastic runs (rows link over gloo pair groups)."""
    def cfg(*overrides):
        return load_config(None, ["backend=dist", *overrides])

    assert links_of(cfg()) == "collective" and links_of(cfg("dist.links=tcp")) == "tcp"
    assert links_of(cfg("verify.name=sentinel")) == "tcp"
    assert links_of(cfg("verify.name=sentinel", "dist.links=collective")) == "collective"
    assert links_of(cfg("verify.name=sentinel", "elastic.enabled=true", "mesh.replicas=2")) == "collective"
    for overrides in (["dist.links=udp"], ["dist.links=tcp", "elastic.enabled=true", "mesh.replicas=2"]):
        with pytest.raises(ConfigError, match=r"dist\.links"):
            cfg(*overrides)


def test_a_checkpoint_is_complete_only_once_its_manifest_is_written(tmp_path):
    names = ["r0s0", "r0s1"]
    barriers = []

    def store(shard, writer):
        return ShardedCheckpoint(tmp_path, shard, names, barriers.append, writer, keep=2)

    common = {"config": {"seed": 1}, "totals": {"step": 0}, "last_val_loss": None}
    for step in (2, 4, 6):
        store("r0s1", False).save(step, common, {"workers": {"r0s1": {"w": step}}})
        store("r0s0", True).save(step, common, {"workers": {"r0s0": {"w": step}}})
    assert [f.name for f in (tmp_path / "checkpoints").iterdir()] == ["step-000004", "step-000006"]
    # A crash after one shard of step 8: no manifest, so resume still reads step 6.
    store("r0s1", False).save(8, common, {"workers": {"r0s1": {"w": 8}}})
    assert latest_complete(tmp_path).name == "step-000006"
    assert store("r0s1", False).load()[1]["workers"] == {"r0s1": {"w": 6}}
    state = load_run_state(tmp_path)  # what `meshlearn sample` reads
    assert state["config"] == {"seed": 1} and state["workers"] == {"r0s0": {"w": 6}, "r0s1": {"w": 6}}
    # A manifest whose shard is missing does not count either.
    (tmp_path / "checkpoints" / "step-000006" / "r0s0.pt").unlink()
    assert latest_complete(tmp_path).name == "step-000004"
    assert json.loads((tmp_path / "checkpoints" / "step-000004" / "manifest.json").read_text())["step"] == 4
    assert len(barriers) == 7


def test_an_anchor_stage_folds_relays_into_one_copy_up_to_its_next_pass_and_holds_later_ones():
    """``anchor.weights = outer``: relays are folded on arrival (memory: one copy, not one per
    relay) but never past the step before the next pass, whose weights must be those of its own
    hand-off; a later relay is held until that pass has begun, and relays fold in step order."""
    from meshlearn.distributed.anchor import Follower

    module = torch.nn.Linear(2, 1, bias=False)
    follower = Follower(module)
    src, dst = WorkerId(0, 0), WorkerId(1, 0)

    def relay(step: int, value: float) -> Message:
        return Message("anchor_listen", step, 0, src, dst, Encoded({"weight": torch.full((1, 2), value)},
                                                                     (), torch.float32))

    follower.aim(2)  # the next pass is hand-off 2: fold relays of step ends 0 and 1
    follower.arrive(relay(1, 1.0))  # out of order: held until step 0's is in
    assert follower.folded == 0 and list(follower.held) == [1]
    follower.arrive(relay(0, 0.5))
    assert follower.folded == 2 and not follower.held and follower.weights["weight"].tolist() == [[1.0, 1.0]]
    follower.arrive(relay(2, 2.0))  # belongs after pass 2 has begun
    assert follower.folded == 2 and list(follower.held) == [2]
    assert follower.weights["weight"].tolist() == [[1.0, 1.0]]  # pass 2 computes on these
    follower.aim(None)  # pass 2 begun, none after it: fold everything
    assert follower.folded == 3 and not follower.held and follower.weights["weight"].tolist() == [[2.0, 2.0]]
