"""Collectives over framed streams, with no process group (``dist.trusted_links`` false).

Why: in a gloo collective a peer that sends more bytes than the receiver posted aborts the
receiving process (``gloo::EnforceNotMet``, SIGABRT in gloo's thread), and every gloo group opens
a listening port of its own. Here each process reaches each peer by one outgoing and one incoming
stream (``streams.connect_streams`` on the ``collectives`` channel, or any other stream with
``send(buffer)`` and ``read_frame(bound)``: ``net/links.py``'s authenticated ones fit), and every
contribution is one frame whose size the receiver knows exactly before it reads it.

A frame: the 16-byte prefix of ``net/frames.py`` (header length, body length), a 16-byte header
(``MAGIC``, the operation's code, the pair's sequence number: how many contributions this sender
gave this receiver before), then the body, the tensor's raw bytes. A receiver asks ``read_frame``
for at most the exact size it expects, so a larger frame is never allocated (it is read away);
then it refuses a frame of any other size, and a header that is not the one it expects (another
operation, an old frame replayed or a future one, bytes that are no header).

A refused frame does not take the contribution's place: it is counted (``FramedCollectives.refused``,
and the run's ``Counters`` under the sender's authenticated identity when the stream has one,
``net/links.AuthStream.peer``), and the receiver reads the sender's next frame for the same
contribution. So a participant that adds garbage, an oversized frame or a replay to its honest
contributions changes nothing (the step is the simulator's), and one that sends only what is
refused is named as the liar it is once it has spent ``MAX_REFUSED`` refusals on one
contribution, or sent nothing valid after a refused frame by the collective's deadline. The
deadline is the contribution's, not each frame's or each read's: refused frames do not renew it,
nor do bytes trickled into one frame, so a liar holds the reader no longer than a silent peer would.

What the run does then (``RunCollectives``): the step cannot be computed without that
contribution (every replica must apply the same mean), so the run stops, with one line naming the
sender, as a worker does for a pipeline message it refuses (``transport.Forged``); no process
aborts, and no other worker is blamed. A broken or silent stream stops the run like a broken
pipeline link (naming the peer), or after the collective's deadline.

Order: a sum adds the contributions in rank order (for a stage: replica order), on every member,
with the simulator's own expression (``mesh/sync.average_gradients``: ``torch.stack(...).sum(0)``,
there per parameter, here on the flattened gradients: element by element the same additions in
the same order), so every replica computes the same bits and dist = sim stays exact for any D
(tested for D = 2, 3, 4; a gloo ring is exact only for D = 2).

Cost: every member sends its whole tensor to each of the others: (D − 1)·(N + 32) bytes per member
for a tensor of N bytes, against a ring all-reduce's 2(D − 1)/D·N; the same for D = 2, (D/2)× more
beyond. Receiving holds the D contributions at once (D·N bytes).
"""

from __future__ import annotations

import contextlib
import queue
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from meshlearn.distributed.health import Health, WorkerFailure, gist
from meshlearn.dp.robust import Robust
from meshlearn.net.counters import Counters
from meshlearn.net.frames import PREFIX, PREFIX_BYTES, FrameRefused

MAGIC = b"MLC1"
HEADER = struct.Struct("=4sIq")  # magic, operation, sequence number
FRAME_OVERHEAD = PREFIX_BYTES + HEADER.size  # bytes a frame adds to its tensor
OPS = {"sum": 1, "gather": 2, "broadcast": 3, "barrier": 4, "blob": 5}
MAX_REFUSED = 8  # frames refused in a row before one contribution: then its sender is named


class PeerStream(Protocol):
    """One direction of a connection to a peer (``net/frames.FramedStream`` and its kin)."""

    def send(self, buffer: torch.Tensor) -> None: ...

    def read_frame(self, bound: int, within_s: float | None = None) -> torch.Tensor: ...

    def set_timeout(self, seconds: float | None) -> None: ...

    def close(self) -> None: ...


class Refused(Exception):
    """A peer's contribution, refused unread: a frame of another size, or one that does not decode."""

    def __init__(self, sender: int, reason: str):
        super().__init__(reason)
        self.sender = sender
        self.reason = reason


class Lost(Exception):
    """The stream to or from a peer closed, failed or stayed silent past its deadline; ``how``:
    "while sending (...)", "while receiving (...)"."""

    def __init__(self, peer: int, how: str, timed_out: bool = False):
        super().__init__(how)
        self.peer = peer
        self.how = how
        self.timed_out = timed_out


def frame_bytes(tensor: torch.Tensor) -> int:
    """What a contribution of ``tensor`` puts on the wire: its bytes and the frame's 32."""
    return FRAME_OVERHEAD + tensor.numel() * tensor.element_size()


class FramedCollectives:
    """This process's collectives with its peers (by rank): ``outgoing[peer]`` carries its frames to
    ``peer``, ``incoming[peer]`` the peer's to it. Every member of a collective calls it with the
    same ``ranks`` and tensors of the same shape and dtype, in the same order as every other
    collective they share (a pair's frames are numbered). Sends leave from a thread per peer, so a
    large tensor never waits for the receiver's reads of another. ``counters``: where refused
    frames are counted for the run's record (``log``: one line each); ``clock``: the monotonic
    clock the deadline of each contribution is kept by (tests give their own)."""

    def __init__(self, rank: int, outgoing: Mapping[int, PeerStream], incoming: Mapping[int, PeerStream],
                 counters: Counters | None = None, log: Callable[[str], None] = lambda line: None,
                 clock: Callable[[], float] = time.monotonic):
        self.rank, self.clock = rank, clock
        self.timeout_s: float | None = None  # the collective's deadline (None: none)
        self.outgoing, self.incoming = dict(outgoing), dict(incoming)
        self.counters, self.log = counters if counters is not None else Counters(), log
        self.sent: Counter[int] = Counter()
        self.received: Counter[int] = Counter()
        self.refused: Counter[int] = Counter()  # contributions refused, by sender
        self._errors: dict[int, str] = {}
        self._queues: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        for peer, stream in self.outgoing.items():
            self._queues[peer] = q = queue.Queue()
            thread = threading.Thread(target=self._send_loop, args=(peer, stream, q),
                                      name=f"collective-send-{peer}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def set_timeout(self, seconds: float) -> None:
        """The longest one read or write may block, and one contribution may take to arrive
        however many refused frames come first (the collective's deadline)."""
        self.timeout_s = seconds
        for stream in (*self.outgoing.values(), *self.incoming.values()):
            stream.set_timeout(seconds)

    # --- the collectives ---------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor, ranks: Sequence[int], op: str = "gather",
                   release: Mapping[int, float] | None = None) -> list[torch.Tensor]:
        """Every member's ``tensor``, in ``ranks`` order (this process's own is ``tensor``).
        ``release``: per peer, the monotonic time before which its frame may not leave (shaping)."""
        peers = [r for r in ranks if r != self.rank]
        frame = self._frame(tensor)
        for peer in peers:
            self._send(peer, frame, (release or {}).get(peer, 0.0), op)
        return [tensor if r == self.rank else self._read(r, tensor, op) for r in ranks]

    def sum(self, tensor: torch.Tensor, ranks: Sequence[int],
            release: Mapping[int, float] | None = None) -> torch.Tensor:
        """The sum of every member's ``tensor``, added in ``ranks`` order: the same bits everywhere."""
        parts = self.all_gather(tensor, ranks, "sum", release)
        return torch.stack([p.to(tensor.device) for p in parts]).sum(0)

    def broadcast(self, tensor: torch.Tensor, src: int, ranks: Sequence[int]) -> torch.Tensor:
        """``src``'s ``tensor`` at every member (the others pass one of its shape and dtype)."""
        if self.rank == src:
            frame = self._frame(tensor)
            for peer in ranks:
                if peer != src:
                    self._send(peer, frame, 0.0, "broadcast")
            return tensor
        return self._read(src, tensor, "broadcast")

    def broadcast_bytes(self, blob: torch.Tensor | None, src: int, ranks: Sequence[int],
                        bound: int) -> torch.Tensor:
        """``src``'s uint8 ``blob``, whose size the others do not know: they refuse one beyond
        ``bound`` bytes before allocating it (the only collective whose size is not exact)."""
        if self.rank == src:
            frame = self._frame(blob)
            for peer in ranks:
                if peer != src:
                    self._send(peer, frame, 0.0, "blob")
            return blob
        return self._read(src, torch.empty(0, dtype=torch.uint8), "blob", bound=bound)

    def barrier(self, ranks: Sequence[int]) -> None:
        """Returns once every member has reached it (an empty frame from each)."""
        self.all_gather(torch.empty(0, dtype=torch.uint8), ranks, "barrier")

    def close(self, wait_s: float = 5.0) -> None:
        """Let queued frames leave (up to ``wait_s`` each), then close every stream."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=wait_s)
        for stream in (*self.outgoing.values(), *self.incoming.values()):
            with contextlib.suppress(OSError):
                stream.close()

    # --- frames ------------------------------------------------------------------------------

    def _frame(self, tensor: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The prefix and the body (one copy on the host, so the caller may change ``tensor`` while it
        leaves); the header is added per peer (its sequence number)."""
        body = tensor.detach().reshape(-1).to("cpu", copy=True).view(torch.uint8)
        return PREFIX.pack(HEADER.size, body.numel()), body

    def _send(self, peer: int, frame: tuple[bytes, torch.Tensor], release: float, op: str) -> None:
        if peer in self._errors:
            raise Lost(peer, self._errors[peer])
        head, body = frame
        header = HEADER.pack(MAGIC, OPS[op], self.sent[peer])
        self.sent[peer] += 1
        self._queues[peer].put((head + header, body, release))

    def _send_loop(self, peer: int, stream: PeerStream, q: queue.Queue) -> None:
        while (item := q.get()) is not None:
            head, body, release = item
            delay = release - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                stream.send(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                stream.send(body)
            except Exception as err:  # noqa: BLE001 — raised in the caller's thread by the next collective
                self._errors[peer] = f"while sending ({gist(err)})"
                return

    def _read(self, src: int, like: torch.Tensor, op: str, bound: int | None = None) -> torch.Tensor:
        """``src``'s next contribution as a tensor like ``like``: refused frames are counted and
        passed over, up to ``MAX_REFUSED`` in a row (then Refused). ``bound`` (blobs only): the
        frame may be any size up to it; otherwise exactly ``like``'s. The whole wait is bounded by
        one deadline: each frame must arrive whole in what is left of it."""
        if self.timeout_s is None:
            return self._read_refusing(src, like, op, bound, None)
        try:
            return self._read_refusing(src, like, op, bound, self.clock() + self.timeout_s)
        finally:
            self.incoming[src].set_timeout(self.timeout_s)  # the whole deadline again for what follows

    def _read_refusing(self, src: int, like: torch.Tensor, op: str, bound: int | None,
                       end: float | None) -> torch.Tensor:
        refused: list[str] = []
        while len(refused) < MAX_REFUSED:
            try:
                left = None if end is None else end - self.clock()
                if left is not None and left <= 0:
                    raise Lost(src, f"while waiting for its {op}", timed_out=True)
                return self._read_frame(src, like, op, bound, left)
            except Refused as err:
                self._count(src, op, err.reason)
                refused.append(err.reason)
            except Lost as err:
                if not (err.timed_out and refused):
                    raise
                raise Refused(src, f"nothing valid for its {op} by the deadline after {len(refused)} refused "
                                   f"frame(s) (the last: {refused[-1]})") from None
        raise Refused(src, f"{MAX_REFUSED} frames in a row refused in place of its {op} "
                           f"(the last: {refused[-1]})")

    def _read_frame(self, src: int, like: torch.Tensor, op: str, bound: int | None,
                    within_s: float | None) -> torch.Tensor:
        """The next frame from ``src`` as its contribution, or Refused (the stream is past it); the
        whole frame within ``within_s`` (None: each read within the stream's timeout)."""
        exact = frame_bytes(like) if bound is None else None
        try:
            buffer = self.incoming[src].read_frame(exact if exact is not None else FRAME_OVERHEAD + bound,
                                                   within_s)
        except FrameRefused as err:
            raise Refused(src, f"{err} (expected {self._expected(like, op, exact, bound)})") from None
        except TimeoutError:
            raise Lost(src, f"while waiting for its {op}", timed_out=True) from None
        except OSError as err:  # ConnectionError included: the peer closed its end
            raise Lost(src, f"while receiving ({gist(err)})") from None
        expected = self.received[src]
        header_len = PREFIX.unpack(bytes(buffer[:PREFIX_BYTES].numpy()))[0]
        if header_len != HEADER.size or (exact is not None and buffer.numel() != exact):
            raise Refused(src, f"a frame of {buffer.numel()} bytes with a {header_len}-byte header "
                               f"(expected {self._expected(like, op, exact, bound)})")
        magic, code, sequence = HEADER.unpack(bytes(buffer[PREFIX_BYTES:FRAME_OVERHEAD].numpy()))
        if magic != MAGIC or code != OPS[op] or sequence != expected:
            raise Refused(src, f"a frame that does not decode as its {op} #{expected} (magic {magic!r}, "
                               f"operation {code}, number {sequence})")
        self.received[src] += 1
        body = buffer[FRAME_OVERHEAD:]
        if bound is not None:
            return body
        return body.view(like.dtype).reshape(like.shape).to(like.device)

    def _count(self, src: int, op: str, reason: str) -> None:
        """A refused frame in the run's record, attributed to the identity that sent it."""
        self.refused[src] += 1
        peer = getattr(self.incoming[src], "peer", None)
        sender = getattr(peer, "name", None)
        detail = f"rank {src}{f' (host {sender})' if sender else ''}, {op}: {reason}"
        self.counters.add("contribution_refused", detail, sender=sender)
        self.log(f"meshlearn: refused a frame from {detail}")

    @staticmethod
    def _expected(like: torch.Tensor, op: str, exact: int | None, bound: int | None) -> str:
        if exact is None:
            return f"a {op} of at most {FRAME_OVERHEAD + bound} bytes"
        return f"a {op} of {exact} bytes: {tuple(like.shape)} {str(like.dtype).removeprefix('torch.')}"


class RunCollectives:
    """A worker's collectives in a run without process groups: ``FramedCollectives`` over the
    workers (ranks ``0 … D·P − 1``), each wait bounded by ``deadline_s``, each failure the run's
    one line naming the peer (``health``). The driver's interface, the same as ``GroupCollectives``'s
    (``groups.py``) over process groups."""

    framed = True

    def __init__(self, framed: FramedCollectives, health: Health, names: Mapping[int, str],
                 stage_ranks: Sequence[int], deadline_s: float):
        self.peers = framed
        self.health = health
        self.names = dict(names)
        self.me = names[framed.rank]
        self.stage_ranks = list(stage_ranks)  # this worker's stage's replicas, in replica order
        self.workers = sorted(names)
        self.deadline_s = deadline_s
        framed.set_timeout(deadline_s)

    def stage_sum(self, flat: torch.Tensor, what: str, release: Mapping[int, float] | None = None
                  ) -> torch.Tensor:
        """Σ over this stage's replicas, in replica order (``release``: per peer rank, when its
        frame may leave)."""
        with self._failing(what):
            return self.peers.sum(flat, self.stage_ranks, release)

    def stage_reduce(self, flat: torch.Tensor, rule: Robust, what: str,
                     release: Mapping[int, float] | None = None) -> tuple[torch.Tensor, list[float] | None]:
        """``rule``'s aggregate (``dp.robust``) of this stage's replicas' ``flat``, stacked in
        replica order, and each replica's outlier score: the same frames as ``stage_sum``,
        reduced as the simulator reduces (``Robust.reduce_scored``)."""
        with self._failing(what):
            parts = self.peers.all_gather(flat, self.stage_ranks, "gather", release)
        return rule.reduce_scored(torch.stack([p.to(flat.device) for p in parts]))

    def gather(self, rows: torch.Tensor, what: str) -> torch.Tensor:
        """Every worker's ``rows`` (same shape everywhere), stacked in rank order."""
        with self._failing(what):
            return torch.stack(self.peers.all_gather(rows, self.workers))

    def broadcast(self, value: torch.Tensor, src: int, what: str) -> torch.Tensor:
        with self._failing(what):
            return self.peers.broadcast(value, src, self.workers)

    def broadcast_state(self, blob: torch.Tensor | None, src: int, bound: int, what: str) -> torch.Tensor:
        """``src``'s state blob to this stage's replicas; a blob beyond ``bound`` is refused."""
        with self._failing(what):
            return self.peers.broadcast_bytes(blob, src, self.stage_ranks, bound)

    def barrier(self, what: str) -> None:
        with self._failing(what):
            self.peers.barrier(self.workers)

    def close(self) -> None:
        self.peers.close()

    @contextlib.contextmanager
    def _failing(self, what: str):
        """A refusal or a lost stream as the run's failure, naming the peer in one line."""
        try:
            yield
        except Refused as err:
            raise WorkerFailure(self.health.abort(
                f"worker {self.names[err.sender]} sent a contribution to {what} that was refused unread: "
                f"{err.reason} (noticed by {self.me})")) from None
        except Lost as err:
            if err.timed_out:
                raise WorkerFailure(self.health.explain(f"worker {self.names[err.peer]} sent nothing for "
                                                        f"{what} within {self.deadline_s:.1f} s")) from None
            raise self.health.link_failure(f"lost the connection to worker {self.names[err.peer]} {err.how} "
                                           f"during {what} (noticed by {self.me})") from None
