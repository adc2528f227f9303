"""A cluster run's streams through the hosts' ports (``cluster/links.py``): two "hosts" on one
machine (two port agents on 127.0.0.1, two identities of one run's CA) connect a set of pipeline
links and the framed collectives' channel, and carry frames both ways. A peer with a valid
certificate of the wrong host cannot take a link (refused, counted; the real peer then gets it);
a stranger without a certificate is refused at the handshake and counted; an oversized frame is
refused before allocation and the link stays in step; and a P = 2 × D = 2 run of real processes
whose every stream is authenticated through the two ports gives the simulator's losses."""

from __future__ import annotations

import dataclasses
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loopback import (
    HOSTS,
    HOSTS_OF,
    MESH,
    NAMES,
    cluster_config,
    control_service,
    logs_of,
    losses,
    simulator_losses,
    start_workers,
    wait_all,
)

from meshlearn.cluster.links import KEY_ENV, PORT_SOCKET_ENV, ClusterConnector, cluster_connector
from meshlearn.cluster.role import HOST_ENV
from meshlearn.config import save_config
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.collectives import FramedCollectives
from meshlearn.distributed.groups import collective_hops, link_hops
from meshlearn.distributed.health import Health, store_client
from meshlearn.distributed.transport import Forged, Transport
from meshlearn.distributed.wire import pack
from meshlearn.errors import ConfigError
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.net.counters import Counters
from meshlearn.net.frames import frame
from meshlearn.net.keys import Credentials, create_run
from meshlearn.net.links import AuthStream, dial_link
from meshlearn.net.port import PortAgent, dial
from meshlearn.net.tls import Refused, RunTls

R00, R01 = WorkerId(0, 0), WorkerId(0, 1)
PIPELINE = [((a, b), MESH.rank(a), MESH.rank(b)) for r in range(2)
            for a, b in ((WorkerId(r, 0), WorkerId(r, 1)), (WorkerId(r, 1), WorkerId(r, 0)))]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's CA: hosts alice and bob, and carol, a host of the run that runs none of these workers."""
    folder = tmp_path_factory.mktemp("keys")
    create_run(folder, ["alice", "bob", "carol"], "links-test")
    return folder


@dataclasses.dataclass
class Machines:
    """Two port agents on 127.0.0.1, one per host, and each host's connector factory."""

    agents: dict[str, PortAgent]
    keys: Path
    names: dict[int, str] = dataclasses.field(default_factory=lambda: dict(NAMES))  # rank → process
    hosts_of: dict[str, str] = dataclasses.field(default_factory=lambda: dict(HOSTS_OF))  # process → host

    def connector(self, host: str) -> ClusterConnector:
        ports = {h: ("127.0.0.1", a.port) for h, a in self.agents.items()}
        return ClusterConnector(RunTls(Credentials.in_folder(self.keys, host)), self.agents[host].socket_path,
                                self.names, self.hosts_of, ports)


@pytest.fixture
def machines(keys: Path) -> Iterator[Machines]:
    folders = [Path(tempfile.mkdtemp(prefix="ml-links-")) for _ in HOSTS]  # AF_UNIX paths are short
    agents = {h: PortAgent("127.0.0.1", 0, f / "agent.sock") for h, f in zip(HOSTS, folders, strict=True)}
    for agent in agents.values():
        agent.start()
    yield Machines(agents, keys)
    for agent, folder in zip(agents.values(), folders, strict=True):
        agent.close()
        shutil.rmtree(folder)


Connected = dict[int, dict[str, dict[int, AuthStream]]]  # rank → channel → hop index → stream


def _connect_all(machines: Machines, channels: dict[str, list]) -> Connected:
    """Every worker's ``connect``, each in a thread of its own (as each in its process)."""
    got, errors = {}, []

    def one(rank: int) -> None:
        try:
            host = machines.hosts_of[machines.names[rank]]
            got[rank] = machines.connector(host).connect(rank, channels, 20.0)
        except BaseException as err:  # noqa: BLE001 — asserted below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in machines.names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return got


def test_links_and_collectives_cross_the_ports_authenticated_both_ways(machines: Machines) -> None:
    pairs = collective_hops(MESH)
    got = _connect_all(machines, {"links": PIPELINE, "collectives": pairs})
    for rank, channels in got.items():  # each hop's two ends, each knowing the other host
        for channel, hops in (("links", PIPELINE), ("collectives", pairs)):
            mine = [i for i, (_, a, b) in enumerate(hops) if rank in (a, b)]
            assert sorted(channels[channel]) == mine
            for i in mine:
                other = hops[i][2] if hops[i][1] == rank else hops[i][1]
                assert channels[channel][i].peer.name == HOSTS_OF[NAMES[other]]
    assert sum(a.routed for a in machines.agents.values()) == len(PIPELINE) + len(pairs)
    for i, (link, a, b) in enumerate(PIPELINE):  # a frame each way on every pipeline link
        data = torch.frombuffer(bytearray(frame(b"h", str(link).encode())), dtype=torch.uint8)
        got[a]["links"][i].send(data)
        body = bytes(got[b]["links"][i].read_frame(1024).numpy())
        assert body.endswith(str(link).encode())
    sums = {}

    def collect(rank: int) -> None:
        mine = got[rank]["collectives"]
        framed = FramedCollectives(rank, {b: mine[i] for i, (_, a, b) in enumerate(pairs) if a == rank},
                                   {a: mine[i] for i, (_, a, b) in enumerate(pairs) if b == rank})
        framed.set_timeout(20)
        sums[rank] = framed.sum(torch.full((3,), float(rank + 1)), sorted(NAMES))
        framed.close()

    threads = [threading.Thread(target=collect, args=(rank,)) for rank in NAMES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(s, torch.full((3,), 10.0)) for s in sums.values()), sums
    for channels in got.values():
        for streams in channels.values():
            for stream in streams.values():
                stream.close()


def test_a_verifier_receives_each_relayed_link_on_a_stream_of_its_own(machines: Machines) -> None:
    """P = 3 with the SENTINEL verifier (on alice): r0s1 sends two links through it, each its own
    authenticated stream, named by its link."""
    mesh = MeshShape(1, 3)
    machines.names = {0: "r0s0", 1: "r0s1", 2: "r0s2", 3: "verifier"}
    machines.hosts_of = {"r0s0": "alice", "r0s1": "bob", "r0s2": "alice", "verifier": "alice"}
    cfg = SimpleNamespace(verify=SimpleNamespace(name="sentinel"), dp=SimpleNamespace(name="allreduce"))
    hops = link_hops(cfg, mesh)
    got = _connect_all(machines, {"links": hops})
    relayed = {i: link for i, (link, a, b) in enumerate(hops) if a == 1}  # r0s1 → verifier, per link
    assert sorted(str(link[1]) for link in relayed.values()) == ["r0s0", "r0s2"]
    assert len(got[3]["links"]) == 8  # the verifier: every link in and out
    for i, link in relayed.items():
        data = torch.frombuffer(bytearray(frame(b"h", str(link).encode())), dtype=torch.uint8)
        got[1]["links"][i].send(data)
        stream = got[3]["links"][i]
        assert stream.peer.name == "bob" and stream.link == ("r0s1", f"verifier[{link[0]}->{link[1]}]")
        assert bytes(stream.read_frame(1024).numpy()).endswith(str(link).encode())
    for channels in got.values():
        for stream in channels["links"].values():
            stream.close()


def _receive_in_background(machines: Machines, rank: int, connector: ClusterConnector | None = None
                           ) -> tuple[threading.Thread, dict, ClusterConnector]:
    """The receiving end of r0s0 → r0s1 (bob's r0s1, by ``connector`` if given), connecting in a thread."""
    connector, got = connector or machines.connector("bob"), {}
    thread = threading.Thread(
        target=lambda: got.update(connector.connect(rank, {"links": PIPELINE[:1]}, 20.0)))
    thread.start()
    end = time.monotonic() + 10
    while "r0s1/links" not in machines.agents["bob"].destinations():
        assert time.monotonic() < end, "r0s1 never registered"
        time.sleep(0.01)
    return thread, got, connector


def test_a_valid_certificate_of_the_wrong_host_cannot_take_a_link(machines: Machines) -> None:
    thread, got, receiver = _receive_in_background(machines, MESH.rank(R01))
    impostor = RunTls(Credentials.in_folder(machines.keys, "carol"))  # the run's CA; runs no r0s0
    link, owners = ("r0s0", "r0s1[r0s0->r0s1]"), {"r0s0": "alice", "r0s1[r0s0->r0s1]": "bob"}
    sock = dial("127.0.0.1", machines.agents["bob"].port, "r0s1/links", 10)
    with pytest.raises(Refused, match="refused_by_peer: bob refused the link r0s0->r0s1"):
        dial_link(sock, impostor, link, owners, time.monotonic() + 10, 1024)
    end = time.monotonic() + 10
    while receiver.counters.total() < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert receiver.counters.as_dict() == {"hello_refused": 1}
    assert "carol (host) claims r0s0, which alice runs" in receiver.counters.recent()[0]
    sent = machines.connector("alice").connect(MESH.rank(R00), {"links": PIPELINE[:1]}, 20.0)
    thread.join(20)
    assert got["links"][0].peer.name == "alice" and sent["links"][0].peer.name == "bob"


def test_a_stranger_without_a_certificate_is_refused_at_the_handshake(machines: Machines) -> None:
    thread, got, receiver = _receive_in_background(machines, MESH.rank(R01))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.minimum_version = False, ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(machines.keys / "ca.crt"))
    sock = dial("127.0.0.1", machines.agents["bob"].port, "r0s1/links", 10)
    with pytest.raises((ssl.SSLError, ConnectionError)), ctx.wrap_socket(sock) as tls:
        tls.recv(1)
    end = time.monotonic() + 10
    while receiver.counters.total() < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert receiver.counters.as_dict() == {"handshake_failed": 1}
    assert "peer did not return a certificate" in receiver.counters.recent()[0]
    machines.connector("alice").connect(MESH.rank(R00), {"links": PIPELINE[:1]}, 20.0)
    thread.join(20)
    assert got["links"][0].peer.name == "alice"


def test_an_oversized_frame_is_refused_unread_and_the_link_stays_in_step(machines: Machines) -> None:
    thread, got, _ = _receive_in_background(machines, MESH.rank(R01))
    sent = machines.connector("alice").connect(MESH.rank(R00), {"links": PIPELINE[:1]}, 20.0)["links"][0]
    thread.join(20)
    store = BoundStore("127.0.0.1", 10)
    health = Health(store_client("127.0.0.1", store.port, 10), MeshShape(1, 2), 1, 0.2, 5.0, "test store")
    bound = 1 << 16
    transport = Transport(R01, MeshShape(1, 2), {(R00, R01): got["links"][0]}, {}, torch.device("cpu"),
                          health, message_s=10.0, max_message_bytes=bound)
    transport.expect(R00, 2, capacity=0)

    def message(n: int, microbatch: int) -> torch.Tensor:
        from meshlearn.compress.codecs import Encoded

        payload = Encoded({"values": torch.arange(n, dtype=torch.float32)}, (n,), torch.float32)
        return pack(Message("act", 0, microbatch, R00, R01, payload), torch.device("cpu"))

    sent.send(message(40 * bound // 4, 1))  # 40 × what this link takes
    sent.send(message(30, 2))
    first, second = transport.next_arrival(10.0), transport.next_arrival(10.0)
    assert isinstance(first, Forged) and "a frame of" in first.reason and first.link == (R00, R01)
    assert isinstance(second, Message) and second.microbatch == 2
    assert torch.equal(second.payload.tensors["values"], torch.arange(30, dtype=torch.float32))
    transport.close()
    sent.close()


def test_the_connector_needs_both_the_port_and_the_key(keys: Path, tiny_corpus: Path) -> None:
    cfg = cluster_config(tiny_corpus, {"alice": 29601, "bob": 29602})
    assert cluster_connector(cfg, {}) is None  # no launcher's port: the plain streams, as before
    with pytest.raises(ConfigError, match=f"^{KEY_ENV} = None: must be set"):
        cluster_connector(cfg, {PORT_SOCKET_ENV: "/x/agent.sock", HOST_ENV: "alice"})
    with pytest.raises(ConfigError, match=f"^{KEY_ENV} = .*bob.key.*is bob \\(host\\)'s credential, but "
                                          "this process runs on host alice$"):
        cluster_connector(cfg, {PORT_SOCKET_ENV: "/x/agent.sock", KEY_ENV: str(keys / "bob.key"),
                                HOST_ENV: "alice"})
    made = cluster_connector(cfg, {PORT_SOCKET_ENV: "/x/agent.sock", KEY_ENV: str(keys / "alice.key"),
                                   HOST_ENV: "alice"})
    assert made.ports == {"alice": ("127.0.0.1", 29601), "bob": ("127.0.0.1", 29602)}
    assert made.hosts_of == HOSTS_OF and made.names == NAMES


def test_a_two_host_run_through_the_ports_gives_the_simulators_losses(machines: Machines, tiny_corpus: Path,
                                                                      tmp_path: Path) -> None:
    """Four worker processes, as each host's launcher would start them (the control service behind
    alice's port), every stream dialed through its receiver's port and authenticated."""
    cfg = cluster_config(tiny_corpus, {h: a.port for h, a in machines.agents.items()}, "train.steps=3")
    save_config(cfg, tmp_path / "run.toml")
    control = control_service(machines.agents, machines.keys, Counters())
    run_dirs = {host: tmp_path / host / "x" for host in HOSTS}
    try:
        procs = start_workers(tmp_path / "run.toml", run_dirs, machines.agents, machines.keys, tmp_path)
        codes = wait_all(procs)
    finally:
        control.close()
    logs = logs_of(tmp_path)
    assert codes == [0, 0, 0, 0], logs
    links = 4 + 4 * 3  # the pipeline's (2 rows × 2 directions) and the collectives' (ordered pairs)
    routed = sum(a.routed for a in machines.agents.values())
    assert routed - control.admitted == links and control.admitted >= 4, logs  # the rest: control
    # what an honest host holds at the control service (a thread per process talks to it: 2 each)
    assert all(0 < control.peak[h] <= control.caps[h] for h in HOSTS), (control.peak, control.caps)
    expected, got = simulator_losses(cfg, tmp_path / "sim"), losses(run_dirs["alice"])
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(expected, got, strict=True)) <= 1e-5


def test_a_moved_slots_links_are_its_new_holders_only(machines: Machines) -> None:
    """Elastic: r0s0's slot is held by carol now (a joiner there; ``locate`` reads the control
    service's published holder). Bob's gate takes r0s0's link from carol, and refuses the
    placement's host alice, whose valid certificate no longer speaks for r0s0."""
    ports = {h: ("127.0.0.1", a.port) for h, a in machines.agents.items()}
    moved = {**machines.hosts_of, "r0s0": "carol"}
    bob = ClusterConnector(RunTls(Credentials.in_folder(machines.keys, "bob")),
                           machines.agents["bob"].socket_path, machines.names, machines.hosts_of, ports,
                           locate=moved.__getitem__)
    thread, got, receiver = _receive_in_background(machines, MESH.rank(R01), bob)
    link = ("r0s0", "r0s1[r0s0->r0s1]")
    for host in ("alice", "carol"):
        owners = {"r0s0": host, "r0s1[r0s0->r0s1]": "bob"}
        sock = dial("127.0.0.1", machines.agents["bob"].port, "r0s1/links", 10)
        tls = RunTls(Credentials.in_folder(machines.keys, host))
        if host == "alice":
            with pytest.raises(Refused, match="refused_by_peer: bob refused the link r0s0->r0s1"):
                dial_link(sock, tls, link, owners, time.monotonic() + 10, 1024)
        else:
            sent = dial_link(sock, tls, link, owners, time.monotonic() + 10, 1024)
    thread.join(20)
    assert "alice (host) claims r0s0, which carol runs" in receiver.counters.recent()[0]
    assert got["links"][0].peer.name == "carol" and sent.peer.name == "bob"


def test_a_newcomers_port_is_read_anew_at_every_connect(monkeypatch, tiny_corpus: Path) -> None:
    """A newcomer that rejoins on another ``--address`` is dialed there: ``reach`` asks the control
    service each time (one store client, made at first use), never a cached port."""
    from meshlearn.cluster import links as cluster_links
    from meshlearn.cluster.slots import address_key

    published = {address_key("dora"): b"10.0.0.9:29500"}
    made: list[tuple] = []

    class Store:
        def get(self, key: str) -> bytes:
            return published[key]

    def client(*args):
        made.append(args)
        return Store()
    monkeypatch.setattr(cluster_links, "store_client", client)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    _, reach = cluster_links.slot_holders(cluster_config(tiny_corpus, {"alice": 1, "bob": 2},
                                                         "backend=dist", "elastic.enabled=true"))
    assert reach("dora") == ("10.0.0.9", 29500)
    published[address_key("dora")] = b"10.0.0.7:29501"
    assert reach("dora") == ("10.0.0.7", 29501)
    assert len(made) == 1
