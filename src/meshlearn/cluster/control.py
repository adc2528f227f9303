"""The control service of a cluster run: the run's rendezvous and control state, held by the
coordinator's launcher, reached only through its machine's port (destination ``control``).

It replaces the unauthenticated TCPStore of a cluster run. A connection is handed over by the
``PortAgent``, authenticated by mutual TLS with the run's CA (``tls.Acceptor``: a handshake
deadline, a cap on half-open connections; a peer that is not a host of the placement is refused
there), and only then read: request frames bounded before allocation (``control_wire``), each
checked against the owner rules (``authority.py``) before it touches the state. It implements
exactly the store operations meshlearn uses, with the TCPStore's meaning (``get`` and
``multi_get`` wait for their keys, ``compare_set`` creates a missing key when ``expected`` is
empty, ``add`` counts from 0). A refused request is answered with the reason, counted in the
run's ``Counters`` and logged with the sender's identity; the connection stays up for the
sender's honest requests. One thread per authenticated connection: a waiting ``get`` blocks only
its own connection.

Each host may make ``rate[0]`` requests a second after a burst of ``rate[1]``, all its
connections together (``net/rate.TokenBucket``, one per host, shared by its connections' threads):
a request beyond that is counted (``rate_limited``, under the sender's identity), and the
connection's next request is read only once the host's rate allows it, so a participant flooding
the service slows itself down and nobody else (its flood waits in its own connections' threads and
buffers), however many connections it opens. A host may hold ``per_process`` connections for each
process it runs, and its launcher, at once (a further handshake is refused, ``too_many_connections``):
each connection costs the service a thread, so this bounds what a host can make it hold. The
defaults are far above what an honest process asks: a heartbeat round every ``dist.heartbeat_s``
per process, a few requests per step, a connection per thread that talks to the service (``peak``
records the most each host held; ``CONNECTIONS_PER_PROCESS`` says what a run measured).

Revocation needs no restart: ``watch_revocations`` applies a new ``ca.crl`` beside the
coordinator's key (``net/revocations.py``), so the revoked host's next handshake is refused and
the connections it holds are closed at once (counted as ``revoked``, under its name). The list in
force is published under ``authority.REVOCATIONS`` (its exact signed bytes, which only the
coordinator may write), from the start and after each list applied, so every other host can apply
it too (``control_store.follow_revocations``): revoked at the coordinator, revoked on every machine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from meshlearn.cluster.authority import REVOCATIONS, Authority
from meshlearn.cluster.control_wire import receive, send, stream
from meshlearn.net.counters import Counters
from meshlearn.net.frames import FramedStream, FrameRefused
from meshlearn.net.keys import Identity
from meshlearn.net.port import Inbox
from meshlearn.net.rate import TokenBucket
from meshlearn.net.revocations import RevocationWatch
from meshlearn.net.tls import Acceptor, Refused, RunTls

DESTINATION = "control"
MAX_WAIT_S = 3600.0  # the longest wait one request may ask for
MAX_AMOUNT = 1 << 62  # an add's amount: a heartbeat counts steps, far below; a bigger one overflows
RATE_PER_S = 1000.0  # requests per second one host may make (all its connections), sustained
RATE_BURST = 1000  # requests one host may make at once
CONNECTIONS_PER_PROCESS = 8
"""Connections a host may hold per process it runs (its launcher counts as one). An honest process
holds one per thread that talks to the service: in a P = 2 × D = 2 run of real processes
(tests/cluster/test_cluster_links.py) each host held at most 4 with its 2 worker processes (the
main thread's and the health monitor's), and a launcher holds one (its main thread's). 8 per
process (24 for such a host, against 256 before) leaves room for a process that uses more threads
and for a reconnect racing the old connection's close."""


class ControlState:
    """The keys and values, and the waits on them (the TCPStore's semantics)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0") or 0) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected
            elif current != expected:
                return current
            self._data[key] = desired
            self._changed.notify_all()
            return desired

    def delete(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def count(self) -> int:
        with self._changed:
            return len(self._data)

    def wait(self, keys: list[str], timeout_s: float) -> list[bytes] | None:
        """The values of ``keys`` once all exist, or None after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._changed:
            while not all(k in self._data for k in keys):
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return [self._data[k] for k in keys]


class ControlService:
    """Serves ``state`` to the run's hosts as ``authority`` allows. ``log`` receives one line per
    refusal (the launcher's log); ``counters`` the counts (the run's security record);
    ``rate``: requests per second and burst per host; ``per_process``: connections a host may
    hold per process it runs (and one for its launcher); ``clock``: the buckets' (tests freeze it)."""

    def __init__(self, tls: RunTls, authority: Authority, counters: Counters,
                 log: Callable[[str], None] = lambda line: None, handshake_timeout_s: float | None = None,
                 rate: tuple[float, float] = (RATE_PER_S, RATE_BURST),
                 per_process: int = CONNECTIONS_PER_PROCESS, clock: Callable[[], float] = time.monotonic):
        self.tls, self.authority, self.counters, self.log = tls, authority, counters, log
        self.rate, self.per_process, self.clock = rate, per_process, clock
        processes = Counter(authority.hosts_of.values())
        self.caps = {host: per_process * (processes[host] + 1) for host in authority.hosts}
        self._buckets = {host: TokenBucket(*rate, clock=clock) for host in authority.hosts}
        self.peak: Counter[str] = Counter()  # the most connections each host held at once
        self.state = ControlState()
        self.state.set(REVOCATIONS, tls.revocations.data)  # what every other host applies
        for key, holder in (authority.slots.published().items() if authority.slots else ()):
            self.state.set(key, holder.encode())  # an elastic run's slots, as the placement starts them
        timing = {} if handshake_timeout_s is None else {"timeout_s": handshake_timeout_s}
        self.acceptor = Acceptor(self._authenticate, counters, on_ready=self._start, **timing)
        self._inbox: Inbox | None = None
        self._watch: RevocationWatch | None = None
        self.admitted = 0  # authenticated connections served
        self._said: set[str] = set()  # certificate refusals already in the log
        self._links: dict[FramedStream, tuple[Identity, int]] = {}  # each with its peer's certificate serial
        self._revoked: set[int] = set()  # serials cut off while the service ran
        self._pending: Counter[str] = Counter()  # admitted connections not yet registered, by host
        self._lock = threading.Lock()
        self._claims = threading.Lock()

    def serve(self, port_socket: Path) -> None:
        """Register as ``control`` at this machine's port agent and serve in daemon threads."""
        self._inbox = Inbox(port_socket, DESTINATION)
        self._inbox.serve_into(self.acceptor.submit)

    def watch_revocations(self, every_s: float | None = None) -> RevocationWatch:
        """Apply a new revocation list beside this service's key while it serves (no restart)."""
        timing = {} if every_s is None else {"every_s": every_s}
        self._watch = RevocationWatch(self.tls, self._revoked_now, self.log, counters=self.counters, **timing)
        self._watch.start()
        return self._watch

    def _revoked_now(self, serials: set[int]) -> None:
        """A new list was applied: publish it to the other hosts, and cut off whom it revokes."""
        self.state.set(REVOCATIONS, self.tls.revocations.data)
        self.cut_off(serials)

    def cut_off(self, serials: set[int]) -> None:
        """Close every connection whose certificate's serial is in ``serials`` (just revoked), and
        refuse any whose handshake, begun under the old list, ends after this (``_start``)."""
        with self._lock:
            self._revoked |= serials
            revoked = [(link, peer) for link, (peer, serial) in self._links.items() if serial in serials]
        for link, peer in revoked:
            self.counters.add("revoked", f"{peer}: its certificate was revoked while connected",
                              sender=peer.name)
            self.log(f"meshlearn control: closed a connection of {peer}: its certificate was revoked")
            link.close()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._inbox is not None:
            self._inbox.close()
        with self._lock:
            links, self._links = list(self._links), {}
        for link in links:
            link.close()

    def _authenticate(self, sock: socket.socket, deadline: float) -> Admitted:
        admitted = Admitted(self)
        try:
            tls_sock, peer = self.tls.accept(sock, deadline, admit=admitted.reserve)
            serial = x509.load_der_x509_certificate(tls_sock.getpeercert(binary_form=True)).serial_number
        except Refused as err:
            admitted.close()  # its slot, if it had one, is free again
            self._say_certificate_refused(err)
            raise
        except BaseException:
            admitted.close()
            raise
        admitted.link, admitted.peer = stream(tls_sock, f"control<-{peer.name}"), peer
        admitted.serial = serial
        return admitted

    def _say_certificate_refused(self, err: Refused) -> None:
        """A refused certificate (revoked: a participant the owner turned away; another CA's) is
        said in the log once per verify message, beside the counter: those messages are few, so a
        peer retrying cannot fill the log; a handshake that never shows a certificate is only counted."""
        if err.reason != "certificate_refused" or err.detail in self._said:
            return
        self._said.add(err.detail)
        self.log(f"meshlearn control: refused a handshake: {err.detail}")

    def held(self, host: str) -> int:
        """The connections ``host`` holds open now."""
        with self._lock:
            return self._held(host)

    def _held(self, host: str) -> int:
        return sum(1 for peer, _ in self._links.values() if peer.name == host)

    def _reserve(self, peer: Identity) -> str | None:
        """Admit ``peer`` and take one of its host's slots (None), or say why not. The slot counts
        from now, before the connection is registered: handshakes in flight (up to the acceptor's
        half-open cap of them) cannot carry a host past its cap."""
        why = self.authority.admission_refusal(peer)
        if why is not None:
            if peer.role == "joiner":  # the run's owner issued it: say why here too, not only count it
                self.log(f"meshlearn control: refused newcomer {peer.name}: {why}")
            return why
        with self._lock:
            if peer.name not in self.caps:  # a newcomer: one process of its own at most
                self.caps[peer.name] = self.per_process * 2
                self._buckets[peer.name] = TokenBucket(*self.rate, clock=self.clock)
            held, pending, cap = self._held(peer.name), self._pending[peer.name], self.caps[peer.name]
            if held + pending >= cap:  # each connection is a thread of ours
                raise Refused("too_many_connections", f"{peer} holds {held} connections already and "
                                                      f"{pending} on their way (at most {cap})", peer.name)
            self._pending[peer.name] += 1
        return None

    def _start(self, admitted: Admitted) -> None:
        """Register and serve an authenticated connection, unless its certificate was revoked while
        its handshake ran (checked under the lock ``cut_off`` takes: the connection is either
        registered before its cut-off, and closed by it, or refused here)."""
        link, peer, serial = admitted.link, admitted.peer, admitted.serial
        assert link is not None, "the acceptor hands over only authenticated connections"
        with self._lock:
            if admitted.reserved is not None:  # its slot becomes the connection (or is freed)
                self._pending[admitted.reserved] -= 1
                admitted.reserved = None
            revoked = serial in self._revoked
            if not revoked:
                self._links[link] = peer, serial
                self.admitted += 1
                self.peak[peer.name] = max(self.peak[peer.name], self._held(peer.name))
        if revoked:
            self.counters.add("revoked", f"{peer}: its certificate was revoked during its handshake",
                              sender=peer.name)
            link.close()
            return
        threading.Thread(target=self._serve, args=(link, peer), name=f"control-{peer.name}",
                         daemon=True).start()

    def _serve(self, link: FramedStream, peer: Identity) -> None:
        bucket = self._buckets[peer.name]  # the host's, whichever of its connections asks
        try:
            while True:
                try:
                    header, values = receive(link)
                    answer = self._answer(peer.name, header, values)
                except FrameRefused as err:
                    answer = self._refuse(peer.name, "oversized_frame", str(err))
                except (ValueError, TypeError, KeyError, IndexError) as err:  # the frame was whole: in step
                    answer = self._refuse(peer.name, "malformed_request", str(err))
                send(link, *answer)
                self._throttle(bucket, peer.name)  # every request counts, refused ones too
        except (ConnectionError, OSError):
            pass  # the host closed its connection (or its machine went away)
        finally:
            with self._lock:
                self._links.pop(link, None)
            link.close()

    def _throttle(self, bucket: TokenBucket, who: str) -> None:
        """Charge the request just answered to its host; wait as long as the host's rate requires
        before this connection's next one is read."""
        wait = bucket.delay()
        if wait > 0:
            self.counters.add("rate_limited", f"host {who}: more than {self.rate[0]:g} requests/s over its "
                                              f"connections (served {wait * 1000:.0f} ms later)", sender=who)
            time.sleep(wait)

    def _refuse(self, who: str, reason: str, why: str) -> tuple[dict, list[bytes]]:
        self.counters.add(reason, f"host {who}: {why}", sender=who)
        self.log(f"meshlearn control: refused {reason} from host {who}: {why}")
        return {"error": reason, "why": why}, []

    def _answer(self, who: str, header: dict, values: list[bytes]) -> tuple[dict, list[bytes]]:
        op, keys = header["op"], header.get("keys", [])
        if not isinstance(op, str) or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("a request needs an 'op' string and a 'keys' list of strings")
        amount, timeout_s = header.get("amount", 0), header.get("timeout_s", 0.0)
        if type(amount) is not int or not -MAX_AMOUNT <= amount <= MAX_AMOUNT:
            raise ValueError(f"'amount' must be an integer of at most {MAX_AMOUNT} in size")
        if type(timeout_s) not in (int, float):
            raise ValueError("'timeout_s' must be a number")
        for key in keys:
            why = self.authority.refusal(who, op, key, amount)
            if why is not None:
                return self._refuse(who, "authority", why)
        if op == "num_keys":
            if not self.authority.participant(who):
                return self._refuse(who, "authority", f"{who} is not a participant of this run")
            return {"value": self.state.count()}, []
        if not keys:
            raise ValueError(f"{op!r} needs keys")
        return self._apply(who, op, keys, values, amount, float(timeout_s))

    def _apply(self, who: str, op: str, keys: list[str], values: list[bytes], amount: int,
               timeout_s: float) -> tuple[dict, list[bytes]]:
        key, state = keys[0], self.state
        timeout_s = min(max(timeout_s, 0.0), MAX_WAIT_S)
        if op in ("set", "compare_set") and (why := self.authority.speaker_refusal(who, key, values[-1])
                                             or self.authority.entry_refusal(who, key, values[-1])):
            return self._refuse(who, "authority", why)
        if op == "set":
            state.set(key, self.authority.attributed(who, key, values[0]))
            return {}, []
        if op == "add":
            return {"value": state.add(key, amount)}, []
        if op == "compare_set":
            expected, desired = values
            with self._claims:  # a claim's check, its compare-and-set and the slot's move, as one
                why = (self.authority.claim_refusal(who, key, desired, state.check)
                       or self.authority.write_once_refusal(key, expected)
                       or self.authority.drain_refusal(key, expected, desired))
                if why:
                    return self._refuse(who, "authority", why)
                got = state.compare_set(key, expected, self.authority.attributed(who, key, desired))
                for published, value in (self.authority.claimed(who, key, desired) if got == desired
                                         else {}).items():
                    state.set(published, value.encode())
            return {}, [got]
        if op == "delete_key":
            return {"value": state.delete(key)}, []
        if op == "check":
            return {"value": state.check(keys)}, []
        if op in ("get", "multi_get", "wait"):
            got = state.wait(keys, timeout_s)
            if got is None:
                return {"error": "timeout", "why": f"{keys[:4]} did not appear within {timeout_s:g} s"}, []
            return {}, ([] if op == "wait" else got)
        raise ValueError(f"{op!r} is not an operation of the control service")


class Admitted:
    """A connection between its host's admission and its registration (``ControlService._start``):
    it holds one of the host's slots all that time. Closed instead (its handshake failed after
    admission, or the acceptor evicted it), it frees the slot."""

    def __init__(self, service: ControlService):
        self.service = service
        self.reserved: str | None = None  # the host whose slot it holds
        self.link: FramedStream | None = None  # once authenticated: the connection, its peer, its serial
        self.peer = Identity("", "")
        self.serial = 0

    def reserve(self, peer: Identity) -> str | None:
        """The acceptor's ``admit``: ``ControlService._reserve``, remembering the slot taken."""
        why = self.service._reserve(peer)
        if why is None:
            self.reserved = peer.name
        return why

    def close(self) -> None:
        with self.service._lock:
            host, self.reserved = self.reserved, None
            if host is not None:
                self.service._pending[host] -= 1
        if self.link is not None:
            self.link.close()
