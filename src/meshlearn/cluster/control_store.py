"""A host's client of the run's control service: a ``torch.distributed.Store``, so what runs on
a store (heartbeats and the abort in ``distributed/health.py``, verdicts, the graceful stop,
checkpoint agreement, what the coordinator shares) works unchanged on the authenticated one.

Each connection dials the coordinator's port (``port.dial`` to destination ``control``) and runs
the TLS handshake expecting the coordinator's identity, so a machine that answers in its place
is refused before any request leaves. Connections are per thread (``ControlLine``): the health
monitor's heartbeat never queues behind the main thread's waiting ``get``, and no frame of two
threads interleaves. Every process shares one ``ControlLine``; ``ControlStore`` objects over it
differ only in their timeout (each caller of ``store_client`` asks its own).

A host that is not the coordinator also follows the revocation list the coordinator publishes
(``follow_revocations``): whoever the owner revoked at the coordinator is refused on this machine
too, and the list is kept beside this host's key for every process it starts later and for a resume.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from meshlearn.cluster.authority import REVOCATIONS
from meshlearn.cluster.control import DESTINATION
from meshlearn.cluster.control_wire import raise_for, receive, send, stream
from meshlearn.cluster.identity import credentials_beside
from meshlearn.cluster.links import KEY_ENV
from meshlearn.net.counters import Counters
from meshlearn.net.frames import FramedStream
from meshlearn.net.port import dial
from meshlearn.net.revocations import CHECK_EVERY_S, ListSource, RevocationWatch
from meshlearn.net.tls import HANDSHAKE_TIMEOUT_S, Refused, RunTls

FINAL = ("certificate_refused", "identity_refused", "refused_by_peer")  # refusals a retry will not change
ANSWER_MARGIN_S = 10.0  # beyond a request's own wait, how long its answer may take to arrive


class ControlLine:
    """Authenticated connections to the coordinator's control service, one per thread."""

    def __init__(self, tls: RunTls, address: str, port: int, coordinator: str,
                 connect_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self.tls, self.address, self.port, self.coordinator = tls, address, port, coordinator
        self.connect_timeout_s = connect_timeout_s
        self._local = threading.local()

    def call(self, header: dict, values: list[bytes], timeout_s: float) -> tuple[dict, list[bytes]]:
        """One request and its answer (ControlRefused if the service refused it)."""
        link = self._link()
        link.set_timeout(timeout_s + ANSWER_MARGIN_S)
        try:
            send(link, header, values)
            answer, got = receive(link)
        except BaseException:
            link.close()  # a half-done exchange leaves the stream out of step: start a new one next time
            self._local.link = None
            raise
        raise_for(answer)
        return answer, got

    def reach(self, within_s: float) -> None:
        """First contact: dial until the coordinator answers (it may start later than this host)
        or ``within_s`` passes (the last OSError). A refusal of the credentials (``FINAL``) is not
        retried: they will not change."""
        end = time.monotonic() + within_s
        while True:
            try:
                self._local.link = self._connect(time.monotonic() + self.connect_timeout_s)
                return
            except Refused as err:
                if err.reason in FINAL or time.monotonic() > end:
                    raise
                time.sleep(0.2)  # a handshake cut short (a flood evicted it): again
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    def _link(self) -> FramedStream:
        """This thread's connection; a new one is tried again until ``connect_timeout_s`` passes
        (a stranger's flood may evict a half-open connection of ours; nothing was sent yet). Even
        a refusal is tried again (an eviction after our side of the handshake reads as one), and
        if none succeeds the last refusal is what is raised: a revoked host learns why, not that
        its last try ran out of time."""
        link = getattr(self._local, "link", None)
        if link is None:
            deadline = time.monotonic() + self.connect_timeout_s
            refused: Refused | None = None
            while True:
                try:
                    link = self._connect(deadline)
                    break
                except OSError as err:
                    if isinstance(err, Refused) and err.reason in FINAL:
                        refused = err
                    if time.monotonic() > deadline:
                        raise (refused or err) from None
                    time.sleep(0.1)
            self._local.link = link
        return link

    def _connect(self, deadline: float) -> FramedStream:
        sock = dial(self.address, self.port, DESTINATION, max(deadline - time.monotonic(), 0.1))
        tls_sock, _ = self.tls.connect(sock, expect=self.coordinator, deadline=deadline)
        return stream(tls_sock, f"control->{self.coordinator}")


class ControlStore(dist.Store):
    """The store operations meshlearn uses, on the control service (TCPStore's meaning: ``get``
    waits up to the store's timeout for its key)."""

    def __init__(self, line: ControlLine, timeout_s: float):
        super().__init__()
        self.line = line
        self.set_timeout(timedelta(seconds=timeout_s))

    def set(self, key: str, value) -> None:
        self._call("set", [key], [_bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call("get", [key], waits=True)[1][0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", [key], amount=int(amount))[0]["value"])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", [key], [_bytes(expected), _bytes(desired)])[1][0]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys))[0]["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", list(keys), waits=True, timeout=timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", list(keys), waits=True)[1]

    def deleteKey(self, key: str) -> bool:  # noqa: N802 — the name torch's Store trampoline calls
        return bool(self._call("delete_key", [key])[0]["value"])

    def getNumKeys(self) -> int:  # noqa: N802 — the name torch's Store trampoline calls
        return int(self._call("num_keys", [])[0]["value"])

    def _call(self, op: str, keys: list[str], values: list[bytes] = (), amount: int = 0, waits: bool = False,
              timeout: timedelta | None = None) -> tuple[dict, list[bytes]]:
        wait_s = (timeout or self.timeout).total_seconds() if waits else 0.0
        header = {"op": op, "keys": keys, "amount": amount, "timeout_s": wait_s}
        return self.line.call(header, list(values), wait_s)


def _bytes(value) -> bytes:
    """A value as torch's stores take it: bytes, a list of byte values, or text."""
    return bytes(value) if isinstance(value, bytes | bytearray | list) else str(value).encode()


def follow_revocations(line: ControlLine, counters: Counters, log: Callable[[str], None],
                       every_s: float = CHECK_EVERY_S) -> RevocationWatch:
    """A watch (not started) of this host's list beside its key and of the list the coordinator
    publishes (``authority.REVOCATIONS``), applied to ``line``'s contexts and kept in the file. The
    coordinator is authenticated by ``line`` and its answer bounded by the control frame; its list
    is checked like the file's (size, signature under the run's CA, not older than the one in
    force), and a refused one is counted in ``counters`` under the coordinator's name. Nothing to
    close when a list applies: the launcher holds no connection a peer opened (the connections into
    this machine are its workers', whose contexts read the file when they start)."""
    store = ControlStore(line, ANSWER_MARGIN_S)  # the key is checked first: ``get`` never waits
    published = ListSource(f"published by the coordinator {line.coordinator}",
                           lambda: store.get(REVOCATIONS) if store.check([REVOCATIONS]) else None,
                           sender=line.coordinator)
    return RevocationWatch(line.tls, lambda serials: None, log, every_s, (published,), counters)


def control_connector(coordinator: str):
    """What ``distributed.health.use_store`` takes in a process a cluster host's launcher started:
    (address, port, timeout) → a ControlStore, all of them over one line authenticated with the
    key in ``KEY_ENV`` and expecting ``coordinator``."""
    lines: dict[tuple[str, int], ControlLine] = {}
    # torch's wrappers (PrefixStore) hold the C++ half only: a Python subclass whose object is
    # collected turns into a "pure virtual" Store, so every store made stays referenced here
    made: list[ControlStore] = []

    def connect(address: str, port: int, timeout_s: float) -> ControlStore:
        if (address, port) not in lines:
            tls = RunTls(credentials_beside(Path(os.environ[KEY_ENV])))
            lines[(address, port)] = ControlLine(tls, address, port, coordinator)
        made.append(ControlStore(lines[(address, port)], timeout_s))
        return made[-1]

    return connect
