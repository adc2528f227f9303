"""Mutual TLS 1.3 between a run's participants, with the run's CA as the only trust root.

Both ends present a certificate the run's CA issued (``keys.py``), both verify the other's
against that CA and its revocation list (OpenSSL checks the list in the handshake: a revoked
certificate never completes one), and both learn the other's ``Identity`` (name and role). The
dialer names who it means to reach (``expect``) and refuses anyone else, so a participant with
valid credentials cannot answer in another's place. The server's first byte after the handshake
(``ADMITTED``) tells the dialer its own certificate was accepted. No system CA is loaded, no hostname is
checked (names are run identities, not DNS names), session tickets are off (every connection
is a full handshake against the current list), and nothing but TLS 1.3 is spoken.

What a stranger can make us do before it is authenticated: one handshake, under a deadline
(``handshake_timeout_s``), in one of at most ``max_half_open`` slots of a listener
(``Acceptor``: when full, the oldest half-open connection is closed, so a flood of idle
connections cannot keep an honest peer out for longer than the flood's own rate allows). What it
can make us buffer is what OpenSSL buffers for a handshake — records of at most 16 KiB + 256
bytes and a certificate chain of at most 100 KiB (OpenSSL's ``max_cert_list``) — and nothing
else: no application byte is read before the handshake has ended and the identity been checked.

Each refusal raises ``Refused`` with the name of the counter it adds to (``counters.py``), so a
run can report how many connections it turned away and why.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import ssl
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from cryptography import x509

from meshlearn.net.counters import Counters
from meshlearn.net.crl import ListRefused, RevocationList, read_list
from meshlearn.net.keys import Credentials, Identity, check_private, identity_of

HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a connection may take from arrival to an authenticated peer (handshake and, for a
link, its hello). A legitimate handshake takes two round trips and two signatures: raise it only
if honest peers are counted under ``handshake_timeout`` (an RTT of seconds)."""
ADMITTED = b"\x01"  # the server's first byte: it has checked our certificate (TLS 1.3 says nothing)
MAX_HALF_OPEN = 32
"""Connections a listener authenticates at once; beyond it the oldest is closed
(``half_open_evicted``). Raise it if many honest peers connect at the same instant and some are
counted as evicted."""


class Refused(ConnectionError):
    """A connection closed before it was trusted. ``reason`` names the counter it adds to:
    ``handshake_failed`` (not TLS 1.3, no certificate, garbage), ``certificate_refused`` (another
    CA, revoked, expired), ``handshake_timeout``, ``identity_refused`` (a valid certificate of
    someone not wanted here), ``hello_refused`` (a link hello the peer may not say). ``sender``:
    the participant the refusal is attributed to, once its certificate was checked (None before)."""

    def __init__(self, reason: str, detail: str, sender: str | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.sender = reason, detail, sender


class RunTls:
    """One participant's TLS contexts, made from its credentials: ``accept`` and ``connect``
    authenticate a connected socket both ways.

    >>> tls = RunTls(Credentials.in_folder("keys", "alice"))
    >>> tls_sock, peer = tls.connect(socket.create_connection(addr), expect="bob", deadline=...)
    """

    def __init__(self, credentials: Credentials):
        check_private(credentials.key)  # a key others can read is refused before it is used
        self.credentials = credentials
        self.identity = identity_of(x509.load_pem_x509_certificate(credentials.cert.read_bytes()))
        self.revocations = read_list(credentials.crl, credentials.ca)  # ListRefused: not the run's
        self._build(self.revocations)

    def reload(self, revocations: RevocationList | None = None) -> RevocationList:
        """Use a new revocation list (after the owner revoked someone): handshakes from now on check
        it. ``revocations``: a list already checked (``crl.checked``); None: read and check the file
        again. A list older than the one in force is refused (ListRefused), and the old one stays."""
        new = revocations if revocations is not None else read_list(self.credentials.crl, self.credentials.ca)
        why = new.older_than(self.revocations)
        if why is not None:
            raise ListRefused(self.credentials.crl, why)
        self._build(new)
        self.revocations = new
        return new

    def _build(self, revocations: RevocationList) -> None:
        """The contexts, from the checked list's own bytes: OpenSSL reads a list only from a file,
        so they go to a private temporary one (the watched file may have changed since it was read)."""
        fd, name = tempfile.mkstemp(prefix="meshlearn-crl-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(revocations.data)
            server = self._context(ssl.PROTOCOL_TLS_SERVER, name)
            client = self._context(ssl.PROTOCOL_TLS_CLIENT, name)
        finally:
            os.unlink(name)
        self._server, self._client = server, client

    def accept(self, sock: socket.socket, deadline: float,
               admit: Callable[[Identity], str | None] | None = None) -> tuple[ssl.SSLSocket, Identity]:
        """The server end of a handshake on ``sock`` by ``deadline`` (a monotonic time); the
        authenticated socket (blocking) and who is at the other end, or Refused (``sock`` closed).
        ``admit``: why a peer of the run is not wanted here (None: it is), asked before ``ADMITTED``,
        so the dialer learns of its refusal in the handshake."""
        tls = self._server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return self._handshake(tls, None, deadline, admit)

    def connect(self, sock: socket.socket, expect: str, deadline: float) -> tuple[ssl.SSLSocket, Identity]:
        """The client end: as ``accept``, and the peer must be ``expect``. In TLS 1.3 the server
        checks our certificate after our side has finished, so the server's first byte
        (``ADMITTED``) says it did; its alert instead becomes Refused(``refused_by_peer``) naming
        why (bytes we sent first could be lost with the alert when it closes)."""
        tls = self._client.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
        return self._handshake(tls, expect, deadline)

    def _handshake(self, tls: ssl.SSLSocket, expect: str | None, deadline: float,
                   admit: Callable[[Identity], str | None] | None = None) -> tuple[ssl.SSLSocket, Identity]:
        try:
            _handshake_by(tls, deadline)
            peer = identity_of(x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)))
            if expect is not None and peer.name != expect:
                raise Refused("identity_refused", f"the peer is {peer}, not {expect}", peer.name)
            unwanted = admit(peer) if admit is not None else None
            if unwanted is not None:
                raise Refused("identity_refused", unwanted, peer.name)
            tls.settimeout(max(deadline - time.monotonic(), 1e-3))
            if tls.server_side:
                tls.sendall(ADMITTED)
            elif tls.recv(1) != ADMITTED:
                raise Refused("refused_by_peer", f"{peer} closed without admitting us")
            tls.settimeout(None)
        except Refused:
            tls.close()
            raise
        except TimeoutError:
            tls.close()
            raise Refused("handshake_timeout", "not admitted within the deadline") from None
        except ValueError as err:  # a certificate of the run's CA that names no participant
            tls.close()
            raise Refused("certificate_refused", str(err)) from None
        except OSError as err:  # the server's alert (our certificate refused: revoked, say), or a reset
            tls.close()
            raise Refused("refused_by_peer", f"{expect or 'the client'} refused us: {_why(err)}") from None
        except BaseException:
            tls.close()
            raise
        return tls, peer

    def _context(self, protocol: int, crl_file: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # identities are run names, checked by name after the handshake
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(self.credentials.ca))  # the only trust root
        ctx.load_verify_locations(cafile=crl_file)
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF | ssl.VERIFY_X509_STRICT
        ctx.load_cert_chain(str(self.credentials.cert), str(self.credentials.key))
        if protocol == ssl.PROTOCOL_TLS_SERVER:
            ctx.num_tickets = 0  # no resumption: each connection is checked against the current list
        return ctx


def _handshake_by(tls: ssl.SSLSocket, deadline: float) -> None:
    """Drive a handshake on a non-blocking socket until it ends or ``deadline`` passes (a socket
    timeout bounds each read, not the whole: a peer trickling bytes would outlast it)."""
    tls.setblocking(False)
    with selectors.DefaultSelector() as wait:
        wait.register(tls, selectors.EVENT_READ)
        while True:
            try:
                tls.do_handshake()
                return
            except ssl.SSLWantReadError:
                wait.modify(tls, selectors.EVENT_READ)
            except ssl.SSLWantWriteError:
                wait.modify(tls, selectors.EVENT_WRITE)
            except ssl.SSLCertVerificationError as err:
                raise Refused("certificate_refused", err.verify_message) from None
            except (ssl.SSLError, OSError) as err:
                raise Refused("handshake_failed", _why(err)) from None
            left = deadline - time.monotonic()
            if left <= 0 or not wait.select(left):
                raise Refused("handshake_timeout", "no handshake within the deadline")


def refusal_of(err: BaseException) -> str:
    """One line for what the server said when it closed on us after our handshake (its alert)."""
    return _why(err) if isinstance(err, ssl.SSLError | OSError) else str(err)


def _why(err: BaseException) -> str:
    if isinstance(err, ssl.SSLError) and err.reason:
        return err.reason.lower().replace("_", " ")
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class Acceptor:
    """Authenticates connections handed to a listener, each in a thread of its own, at most
    ``max_half_open`` at once (beyond, the oldest is closed and counted), each by its deadline.
    ``authenticate(sock, deadline)`` returns what ``on_ready`` receives, or raises Refused (or an
    OSError: counted as ``handshake_failed``)."""

    def __init__(self, authenticate: Callable[[socket.socket, float], object], counters: Counters,
                 on_ready: Callable[[object], None] = lambda ready: None,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S, max_half_open: int = MAX_HALF_OPEN):
        self.authenticate, self.on_ready, self.counters = authenticate, on_ready, counters
        self.timeout_s, self.max_half_open = timeout_s, max_half_open
        self._half_open: OrderedDict[int, socket.socket] = OrderedDict()  # by arrival
        self._evicted: set[int] = set()
        self._lock = threading.Lock()
        self._next = 0

    def submit(self, sock: socket.socket) -> None:
        """Start authenticating ``sock`` (returns at once)."""
        with self._lock:
            ticket, self._next = self._next, self._next + 1
            if len(self._half_open) >= self.max_half_open:
                oldest, victim = self._half_open.popitem(last=False)
                self._evicted.add(oldest)
                _shut(victim)  # its thread fails at its next wait and counts the eviction
            # a second handle on the connection: wrapping it in TLS detaches ``sock`` itself
            self._half_open[ticket] = sock.dup()
        threading.Thread(target=self._run, args=(ticket, sock), name="net-handshake", daemon=True).start()

    def half_open(self) -> int:
        with self._lock:
            return len(self._half_open)

    def _run(self, ticket: int, sock: socket.socket) -> None:
        ready, failure = None, None
        try:
            ready = self.authenticate(sock, time.monotonic() + self.timeout_s)
        except (Refused, OSError) as err:
            failure = err
        with self._lock:
            evicted = ticket in self._evicted
            self._evicted.discard(ticket)
            handle = self._half_open.pop(ticket, None)
        if handle is not None:
            handle.close()
        if ready is None or evicted:
            reason = "half_open_evicted" if evicted else getattr(failure, "reason", "handshake_failed")
            detail = getattr(failure, "detail", str(failure or "evicted when admitted"))
            self.counters.add(reason, detail=detail, sender=getattr(failure, "sender", None))
            sock.close()
            if ready is not None and hasattr(ready, "close"):
                ready.close()
            return
        self.on_ready(ready)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by its peer
        sock.shutdown(socket.SHUT_RDWR)
