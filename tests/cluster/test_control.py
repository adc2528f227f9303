"""The control service of a cluster run, behind a real port agent on 127.0.0.1: honest store
operations round-trip (through torch's PrefixStore, as the runtime uses them); a stranger, another
run's host, a joiner and a revoked host never get past the handshake; a host writing another's
records is refused, counted, and keeps its connection; an oversized frame is refused whole; a
host flooding requests on one connection is throttled and counted, and nobody else is."""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from net.net_helpers import wait_until

from meshlearn.cluster.authority import Authority
from meshlearn.cluster.control import CONNECTIONS_PER_PROCESS, RATE_BURST, RATE_PER_S, ControlService
from meshlearn.cluster.control_store import ControlLine, ControlStore
from meshlearn.cluster.control_wire import MAX_FRAME, ControlRefused, receive
from meshlearn.cluster.slots import SlotTable
from meshlearn.net.counters import Counters
from meshlearn.net.frames import PREFIX
from meshlearn.net.keys import Credentials, Identity, add_joiner, create_run, revoke
from meshlearn.net.port import PortAgent, dial
from meshlearn.net.tls import Refused, RunTls

HOSTS_OF = {"r0s0": "alice", "r0s1": "bob", "verifier": "alice"}
RANKS = {"r0s0": 0, "r0s1": 1, "verifier": 2}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    create_run(root / "run", ["alice", "bob", "carol"], "test-run")
    add_joiner(root / "run", "joe")
    add_joiner(root / "run", "eve")
    revoke(root / "run", "carol")
    revoke(root / "run", "eve")
    create_run(root / "other", ["bob"], "another-run")
    return {"run": root / "run", "other": root / "other"}


class Service:
    def __init__(self, keys: dict[str, Path], folder: Path,
                 rate: tuple[float, float] = (RATE_PER_S, RATE_BURST),
                 per_process: int = CONNECTIONS_PER_PROCESS, clock: Callable[[], float] = time.monotonic,
                 authority: Authority | None = None):
        self.keys = keys
        self.counters = Counters()
        self.made: list[ControlStore] = []
        self.agent = PortAgent("127.0.0.1", 0, folder / "agent.sock", self.counters)
        self.agent.start()
        authority = authority or Authority(HOSTS_OF, RANKS, "alice")
        self.service = ControlService(self.tls("alice"), authority, self.counters,
                                      handshake_timeout_s=3.0, rate=rate, per_process=per_process,
                                      clock=clock)
        self.service.serve(self.agent.socket_path)

    def tls(self, name: str, run: str = "run") -> RunTls:
        return RunTls(Credentials.in_folder(self.keys[run], name))

    def store(self, name: str, run: str = "run", timeout_s: float = 5.0,
              connect_timeout_s: float = 10.0) -> ControlStore:
        line = ControlLine(self.tls(name, run), "127.0.0.1", self.agent.port, "alice", connect_timeout_s)
        made = ControlStore(line, timeout_s)
        self.made.append(made)  # a Python Store must outlive the PrefixStore over it
        return made

    def count(self, reason: str) -> int:
        return self.counters.as_dict().get(reason, 0)


@contextlib.contextmanager
def _serving(keys: dict[str, Path], **options) -> Iterator[Service]:
    folder = Path(tempfile.mkdtemp(prefix="ml-ctl-"))
    service = Service(keys, folder, **options)
    try:
        yield service
    finally:
        service.service.close()
        service.agent.close()
        shutil.rmtree(folder)


@pytest.fixture
def control(keys) -> Iterator[Service]:
    with _serving(keys) as service:
        yield service


def _workers(store: dist.Store) -> dist.Store:
    return dist.PrefixStore("meshlearn/0/", store)  # what distributed.health.store_client makes


def test_honest_operations_round_trip(control: Service) -> None:
    alice, bob = _workers(control.store("alice")), _workers(control.store("bob"))
    for store in (alice, bob):
        for key in ("hb/0", "hb/1", "hb/2"):
            store.add(key, 0)  # every process creates every counter
        assert store.compare_set("abort", "", "") == b""
    assert bob.add("hb/1", 1) == 1 and bob.add("hb/1", 1) == 2
    assert alice.multi_get(["hb/0", "hb/1", "abort"]) == [b"0", b"2", b""]
    bob.set("links/1", "10.0.0.2:1234")
    assert alice.get("links/1") == b"10.0.0.2:1234"  # get waits for its key, as TCPStore's
    assert not alice.check(["done/1"])
    bob.set("done/1", "1")
    assert alice.check(["done/1"])
    bob.set("joined/1", "1")
    alice.set("joined/0", "1")
    bob.wait(["joined/0", "joined/1"], timedelta(seconds=2))
    alice.set("verdict/3", b"\x00\xffbytes")
    assert bob.get("verdict/3") == b"\x00\xffbytes"
    assert alice.delete_key("verdict/3") and not alice.check(["verdict/3"])
    bob.set("truth/3/r0s1", "[]")  # an attacker's ground truth, from its own host...
    assert alice.delete_key("truth/3/r0s1")  # ...deleted by the coordinator's records writer once read
    assert bob.compare_set("drain", "", "f:7") == b"f:7"
    assert bob.compare_set("drain", "f:7", "f:7") == b"f:7"  # a claim with nothing new: a read
    assert alice.compare_set("drain", "f:7", "s:9:2") == b"s:9:2"
    assert bob.compare_set("drain", "f:7", "f:8") == b"s:9:2"  # not expected: the current value
    assert alice.num_keys() >= 8
    with pytest.raises(Exception, match="timeout"):  # noqa: PT011 — torch wraps it
        bob.wait(["done/0"], timedelta(seconds=0.2))
    assert control.counters.total() == 0


def test_a_host_may_write_only_its_own_records(control: Service) -> None:
    bob_raw = control.store("bob")
    bob = _workers(bob_raw)
    bob.add("hb/0", 0)  # creating a counter is everyone's
    refusals = [(lambda: bob.add("hb/0", 1)), (lambda: bob.set("done/0", "1")),
                (lambda: bob.set("links/0", "10.6.6.6:1")), (lambda: bob.set("verdict/1", "{}")),
                (lambda: bob.set("cluster/checkpoint/4/agreed", "{}")),
                (lambda: bob.set("cluster/checkpoint/4/host/alice", "x")),
                (lambda: bob.set("cluster/checkpoint/4/shard/r0s0", "{}")),
                (lambda: bob_raw.set("meshlearn-cluster/config", "{}")),
                (lambda: bob_raw.set("meshlearn-cluster/done/alice", "1")),
                (lambda: bob.set("hb/1", "99")),  # own key, but a heartbeat only counts up
                (lambda: bob.add("hb/99", 0)),  # a heartbeat of a rank the run does not have
                (lambda: bob.set("truth/2/r0s0", "[]")),  # another host's worker's ground truth
                (lambda: bob.delete_key("truth/2/r0s1")),  # only the coordinator deletes it
                (lambda: bob_raw.set("abort", "x")),  # no such key of a run (outside its namespace)
                (lambda: bob.get("anything/else"))]
    for refused in refusals:
        with pytest.raises(Exception, match="authority"):  # noqa: PT011 — torch wraps it
            refused()
    assert control.count("authority") == len(refusals)
    # the connection stays up for bob's honest requests, and nothing of the refused was stored
    bob.set("done/1", "1")
    bob.set("cluster/checkpoint/4/host/bob", "ab")
    alice = _workers(control.store("alice"))
    assert not alice.check(["done/0"]) and alice.get("hb/0") == b"0"


@pytest.mark.parametrize("forged", [
    "worker r0s0 failed: RuntimeError: the insider says so",  # r0s0's own failure, in bob's mouth
    "worker r0s1 stopped answering (rank 1; noticed by r0s0)",  # what alice's r0s0 observed
    "the verifier failed: ValueError: bad state",  # alice runs the verifier
    "lost the connection to worker r0s1 (reset; noticed by the verifier)",
])
def test_an_abort_that_speaks_for_another_hosts_process_is_refused(control: Service, forged: str) -> None:
    bob = _workers(control.store("bob"))
    with pytest.raises(Exception, match="authority.*host bob may not report for"):  # noqa: PT011
        bob.compare_set("abort", "", forged)
    with pytest.raises(Exception, match="authority: host bob may not set"):  # noqa: PT011
        bob.set("abort", forged)  # nor by a plain write (an abort is compare_set only)
    assert control.counters.by_sender() == {"bob": 2}
    assert _workers(control.store("alice")).compare_set("abort", "", "") == b""  # nothing was stored


def test_a_drain_value_every_process_would_misparse_or_misplace_is_refused(control: Service) -> None:
    """Any host may claim a step or stop the run on the graceful stop's key, and every process
    parses it at every step's end (``train/signals.py``): a value of another form (which crashed
    them all), a claim moved back, a stop before a claimed step, or a stop moved, is refused."""
    bob, alice = _workers(control.store("bob")), _workers(control.store("alice"))
    refused = [lambda: bob.compare_set("drain", "", "f:x"), lambda: bob.compare_set("drain", "", "s:3"),
               lambda: bob.compare_set("drain", "", "f:\u0663")]  # a digit int() reads, not ASCII
    for write in refused:
        with pytest.raises(Exception, match="authority.*'f:<step>' or 's:<step>:<signal>'"):  # noqa: PT011
            write()
    assert alice.compare_set("drain", "", "f:5") == b"f:5"
    for write, why in [(lambda: bob.compare_set("drain", "f:5", "f:4"), "may not go back"),
                       (lambda: bob.compare_set("drain", "f:5", "s:0:2"), "may not go back")]:
        with pytest.raises(Exception, match=f"authority.*{why}"):  # noqa: PT011
            write()
    assert bob.compare_set("drain", "f:5", "s:6:15") == b"s:6:15"
    with pytest.raises(Exception, match="authority.*which is final"):  # noqa: PT011
        alice.compare_set("drain", "s:6:15", "f:9")
    assert control.counters.by_sender() == {"bob": 5, "alice": 1}
    assert alice.get("drain") == b"s:6:15"


def test_the_coordinator_deletes_ground_truth_wherever_the_verifier_runs() -> None:
    """The records writer (rank 0, on the coordinator) reads an attacker's ground truth and deletes
    it; with the verifier on another host that deletion was refused and the run stopped."""
    authority = Authority(HOSTS_OF | {"verifier": "bob"}, RANKS, "alice")
    key = "meshlearn/0//truth/3/r0s1"
    assert authority.refusal("bob", "set", key) is None
    assert authority.refusal("alice", "delete_key", key) is None
    assert authority.refusal("bob", "delete_key", key) == f"host bob may not delete_key {key!r}"
    assert authority.refusal("alice", "set", key) == f"host alice may not set {key!r}"


def test_an_abort_is_stored_as_its_writers_report(control: Service) -> None:
    bob = _workers(control.store("bob"))
    won = bob.compare_set("abort", "", "worker r0s0 stopped answering (rank 0; noticed by r0s1)")
    assert won == b"reported by host bob: worker r0s0 stopped answering (rank 0; noticed by r0s1)"
    assert _workers(control.store("alice")).get("abort") == won
    assert control.counters.total() == 0


def _handshake(control: Service, tls: RunTls) -> ssl.SSLSocket:
    sock = dial("127.0.0.1", control.agent.port, "control", 5.0)
    return tls.connect(sock, expect="alice", deadline=time.monotonic() + 5.0)[0]


def test_strangers_never_get_past_the_handshake(control: Service) -> None:
    with pytest.raises(Refused):
        _handshake(control, control.tls("bob", "other"))  # another run's CA
    with pytest.raises(Refused):
        _handshake(control, control.tls("carol"))  # revoked
    with pytest.raises(Refused):
        _handshake(control, control.tls("joe"))  # the run's joiner: not a host of the placement
    sock = dial("127.0.0.1", control.agent.port, "control", 5.0)
    sock.sendall(b"\x00\xce\xf7\x85<" + bytes(200))  # what a TCPStore client says first
    sock.settimeout(10)
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(4096):  # whatever the server answers (an alert), it closes
            pass
    sock.close()
    assert wait_until(lambda: control.count("handshake_failed") + control.count("certificate_refused") >= 3)
    assert wait_until(lambda: control.count("identity_refused") == 1)
    # an honest host is still served
    assert _workers(control.store("bob")).add("hb/1", 1) == 1


def test_an_oversized_frame_is_refused_and_the_link_stays_in_step(control: Service) -> None:
    store = control.store("bob")
    store.add("meshlearn/0//hb/1", 0)  # the per-thread connection is up
    link = store.line._link()
    body = MAX_FRAME + 1
    link.sock.sendall(PREFIX.pack(16, body) + b"{\"lengths\": [] }" + bytes(body))
    header, values = receive(link)
    assert header["error"] == "oversized_frame" and control.count("oversized_frame") == 1
    assert store.add("meshlearn/0//hb/1", 1) == 1  # the same connection, still in step
    with pytest.raises(ControlRefused, match="malformed_request"):
        store.line.call({"op": 7, "keys": "x"}, [], 1.0)



FLOOD, PER_S, BURST = 20, 50.0, 5


def test_a_host_flooding_the_service_is_throttled_counted_and_nobody_else_is(keys) -> None:
    """bob's connection asks FLOOD times in a row: the first BURST pass at once, the rest wait their
    turn at PER_S (counted under bob's name, each still answered); alice, asking on her own
    connection meanwhile, is never held."""
    with _serving(keys, rate=(PER_S, BURST)) as control:
        bob = _workers(control.store("bob"))
        bob.add("hb/1", 0)
        flood = threading.Thread(target=lambda: [bob.add("hb/1", 1) for _ in range(FLOOD)])
        flood.start()
        alice = _workers(control.store("alice"))
        for _ in range(BURST - 1):
            alice.add("hb/0", 1)
        flood.join(30)
        assert not flood.is_alive() and alice.get("hb/1") == str(FLOOD).encode()  # every request served
        throttled = control.count("rate_limited")
        assert 1 <= throttled <= FLOOD + 1 - BURST, throttled
        assert control.counters.by_sender() == {"bob": throttled}  # alice was never held
        assert "more than 50 requests/s over its connections" in control.counters.recent()[-1]


CONNECTIONS, EACH = 4, 5


def test_a_hosts_connections_share_one_rate(keys) -> None:
    """bob asks EACH requests on each of CONNECTIONS connections, the clock frozen (no refill):
    together they get one burst of BURST, and every request beyond it is throttled, whichever
    connection asks it; a rate per connection gave each its own burst, CONNECTIONS times the rate.
    alice's bucket is her own."""
    with _serving(keys, rate=(1000.0, BURST), clock=lambda: 0.0) as control:
        bobs = [_workers(control.store("bob")) for _ in range(CONNECTIONS)]
        threads = [threading.Thread(target=lambda s=s: [s.add("hb/1", 1) for _ in range(EACH)]) for s in bobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert _workers(control.store("bob")).get("hb/1") == str(CONNECTIONS * EACH).encode()
        assert control.service.admitted == CONNECTIONS + 1  # a connection each, and the get's
        throttled = CONNECTIONS * EACH - BURST + 1  # and the get above (each counted once answered)
        assert wait_until(lambda: control.count("rate_limited") == throttled), control.count("rate_limited")
        for _ in range(BURST):
            _workers(control.store("alice")).add("hb/0", 1)
        assert control.counters.by_sender() == {"bob": throttled}


def test_a_host_revoked_while_connected_is_cut_off_without_a_restart(tmp_path) -> None:
    """The owner revokes bob and the coordinator's ca.crl is replaced while bob is connected: the
    running service applies the list (no restart), closes bob's connection and refuses his next
    handshake; alice goes on. A list the CA did not sign is refused and changes nothing."""
    create_run(tmp_path / "run", ["alice", "bob"], "revoke-test")
    create_run(tmp_path / "other", ["alice"], "another-run")
    with _serving({"run": tmp_path / "run"}) as control:
        lines = []
        watch = control.service.watch_revocations(every_s=3600.0)  # looked at by hand below
        watch.log = lines.append
        bob = _workers(control.store("bob", connect_timeout_s=1.0))
        alice = _workers(control.store("alice"))
        bob.add("hb/1", 0)
        alice.add("hb/0", 0)
        shutil.copy(tmp_path / "other" / "ca.crl", tmp_path / "run" / "ca.crl")  # another CA's list
        assert not watch.check() and "not signed by the run's CA" in lines[-1]
        assert bob.add("hb/1", 1) == 1  # nothing changed
        revoke(tmp_path / "run", "bob")  # rewrites the run's ca.crl, beside the coordinator's key
        assert watch.check() and "1 serial(s) revoked" in lines[-1]
        assert control.count("revoked") == 1 and control.counters.by_sender() == {"bob": 1}
        with pytest.raises(Exception, match="the peer closed the link control->alice"):  # noqa: PT011
            bob.add("hb/1", 1)  # its connection is gone (torch wraps the error)...
        with pytest.raises(Exception, match="refused_by_peer: alice refused us: .*certificate revoked"):  # noqa: PT011
            bob.add("hb/1", 1)  # ...and every new one is refused in the handshake
        assert wait_until(lambda: control.count("certificate_refused") >= 1)
        assert alice.add("hb/0", 1) == 1 and alice.get("hb/1") == b"1"


def test_a_handshake_that_ends_after_its_revocation_is_refused(tmp_path) -> None:
    """bob's handshake completes under the old list; before its connection is registered the owner
    revokes bob and the watch applies the list (a hook between the two, not timing). The cut-off
    found no connection of bob's to close; the connection must still not be served."""
    create_run(tmp_path / "run", ["alice", "bob"], "revoke-race")
    with _serving({"run": tmp_path / "run"}) as control:
        watch = control.service.watch_revocations(every_s=3600.0)  # applied by the hook below
        handshake = control.service.acceptor.authenticate

        def revoked_meanwhile(sock, deadline):
            ready = handshake(sock, deadline)
            if ready.peer.name == "bob":
                revoke(tmp_path / "run", "bob")
                assert watch.check() and control.count("revoked") == 0  # nothing of bob's to close yet
            return ready

        control.service.acceptor.authenticate = revoked_meanwhile
        with pytest.raises(Exception, match="revoked|closed"):  # noqa: PT011 — torch wraps it
            _workers(control.store("bob", connect_timeout_s=1.0)).add("hb/1", 0)
        assert control.count("revoked") == 1 and control.service.held("bob") == 0
        assert "revoked during its handshake" in "\n".join(control.counters.recent())
        assert _workers(control.store("alice")).add("hb/0", 1) == 1


def test_a_host_holds_at_most_its_share_of_connections(keys) -> None:
    """Each connection is a thread of the service, so connections are capped per host, by the
    processes it runs: bob runs one (and a launcher), one connection each, so his third is refused in
    the handshake (counted under bob, its one line the refusal's), alice still connects, and bob
    may connect again once one of his has closed."""
    with _serving(keys, per_process=1) as control:
        assert control.service.caps == {"alice": 3, "bob": 2}
        bobs = [control.store("bob", connect_timeout_s=1.0) for _ in range(3)]
        for store in bobs[:2]:
            store.add("meshlearn/0//hb/1", 0)
        with pytest.raises(Refused, match="refused_by_peer"):
            bobs[2].add("meshlearn/0//hb/1", 0)
        assert control.count("too_many_connections") >= 1  # each of its tries (a refusal is tried again)
        assert control.counters.by_sender() == {"bob": control.count("too_many_connections")}
        assert _workers(control.store("alice")).add("hb/0", 1) == 1
        bobs[0].line._link().close()
        assert wait_until(lambda: control.service.admitted == 3 and control.service.held("bob") == 1)
        assert bobs[2].add("meshlearn/0//hb/1", 1) == 1


def test_handshakes_in_flight_count_against_a_hosts_share(keys) -> None:
    """bob's connections are admitted but not yet registered (the service holds them back: a hook,
    not timing), as when many of his handshakes end at once: they hold his slots already, so his
    third handshake is refused (before, held connections alone were counted: up to the acceptor's
    32 half-open ones more got in). One closed before it was served (evicted, say) frees its slot."""
    with _serving(keys, per_process=1) as control:
        service, held_back = control.service, []
        service.acceptor.on_ready = held_back.append
        clients = [_handshake(control, control.tls("bob")) for _ in range(2)]
        assert wait_until(lambda: len(held_back) == 2) and service.held("bob") == 0
        with pytest.raises(Refused, match="refused_by_peer"):
            _handshake(control, control.tls("bob"))
        assert wait_until(lambda: control.count("too_many_connections") == 1)
        assert "0 connections already and 2 on their way (at most 2)" in control.counters.recent()[-1]
        held_back.pop().close()  # evicted before it was served
        clients.append(_handshake(control, control.tls("bob")))
        assert wait_until(lambda: len(held_back) == 2)
        for admitted in held_back:
            service._start(admitted)
        assert service.held("bob") == 2 and control.count("too_many_connections") == 1
        for client in clients:
            client.close()


@pytest.mark.parametrize(("header", "why"), [
    ('{"op": "get", "keys": ["meshlearn/0//done/9"], "timeout_s": NaN, "lengths": []}', "holding NaN"),
    ('{"op": "add", "keys": ["meshlearn/0//hb/1"], "amount": Infinity, "lengths": []}', "holding Infinity"),
    ('{"op": "add", "keys": ["meshlearn/0//hb/1"], "amount": 1e300, "lengths": []}', "'amount' must be"),
    ('{"op": "add", "keys": ["meshlearn/0//hb/1"], "amount": 99999999999999999999, "lengths": []}',
     "'amount' must be"),
    ('{"op": "get", "keys": ["meshlearn/0//done/9"], "timeout_s": "forever", "lengths": []}',
     "'timeout_s' must be"),
    ("[" * 30_000 + "]" * 30_000, "nested too deep"),
])
def test_numbers_that_would_spin_or_crash_the_service_are_refused(control: Service, header: str,
                                                                   why: str) -> None:
    """A NaN wait never ends (it spun a core per request); an infinite amount, a nesting deep
    enough to exhaust the stack: each killed the connection's thread with a traceback."""
    store = control.store("bob")
    store.add("meshlearn/0//hb/1", 0)
    link = store.line._link()
    raw = header.encode()
    link.sock.sendall(PREFIX.pack(len(raw), 0) + raw)
    answer, _ = receive(link)
    assert answer["error"] == "malformed_request" and why in answer["why"], answer
    assert store.add("meshlearn/0//hb/1", 1) == 1  # the same connection, still served


ELASTIC_HOSTS_OF = {"r0s0": "alice", "r0s1": "bob", "r1s0": "bob", "r1s1": "alice"}
ELASTIC_RANKS = {"r0s0": 0, "r0s1": 1, "r1s0": 2, "r1s1": 3}


@pytest.fixture
def elastic(keys) -> Iterator[Service]:
    authority = Authority(ELASTIC_HOSTS_OF, ELASTIC_RANKS, "alice", elastic=True, stages=2,
                          hosts=["alice", "bob", "carol"])
    with _serving(keys, authority=authority) as service:
        yield service


def test_a_slots_records_are_its_holders_only(elastic: Service) -> None:
    """Slot authority (issue 27 item 3): bob holds r1s0 and may write its records; alice may not,
    nor write a stage's tallies where she holds no slot of that stage... she holds r0s0, so she
    may; nobody writes the published holder."""
    alice, bob = _workers(elastic.store("alice")), _workers(elastic.store("bob"))
    assert alice.get("elastic/holder/r1s0") == b"bob.0"  # published from the placement
    bob.set("progress/r1s0", "3")
    bob.add("elastic/q/s0/hb/r1s0.0", 1)
    bob.set("elastic//rows/3/links/r1s0", "[]")
    alice.add("elastic/q/s0/hb/r1s0.0", 0)  # a stage member creates the others' beats
    alice.add("elastic//commit/3/s0/yes", 1)  # her r0s0 is in stage 0
    refused = [lambda: alice.set("progress/r1s0", "9"), lambda: alice.add("elastic/q/s0/hb/r1s0.0", 1),
               lambda: alice.set("elastic//rows/3/links/r1s0", "[]"),
               lambda: alice.set("elastic/events/r1s0/0/0", "{}"), lambda: alice.add("hb/2", 1),
               lambda: bob.set("elastic/holder/r1s0", "bob.7"), lambda: bob.set("records/3", "r1s0"),
               lambda: bob.set("elastic/free/r0s0/0", "3")]
    for write in refused:
        with pytest.raises(Exception, match="authority"):  # noqa: PT011 — torch wraps it
            write()
    assert elastic.count("authority") == len(refused)
    assert bob.compare_set("records/3", "", "r0s1") == b"r0s1"  # bob holds a last-stage slot


def test_a_claim_is_a_compare_and_set_naming_the_claimant(elastic: Service) -> None:
    """A slot moves only by a claim: once its holder's generation has left, naming the claimant's
    own identity; the first claim wins and the slot's records become the claimant's."""
    alice, bob = _workers(elastic.store("alice")), _workers(elastic.store("bob"))
    with pytest.raises(Exception, match="held by bob .generation 0 has not left"):  # noqa: PT011
        alice.compare_set("elastic/taken/r1s0/0", "", "alice:42")
    bob.set("elastic/ended/r1s0/0", "killed by SIGKILL")
    bob.set("elastic/free/r1s0/0", "5")  # its holder's launcher saw it end
    with pytest.raises(Exception, match="may claim r1s0 only for itself, not for bob"):  # noqa: PT011
        alice.compare_set("elastic/taken/r1s0/0", "", "bob:42")
    with pytest.raises(Exception, match="must name its claimant as HOST:PID"):  # noqa: PT011
        alice.compare_set("elastic/taken/r1s0/0", "", "42")
    assert alice.compare_set("elastic/taken/r1s0/0", "", "alice:42") == b"alice:42"
    assert bob.get("elastic/holder/r1s0") == b"alice.1"
    with pytest.raises(Exception, match="r1s0 is at generation 1, not 0"):  # noqa: PT011
        bob.compare_set("elastic/taken/r1s0/0", "alice:42", "bob:7")  # the same generation again
    alice.set("progress/r1s0", "6")
    alice.add("elastic/q/s0/hb/r1s0.1", 1)
    for write in (lambda: bob.set("progress/r1s0", "7"), lambda: alice.add("elastic/q/s0/hb/r1s0.0", 1),
                  lambda: bob.add("hb/2", 1), lambda: bob.set("elastic/free/r1s0/1", "6")):
        with pytest.raises(Exception, match="authority"):  # noqa: PT011
            write()
    alice.add("hb/2", 1)  # the rank's heartbeat is the holder's too
    alice.set("elastic/free/r1s0/1", "6")  # the coordinator may free any slot (a machine that is gone)
    assert bob.compare_set("elastic/taken/r1s0/1", "", "bob:9") == b"bob:9"
    assert alice.get("elastic/holder/r1s0") == b"bob.2"


def test_decisions_stand_once_written_and_tallies_count_each_holder_once(elastic: Service) -> None:
    """A step's decision, a record's claimant and a slot's claim are fixed by the first write (a
    compare-and-set from empty): another slot holder cannot swap them afterwards and split the
    stages on whether a step committed. A stage tally moves by 0 or 1 (never reset, never by 5);
    nobody creates counters of a slot the run does not have, nor another stage's quorum beats."""
    alice, bob = _workers(elastic.store("alice")), _workers(elastic.store("bob"))
    assert alice.compare_set("elastic//pvote/7/decision", "", "00") == b"00"
    assert bob.compare_set("elastic//pvote/7/decision", "", "11") == b"00"  # the first write stands
    assert bob.compare_set("records/4", "", "r1s1") == b"r1s1"
    bob.add("elastic//commit/7/s0/yes", 1)
    bob.set("elastic//commit/7/s0/n", "2")
    refused = [lambda: bob.compare_set("elastic//pvote/7/decision", "00", "11"),
               lambda: bob.compare_set("elastic//commit/7/decision", "x", "11"),
               lambda: alice.compare_set("records/4", "r1s1", "r0s1"),
               lambda: bob.add("elastic//commit/7/s0/yes", 5),
               lambda: bob.set("elastic//commit/7/s0/yes", "0"),
               lambda: bob.add("elastic/events/r9s9/0/count", 0),
               lambda: bob.add("elastic/q/s1/hb/r0s0.0", 0)]
    for write in refused:
        with pytest.raises(Exception, match="authority"):  # noqa: PT011 — torch wraps it
            write()
    assert elastic.count("authority") == len(refused)
    assert alice.get("elastic//pvote/7/decision") == b"00"


def test_an_agreement_is_written_once_and_a_shard_entry_is_its_writers_own(elastic: Service) -> None:
    """The agreement is a last-stage holder's compare-and-set from empty: another one cannot swap it;
    a shard entry names its writer's host, a size and a SHA-256, nothing else."""
    alice, bob = _workers(elastic.store("alice")), _workers(elastic.store("bob"))
    entry = {"host": "bob", "size": 10, "sha256": "ab" * 32}
    bob.set("cluster/checkpoint/4/shard/r1s0", json.dumps(entry))
    assert bob.compare_set("cluster/checkpoint/4/agreed", "", "{}") == b"{}"  # r0s1: stage 1
    assert alice.compare_set("cluster/checkpoint/4/agreed", "", "[]") == b"{}"  # the first write stands
    refused = [lambda: alice.compare_set("cluster/checkpoint/4/agreed", "{}", "[]"),
               lambda: alice.set("cluster/checkpoint/5/agreed", "{}"),
               *(lambda forged=forged: bob.set("cluster/checkpoint/4/shard/r1s0", forged) for forged in (
                   json.dumps(entry | {"host": "alice"}), json.dumps(entry | {"size": -1}),
                   json.dumps(entry | {"size": True}), json.dumps(entry | {"sha256": "AB" * 32}),
                   json.dumps(entry | {"sha256": "ab" * 31}), json.dumps(entry | {"pad": "x" * 600}),
                   json.dumps(entry | {"extra": 1}), "null", "[" * 400 + "]" * 400, ""))]
    for write in refused:
        with pytest.raises(Exception, match="authority"):  # noqa: PT011 — torch wraps it
            write()
    assert elastic.count("authority") == len(refused)
    assert json.loads(alice.get("cluster/checkpoint/4/shard/r1s0")) == entry
    assert alice.get("cluster/checkpoint/4/agreed") == b"{}"


def test_a_newcomer_claims_one_free_slot_with_its_port_and_writes_only_its_records(elastic: Service) -> None:
    """A newcomer (a joiner's certificate, no host of the placement) is admitted to an elastic run:
    it writes nothing before it holds a slot; its claim must carry its inbound port, which the
    service publishes for the members that connect to it; then it writes that slot's records and
    no other slot's, and may not claim a second slot. A host may not attach an address."""
    joe, bob = _workers(elastic.store("joe")), _workers(elastic.store("bob"))
    assert joe.get("elastic/holder/r1s0") == b"bob.0"  # it reads the run's view like a host
    with pytest.raises(Exception, match="authority"):  # noqa: PT011 — torch wraps it
        joe.set("progress/r1s0", "1")  # not its slot (yet)
    bob.set("elastic/free/r1s0/0", "5")
    bob.set("elastic/free/r0s1/0", "5")
    with pytest.raises(Exception, match="must attach its inbound port"):  # noqa: PT011
        joe.compare_set("elastic/taken/r1s0/0", "", "joe:42")
    with pytest.raises(Exception, match="claims with its placement's address"):  # noqa: PT011
        bob.compare_set("elastic/taken/r1s0/0", "", "bob:42@10.0.0.9:29500")
    with pytest.raises(Exception, match="may claim r1s0 only for itself, not for bob"):  # noqa: PT011
        joe.compare_set("elastic/taken/r1s0/0", "", "bob:42@10.0.0.9:29500")
    assert joe.compare_set("elastic/taken/r1s0/0", "", "joe:42@10.0.0.9:29500") == b"joe:42@10.0.0.9:29500"
    assert bob.get("elastic/holder/r1s0") == b"joe.1"
    assert bob.get("elastic/address/joe") == b"10.0.0.9:29500"
    joe.set("progress/r1s0", "6")
    joe.add("hb/2", 1)  # r1s0's rank
    joe.add("elastic/q/s0/hb/r1s0.1", 1)
    refused = [lambda: joe.set("progress/r0s1", "6"), lambda: joe.add("hb/1", 1),
               lambda: joe.set("elastic/events/r0s1/0/0", "{}"),
               lambda: joe.set("elastic/address/joe", "1.2.3.4:1"),
               lambda: bob.set("elastic/address/joe", "1.2.3.4:1"),
               lambda: joe.set("elastic/free/r0s1/0", "5"),
               lambda: bob.set("progress/r1s0", "7")]
    for write in refused:
        with pytest.raises(Exception, match="authority"):  # noqa: PT011
            write()
    with pytest.raises(Exception, match="newcomer joe holds r1s0 already"):  # noqa: PT011
        joe.compare_set("elastic/taken/r0s1/0", "", "joe:43@10.0.0.9:29500")
    assert bob.compare_set("elastic/taken/r0s1/0", "", "bob:9") == b"bob:9"  # the slot stays free for others


def test_a_revoked_or_unelastic_newcomer_is_refused_in_the_handshake(keys) -> None:
    """A revoked joiner never finishes its handshake with an elastic run's service, and the
    coordinator's log says so once; a valid one is refused by a run that is not elastic, with one
    line in the coordinator's log."""
    authority = Authority(ELASTIC_HOSTS_OF, ELASTIC_RANKS, "alice", elastic=True, stages=2)
    said: list[str] = []
    with _serving(keys, authority=authority) as service:
        service.service.log = said.append
        for _ in range(2):
            with pytest.raises(Refused):
                _handshake(service, service.tls("eve"))
        assert wait_until(lambda: service.count("certificate_refused") == 2)
    assert said == ["meshlearn control: refused a handshake: certificate revoked"]  # once, not per try
    lines: list[str] = []
    with _serving(keys) as service:
        service.service.log = lines.append
        with pytest.raises(Refused, match="closed without admitting us"):
            _handshake(service, service.tls("joe"))
        assert wait_until(lambda: service.count("identity_refused") == 1)
    assert lines == ["meshlearn control: refused newcomer joe: joe (joiner) is no host of this run's "
                     "placement, and only an elastic run admits newcomers"]


def test_a_newcomer_may_not_hold_a_trusted_end() -> None:
    """Where verify.trusted_ends assumes the first and last stages honest, only a host marked trusted
    runs them (the compat row): a newcomer is refused those slots, not a middle one."""
    placed = {f"r{r}s{s}": "alice" for r in range(2) for s in range(3)}
    authority = Authority(placed, {w: i for i, w in enumerate(placed)}, "alice", elastic=True, stages=3,
                          trusted_ends=True)
    assert authority.admission_refusal(Identity("joe", "joiner")) is None

    def free(key: list[str]) -> bool:
        return True  # every generation 0 has left

    claim = b"joe:1@10.0.0.9:1"
    for slot in ("r0s0", "r1s2"):
        why = authority.claim_refusal("joe", f"meshlearn/0//elastic/taken/{slot}/0", claim, free)
        assert why is not None and "verify.trusted_ends assumes stage" in why
    assert authority.claim_refusal("joe", "meshlearn/0//elastic/taken/r1s1/0", claim, free) is None
    assert authority.claim_refusal("alice", "meshlearn/0//elastic/taken/r0s0/0", b"alice:1", free) is None
    assert Authority(placed, {}, "alice").admission_refusal(Identity("joe", "joiner")) is not None


def test_a_newcomer_whose_slot_was_freed_may_claim_another() -> None:
    """A newcomer holds one slot; once its generation of that slot has left (freed: its process
    ended, or the coordinator freed a lost machine's), it may claim another, as a restarted one does."""
    table = SlotTable({"r0s0": "alice", "r0s1": "bob", "r1s0": "bob", "r1s1": "alice"}, "alice")
    table.admit("joe")
    freed: set[str] = {"meshlearn/0//elastic/free/r1s0/0", "meshlearn/0//elastic/free/r0s1/0"}

    def has(keys: list[str]) -> bool:
        return all(key in freed for key in keys)

    assert table.claim_refusal("joe", "r1s0", 0, b"joe:1@10.0.0.9:1", has) is None
    table.take("joe", "r1s0", 0, b"joe:1@10.0.0.9:1")
    why = table.claim_refusal("joe", "r0s1", 0, b"joe:2@10.0.0.9:1", has)
    assert why == "newcomer joe holds r1s0 already: a newcomer holds one slot"
    freed.add("meshlearn/0//elastic/free/r1s0/1")  # joe's process ended: its launcher freed r1s0
    assert table.claim_refusal("joe", "r0s1", 0, b"joe:2@10.0.0.9:1", has) is None
