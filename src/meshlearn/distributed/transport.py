"""Pipeline messages between processes: background senders and receivers, one connection per link.

Each directed point-to-point link (r, s) → (r, s±1) — and a message-based DP strategy's or the
anchor circuit's — gets a connection of its own, used by one sender thread at the source and one
receiver thread at the destination: a two-rank process group (``dist.links = "collective"``) or a
TCP stream of our own (``"tcp"``, ``streams.py``; ``auto`` picks it whenever a verifier relays,
see ``settings.links_of``). Separate connections keep the two directions of a boundary
independent (NCCL orders the operations of one communicator; two threads sharing one could
deadlock), and the threads let communication overlap compute: the main thread hands a message to
its link's sender and goes on computing, while the receiver fetches the step's messages as soon
as the step starts.

A sender holds each message until its pacer's delivery time (in-process shaping, the same for both
kinds of connection), then sends it as one buffer. Every receiver has a bound, ``max_message_bytes``
(the largest message an honest peer of the run sends, ``wire.message_bound``), and a message that
does not decode is refused too; a refused message arrives as ``Forged``, naming its slot (the
training step its receive was posted for, and its place there), and the link stays up. A
worker's main thread gets the stand-in its driver builds for that slot (``stand_in``,
``mesh/standin.py``); the relay builds its own from its arrival count (``verifier.py``).

- TCP: a stream of frames. The receiver reads a frame's prefix and refuses, before allocating, a
  header beyond ``HEADER_ROOM`` or a frame beyond the bound, reading its bytes away in bounded
  chunks so the stream stays in step. A peer can send any number of bytes; none reaches an
  allocation the bound does not allow, and nothing it sends can end the receiving process. The
  ``capacity`` of ``send``/``expect`` means nothing here (a stream has no posted buffers).
- Collective: a receiver keeps up to ``WINDOW`` receives posted ahead, each with a ``capacity``
  both ends derive from the config, so the peer's "ready to receive" is already there when a
  message leaves (see wire.py); a larger message goes as a notice plus a buffer on
  ``OVERSIZE_TAG``. A notice beyond the bound is refused before anything is allocated. Not
  closed there: gloo aborts the receiving process (``gloo::EnforceNotMet``, SIGABRT, in its own
  thread) when a peer sends more bytes than the matching receive posted — a raw send beyond the
  posted capacity on ``MESSAGE_TAG``, an oversize buffer longer than its notice announced, or a
  refused notice's buffer, which stays unmatched on ``OVERSIZE_TAG`` (the run stalls until a
  deadline). That is why an untrusted mesh (a verifier's) gets tcp links under ``auto``.

Where links are trusted (``dist.trusted_links``) the DP all-reduce and the per-step gather are
process-group collectives, where a malicious replica can do what gloo lets any peer do; untrusted,
they run over framed streams (``collectives.py``). Either way a connection's identity is the hello
that opened it (``streams.py``), not authenticated — except in a cluster run with credentials,
where every stream is mutual TLS through the hosts' ports and its hello's sender must belong to
the peer's certificate (``cluster/links.py``).
The main thread waits for messages through ``next_message``, which checks liveness and a deadline
derived from the link profile, and names the peer if either fails.

Queues are keyed by the *logical* link (src, dst) a message belongs to, and each link's connection
has one remote end: the peer itself, or — with SENTINEL in the run — the verifier process that
relays the pipeline traffic (``relay``: worker → verifier → worker, see ``distributed/verifier.py``).
The verifier's own transport (``me = None``) receives and sends on every pipeline link.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshlearn.distributed.groups import PairGroup, rank_of
from meshlearn.distributed.health import Health, WorkerFailure, gist
from meshlearn.distributed.shaping import Pacer, hold_until
from meshlearn.distributed.streams import FrameRefused, Link
from meshlearn.distributed.wire import PREFIX_BYTES, WireError, pack, prefix, read_prefix, unpack
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.net.frames import FramedStream

POLL_S = 0.05  # how often a waiting main thread looks at liveness; arrivals wake it at once
WINDOW = 4  # receives posted ahead per link (memory: WINDOW × capacity bytes)
MESSAGE_TAG, OVERSIZE_TAG = 0, 1


@dataclass
class Broken:
    """A receiver thread's failure, delivered through the inbox so the main thread raises it."""

    message: str
    link: Link | None = None



@dataclass
class Forged:
    """A message a receiver refused without decoding it: an oversize notice or a frame beyond the
    bound, or bytes that are no valid message. Its slot is where it arrived: the ``index``-th
    message of the receive posted for ``step`` (``expect``; None: a receive posted for no training
    step, such as a validation batch's or a control message's). The relay quarantines it in its
    link's slot (``verifier.py``); a worker's driver does the same through ``Transport.stand_in``
    for a training step's message, and ends the run naming the sender for any other."""

    reason: str  # what was wrong with it
    link: Link
    step: int | None = None
    index: int = 0

    @property
    def message(self) -> str:
        return f"worker {self.link[0]} sent a message that was refused unread: {self.reason}"


def _isend(buffer: torch.Tensor, dst: int, group, tag: int):
    """A world sub-group is addressed by global rank; a ``PairGroup`` by its own (elastic rows)."""
    if isinstance(group, PairGroup):
        return dist.isend(buffer, group=group.pg, group_dst=group.peer, tag=tag)
    return dist.isend(buffer, dst, group=group, tag=tag)


def _irecv(buffer: torch.Tensor, src: int, group, tag: int):
    if isinstance(group, PairGroup):
        return dist.irecv(buffer, group=group.pg, group_src=group.peer, tag=tag)
    return dist.irecv(buffer, src, group=group, tag=tag)


def _send_posted(buffer: torch.Tensor, dst: int, group, capacity: int, timeout: timedelta) -> None:
    """gloo/NCCL: one send into the receive posted with ``capacity``, or a notice that fits it and
    the buffer where no posted receive can catch it."""
    if buffer.numel() <= capacity:
        works = [_isend(buffer, dst, group, MESSAGE_TAG)]
    else:
        notice = prefix(-1, buffer.numel(), buffer.device)
        works = [_isend(notice, dst, group, MESSAGE_TAG), _isend(buffer, dst, group, OVERSIZE_TAG)]
    for work in works:
        work.wait(timeout)


class Transport:
    """``groups``: one connection per logical link this process sends or receives on — a process
    group, or a framed stream (``dist.links = tcp``, from ``groups.build_groups``: ``streams.Stream``,
    or an authenticated ``net.links.AuthStream`` in a cluster run with credentials). ``relay``: the rank
    that carries pipeline links (stages differ) instead of the peer. A worker (``me``) sends on the
    links from it and receives on those to it; the relay itself (``me = None``) gets each link as a
    (receive group, send group) pair and does both."""

    def __init__(self, me: WorkerId | None, mesh: MeshShape, groups: dict[Link, object],
                 pacers: dict[WorkerId, Pacer], device: torch.device, health: Health, message_s: float,
                 max_message_bytes: int, relay: int | None = None):
        self.me = me
        self.mesh = mesh
        self.device = device
        self.health = health
        self.message_s = message_s
        self.max_message_bytes = max_message_bytes
        self.inbox: queue.Queue = queue.Queue()
        self.pacers = pacers
        # What a worker's main thread gets in place of a refused training message (its driver's
        # quarantined stand-in, ``mesh.standin``); None: every refused message ends the run.
        self.stand_in: Callable[[Forged], Message] | None = None
        self._errors: list[str] = []
        self._pending = 0
        self._idle = threading.Condition()
        self._send_q: dict[Link, queue.Queue] = {}
        self._recv_q: dict[Link, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        ends = [end for group in groups.values() for end in (group if isinstance(group, tuple) else (group,))]
        self._streams = [end for end in ends if isinstance(end, FramedStream)]  # closed by ``close``

        def remote(peer: WorkerId) -> int:
            relayed = relay is not None and me is not None and peer.stage != me.stage
            return relay if relayed else rank_of(mesh, peer)

        for (src, dst), group in groups.items():
            if me is None:  # the relay: in from src, out to dst
                into, out = group
                self._recv_q[(src, dst)] = q = queue.Queue()
                self._spawn(f"recv-{src}->{dst}", self._recv_loop, (src, dst), mesh.rank(src), into, q)
                self._send_q[(src, dst)] = q = queue.Queue()
                self._spawn(f"send-{src}->{dst}", self._send_loop, (src, dst), mesh.rank(dst), out, q)
            elif src == me:
                self._send_q[(src, dst)] = q = queue.Queue()
                self._spawn(f"send-{me}->{dst}", self._send_loop, (src, dst), remote(dst), group, q)
            elif dst == me:
                self._recv_q[(src, dst)] = q = queue.Queue()
                self._spawn(f"recv-{src}->{me}", self._recv_loop, (src, dst), remote(src), group, q)

    def _spawn(self, name: str, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # --- the main thread's side --------------------------------------------------------------

    def send(self, message: Message, capacity: int, shaped: bool = True) -> None:
        """Queue ``message`` on its link; returns at once. ``capacity`` is the receiver's buffer size
        for it (the same number ``expect`` got there; unused on a TCP link). Unshaped messages
        (evaluation) are neither held nor counted in the link's bytes."""
        self._raise_send_errors()
        release = self.pacers[message.dst].release_at(message.wire_bytes) if shaped else 0.0
        with self._idle:
            self._pending += 1
        link = (message.src if self.me is None else self.me, message.dst)  # a worker sends as itself
        self._send_q[link].put((message, release, capacity))

    def expect(self, src: WorkerId, count: int, capacity: int, step: int | None = None) -> None:
        """Receive ``count`` messages, in order, on the link from ``src``, into buffers of
        ``capacity`` bytes (larger messages arrive by the oversize path; a TCP link reads each
        frame at its own size, up to ``max_message_bytes``, and ignores ``capacity``). ``step``:
        the training step they are of, which a refused one's slot names (``Forged``)."""
        self.expect_link((src, self.me), count, capacity, step)

    def expect_link(self, link: Link, count: int, capacity: int, step: int | None = None) -> None:
        """``expect`` for any link this process receives on (the relay's are not its own)."""
        if count:
            self._recv_q[link].put((count, capacity, step))

    def next_arrival(self, timeout_s: float) -> Message | Broken | Forged | None:
        """The relay's wait: the next message, a refused one, a receiver's failure, or None after
        ``timeout_s``.
        Never aborts the run: at the end, peers closing their links is no failure."""
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def send_error(self) -> str | None:
        return self._errors[0] if self._errors else None

    def next_message(self, waiting_for: str, peer: WorkerId,
                     give_up_at: float | None = None) -> Message | None:
        """The next message to arrive on any link; ``waiting_for`` and ``peer`` name what the
        worker needs, for the error if nothing comes within the deadline. With ``give_up_at`` (a
        monotonic time; a DP round's deadline) it returns None then instead of failing."""
        deadline = time.monotonic() + self.message_s
        if give_up_at is not None and give_up_at < deadline:
            deadline = give_up_at
        while True:
            self.health.check()
            self._raise_send_errors()
            try:
                item = self.inbox.get(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline and give_up_at is not None and deadline == give_up_at:
                    return None
                if time.monotonic() >= deadline:
                    raise WorkerFailure(self.health.abort(
                        f"worker {peer} sent no {waiting_for} within {self.message_s:.1f} s "
                        f"(noticed by {self.me}; its heartbeat is alive, so it is stuck or too slow: "
                        f"raise dist.timeout_s if its compute takes that long)")) from None
                continue
            if isinstance(item, Broken):
                raise self.health.link_failure(item.message)
            if isinstance(item, Forged):  # a lying peer: never a mere broken row
                if item.step is not None and self.stand_in is not None:
                    return self.stand_in(item)  # a training slot: quarantined, and the run goes on
                raise WorkerFailure(self.health.abort(item.message))
            return item

    def drain(self, deadline_s: float) -> None:
        """Wait until every queued message has been handed over (before shutting down)."""
        end = time.monotonic() + deadline_s
        with self._idle:
            while self._pending:
                self.health.check()
                self._raise_send_errors()
                if time.monotonic() >= end:
                    raise WorkerFailure(self.health.abort(
                        f"{self.me} could not deliver {self._pending} message(s) within {deadline_s:.1f} s"))
                self._idle.wait(POLL_S)
        self._raise_send_errors()  # a send that failed is no longer pending, but was never handed over

    def close(self, wait_s: float = 1.0) -> None:
        """Stop the link threads, waiting up to ``wait_s`` for each (0: a broken elastic row's,
        which may sit in a receive from a frozen peer until their backstop; they are daemons)."""
        for q in [*self._send_q.values(), *self._recv_q.values()]:
            q.put(None)
        senders = [t for t in self._threads if t.name.startswith("send-")]
        for thread in senders if wait_s > 0 else ():
            thread.join(timeout=wait_s)
        for stream in self._streams:  # wakes a receiver blocked on its stream; sent bytes still leave
            stream.close()
        for thread in self._threads if wait_s > 0 else ():
            thread.join(timeout=wait_s)

    def _raise_send_errors(self) -> None:
        if self._errors:
            raise self.health.link_failure(self._errors[0])

    # --- background threads ------------------------------------------------------------------

    def _send_loop(self, link: Link, dst: int, group, q: queue.Queue) -> None:
        peer = link[1]
        timeout = timedelta(seconds=3 * self.message_s)
        if isinstance(group, FramedStream):
            group.set_timeout(timeout.total_seconds())
        while (item := q.get()) is not None:
            message, release, capacity = item
            try:
                buffer = pack(message, self.device)  # while the link still "carries" it
                hold_until(release)  # the link model says the message arrives now
                if isinstance(group, FramedStream):  # a frame of its own size: no capacity, no notice
                    group.send(buffer)
                else:
                    _send_posted(buffer, dst, group, capacity, timeout)
            except WireError as err:  # its own message cannot travel (wire.pack): no peer to blame
                self._errors.append(f"{self.me or 'the verifier'} cannot send {message.kind} "
                                    f"{message.microbatch} of step {message.step} to worker {peer}: {err}")
                return
            except Exception as err:  # noqa: BLE001 — reported to the main thread, which raises
                self._errors.append(f"lost the connection to worker {peer} while sending it "
                                    f"{message.kind} {message.microbatch} of step {message.step} "
                                    f"({gist(err)}; noticed by {self.me or 'the verifier'})")
                return
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _recv_loop(self, link: Link, src: int, group, q: queue.Queue) -> None:
        peer = link[0]
        # A backstop only: the main thread's own deadline (message_s) normally fires first.
        timeout = timedelta(seconds=3 * self.message_s)
        if isinstance(group, FramedStream):
            group.set_timeout(timeout.total_seconds())
        while (job := q.get()) is not None:
            count, capacity, step = job
            try:
                if isinstance(group, FramedStream):
                    self._read_frames(link, group, count, step)
                else:
                    self._receive_posted(link, src, group, count, max(capacity, PREFIX_BYTES), timeout, step)
            except Exception as err:  # noqa: BLE001 — delivered to the main thread as an error
                self.inbox.put(Broken(f"lost the connection to worker {peer} while receiving "
                                      f"from it ({gist(err)}; noticed by {self.me or 'the verifier'})", link))
                return

    def _receive_posted(self, link: Link, src: int, group, count: int, capacity: int,
                        timeout: timedelta, step: int | None) -> None:
        """gloo/NCCL: ``count`` messages into receives posted ``WINDOW`` ahead, larger ones by the
        oversize path (``step``: theirs, for a refused one's slot)."""
        posted: deque = deque()
        for received in range(count):
            while len(posted) < WINDOW and received + len(posted) < count:
                buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                posted.append((buffer, _irecv(buffer, src, group, MESSAGE_TAG)))
            buffer, work = posted.popleft()
            work.wait(timeout)
            header_len, size = read_prefix(buffer)
            if header_len < 0:  # oversize notice: the message follows on its own tag
                if not PREFIX_BYTES <= size <= self.max_message_bytes:  # before allocating
                    self.inbox.put(Forged(f"an oversize notice of {size} bytes (a message of "
                                          f"this run takes {PREFIX_BYTES} to "
                                          f"{self.max_message_bytes})", link, step, received))
                    continue
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
                _irecv(buffer, src, group, OVERSIZE_TAG).wait(timeout)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self._deliver(buffer, link, step, received)

    def _read_frames(self, link: Link, stream: FramedStream, count: int, step: int | None) -> None:
        """TCP: ``count`` frames off the stream, each refused before allocation if beyond the bound
        (``step``: theirs, for a refused one's slot)."""
        for index in range(count):
            try:
                buffer = stream.read_frame(self.max_message_bytes)
            except FrameRefused as err:
                self.inbox.put(Forged(str(err), link, step, index))
                continue
            self._deliver(buffer.to(self.device), link, step, index)

    def _deliver(self, buffer: torch.Tensor, link: Link, step: int | None, index: int) -> None:
        """Decode a received buffer into the inbox: the message, or Forged for bytes that lie (the
        ``index``-th of the receive posted for ``step``)."""
        try:
            message = unpack(buffer, link[0])
        except WireError as err:
            self.inbox.put(Forged(str(err), link, step, index))
            return
        message.received_at = time.monotonic()  # a DP round's deadline is judged by it
        message.link = link  # the relay routes by the link, never by the header's dst
        message.arrival = None if step is None else (step, index)  # its slot, as a Forged's
        self.inbox.put(message)
