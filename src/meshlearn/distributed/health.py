"""Liveness through the rendezvous store, and the run's one abort message.

Every process bumps its counter ``hb/<rank>`` every ``heartbeat_s`` from a background thread and
reads everyone else's in the same round trip. A worker whose counter stops moving for
``dead_after_s`` — killed, frozen, its host gone — is declared dead. The first process to notice
(or to fail itself) writes the ``abort`` key with compare-and-set, so every process reports the
same message, naming the same worker, whichever noticed first.

Waits in the main thread poll ``check()``; a main thread stuck in a C++ call is covered by the
monitor itself, which ends the process ``grace_s`` after a failure if the main thread has not.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from meshlearn.mesh.topology import MeshShape

ABORT_KEY = "abort"
EXIT_PEER_FAILURE = 3
EXIT_LEFT = 4  # elastic: this worker left the run (its pipeline partner is gone); the others go on
EXIT_EVICTED = 5  # elastic with SENTINEL: this worker was banned and left its stage's quorum


class WorkerFailure(RuntimeError):
    """The run cannot go on: a worker died, went silent, failed, or missed a deadline."""


class RowBroken(WorkerFailure):
    """Elastic: a partner of this worker's pipeline row died (its heartbeat stopped, or a link to it
    closed). The worker itself may stay (it drops its row's links and spectates, elastic/driver.py);
    raised where nothing handles it, it ends the process as any failure (``Health.exit_code``)."""


def process_name(mesh: MeshShape, rank: int, anchors: int = 0) -> str:
    """A rank's name in errors: its worker id; with ``anchors`` (anchor.z) anchor replicas, ``a{z}s{s}``
    for the Z × P ranks after the workers (distributed/anchor.py); else ``verifier`` for the rank
    after the workers (the SENTINEL process a run with verification adds, distributed/verifier.py)."""
    if rank < mesh.world_size:
        return str(mesh.worker(rank))
    if anchors:
        z, s = divmod(rank - mesh.world_size, mesh.stages)
        return f"a{z}s{s}"
    return "verifier"


class Health:
    """Heartbeats of every rank and the shared abort message, over a store client of our own.
    ``world``: the number of ranks (default: the mesh's workers; one more with a verifier);
    ``scope``: elastic runs, the ranks whose death concerns this worker."""

    def __init__(self, store: dist.Store, mesh: MeshShape, rank: int, heartbeat_s: float,
                 dead_after_s: float, store_owner: str, grace_s: float = 5.0, world: int | None = None,
                 scope: set[int] | None = None, anchors: int = 0):
        self.store = store
        self.mesh = mesh
        self.rank = rank
        self.world = world or mesh.world_size
        self.anchors = anchors
        self.name = process_name(mesh, rank, anchors)
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.store_owner = store_owner
        self.grace_s = grace_s
        # Elastic runs: only these ranks' deaths concern this worker (its pipeline row), and a
        # failure is this worker's own — never published as the whole run's abort.
        self.scope = scope
        self.exit_code = EXIT_PEER_FAILURE if scope is None else EXIT_LEFT
        self.failure: str | None = None
        # Elastic: a row partner's death, until the driver drops the row's links (``forget_row``)
        self.row_broken: str | None = None
        # Elastic: the store key a partner of this worker's row sets when it drops the row's links
        # (``follow``); read with the heartbeats
        self.row_key: str | None = None
        self._row_lock = threading.Lock()  # the monitor's finding against the driver's forgetting
        # ranks whose silence is no failure: evicted ones (left for good), and the elastic verifier's
        # workers until its links with them are built (they may still be starting)
        self.ignored: set[int] = set()
        self.on_exit: Callable[[], None] | None = None  # flushes logs before a forced exit
        self._stop = threading.Event()
        self._keys = [f"hb/{r}" for r in range(self.world)]
        self._thread = threading.Thread(target=self._run, name=f"health-{self.name}", daemon=True)

    def start(self) -> None:
        """Call once every rank has joined the process group (so all of them are running)."""
        for key in self._keys:
            self.store.add(key, 0)  # create every counter, so multi_get never waits for a key
        self.store.add(self._keys[self.rank], 1)
        self.store.compare_set(ABORT_KEY, "", "")  # create it empty, so one multi_get reads all
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 5.0)

    def watch(self, ranks: set[int]) -> None:
        """Elastic: from now on only these ranks' deaths concern this worker (its row, once the
        row trains; a joiner watches none of its row before, when its slots may hold the dead)."""
        with self._row_lock:
            self.scope = set(ranks)

    def follow(self, key: str) -> None:
        """Elastic: the row's links are built; a partner that drops them alone (it found another
        partner dead, or lost a link) says why under ``key`` (it exists, empty): that breaks the
        row here too (RowBroken), also while this worker waits on a link that will stay silent."""
        with self._row_lock:
            self.row_key = key

    def check(self) -> None:
        """Raise WorkerFailure if the run is over (elastic: RowBroken if a row partner died);
        called between the steps of every wait."""
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        if self.row_broken is not None:
            raise RowBroken(self.row_broken)

    def link_failure(self, message: str) -> WorkerFailure:
        """A pipeline link broke (``message`` names the peer). Elastic: the row is broken, this
        worker may stay (RowBroken, recorded until ``forget_row``); else the run's abort."""
        if self.scope is None:
            return WorkerFailure(self.abort(message))
        with self._row_lock:
            if self.row_broken is None:
                self.row_broken = message
            return RowBroken(self.row_broken)

    def forget_row(self) -> None:
        """Elastic: this worker dropped its row's links; no partner's death concerns it until its
        row links again (``watch``)."""
        with self._row_lock:
            self.scope = {self.rank}
            self.row_broken = None
            self.row_key = None

    def wait_work(self, work, what: str, deadline_s: float) -> None:
        """Wait for an async collective, checking liveness; ``what`` names it in errors."""
        end = time.monotonic() + deadline_s
        pause = 1e-4
        while not work.is_completed():
            self.check()
            if time.monotonic() >= end:
                raise WorkerFailure(self.explain(f"{what} did not complete within {deadline_s:.1f} s"))
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)  # a millisecond at most: a step's end waits on this
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001 — a collective's error never says which peer broke
            raise WorkerFailure(self.explain(f"{what} failed ({gist(err)})")) from None

    def explain(self, message: str) -> str:
        """A collective failed or timed out without naming anyone: give the heartbeats the time to
        name the worker that is gone, and fall back to ``message`` if every worker still beats."""
        end = time.monotonic() + self.dead_after_s + 2 * self.heartbeat_s
        while self.failure is None and self.row_broken is None and time.monotonic() < end:
            time.sleep(self.heartbeat_s / 4)
        return self.failure or self.row_broken or self.abort(f"{message} (noticed by {self.name})")

    def finish(self) -> None:
        """Clean shutdown: say so first, so a rank exiting a little earlier is not declared dead."""
        with contextlib.suppress(Exception):  # the store's host may already have exited
            self.store.set(f"done/{self.rank}", "1")
        self.stop()

    def abort(self, message: str) -> str:
        """Publish ``message`` unless another process already did; return the message that won.
        In an elastic run the message stays this worker's: it leaves, the run goes on."""
        if self.scope is not None:
            if self.failure is None:
                self.failure = message
            return self.failure
        try:
            won = self.store.compare_set(ABORT_KEY, "", message)
            won = won.decode() if isinstance(won, bytes) else str(won)
            message = won or message
        except Exception:  # noqa: BLE001 — the store may be gone with its host; keep our message
            pass
        if self.failure is None:
            self.failure = message
        return message

    # --- the monitor thread ------------------------------------------------------------------

    def _run(self) -> None:
        last_value = [-1] * self.world
        last_change = [time.monotonic()] * self.world
        while not self._stop.wait(self.heartbeat_s):
            row_key = self.row_key
            try:
                self.store.add(self._keys[self.rank], 1)
                values = self.store.multi_get([*self._keys, ABORT_KEY, *([row_key] if row_key else [])])
            except Exception as err:  # noqa: BLE001 — any store error means we lost the rendezvous
                self._fail(f"lost the rendezvous store ({self.store_owner}) — {gist(err)} "
                           f"(noticed by {self.name})")
                return
            aborted = values[self.world].decode()
            if aborted:
                self._fail(aborted)
                return
            if row_key and (dropped := values[-1].decode()):
                self._row_dropped(row_key, dropped)
            now = time.monotonic()
            for rank, raw in enumerate(values[:self.world]):
                value = int(raw.decode() or 0)
                if value != last_value[rank]:
                    last_value[rank], last_change[rank] = value, now
                elif (now - last_change[rank] > self.dead_after_s and self._watched(rank)
                      and not self._finished(rank)):
                    dead = process_name(self.mesh, rank, self.anchors)
                    message = (f"worker {dead} stopped answering: no heartbeat for "
                               f"{now - last_change[rank]:.1f} s (rank {rank}; noticed by "
                               f"{self.name}; limit {self.dead_after_s:.1f} s = "
                               f"dist.dead_after_s + a round trip)")
                    if self.scope is not None:  # elastic: a row partner; this worker stays
                        self._row_lost(rank, message)
                        continue
                    self._fail(self.abort(message))
                    return

    def ignore(self, ranks: set[int]) -> None:
        """These ranks left the run on purpose (an elastic eviction): their heartbeats stop, which
        concerns nobody, while a failure elsewhere stays the run's abort."""
        self.ignored |= set(ranks)

    def watch_again(self, ranks: set[int]) -> None:
        """Ranks ignored until now (the elastic verifier's workers, while they may still be
        starting) concern this process again."""
        self.ignored -= set(ranks)

    def _row_lost(self, rank: int, message: str) -> None:
        """The monitor found row partner ``rank`` dead: the main thread's next ``check`` raises
        RowBroken; the heartbeat goes on (this worker stays in its stage's quorum)."""
        with self._row_lock:
            if self.scope is not None and rank in self.scope and self.row_broken is None:
                self.row_broken = message
                self.scope = {self.rank}

    def _row_dropped(self, key: str, message: str) -> None:
        """A partner dropped the row's links (``follow``): as ``_row_lost``, if they are still
        this worker's (it may have dropped them itself since the read)."""
        with self._row_lock:
            if self.row_key == key and self.row_broken is None:
                self.row_broken = message
                self.scope = {self.rank}
                self.row_key = None

    def _watched(self, rank: int) -> bool:
        return rank not in self.ignored and (self.scope is None or rank in self.scope)

    def _finished(self, rank: int) -> bool:
        try:
            return self.store.check([f"done/{rank}"])
        except Exception:  # noqa: BLE001
            return False

    def _fail(self, message: str) -> None:
        """Record the failure; if the main thread has not exited after ``grace_s``, exit for it."""
        if self.failure is None:
            self.failure = message
        if self._stop.wait(self.grace_s):
            return  # the main thread stopped us on its way out
        print(f"meshlearn worker {self.name}: error: {self.failure}", file=sys.stderr, flush=True)
        if self.on_exit is not None:
            self.on_exit()
        os._exit(self.exit_code)


def gist(err: BaseException) -> str:
    """The gist of a gloo/NCCL/store error: its first sentence, without the C++ source location."""
    text = str(err).strip().splitlines()
    first = re.sub(r"^\[[^\]]*\]\s*", "", text[0]) if text else ""
    return f"{type(err).__name__}: {first.split('. ')[0][:240]}"


StoreConnector = Callable[[str, int, float], dist.Store]


def _tcp_store(host: str, port: int, timeout_s: float) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


_connector: list[StoreConnector] = [_tcp_store]


def use_store(connect: StoreConnector) -> None:
    """This process reaches the rendezvous through ``connect`` (host, port, timeout → a store)
    instead of a TCPStore client: a cluster run's entry point gives its authenticated control
    store (``cluster/control_store.py``), which the dist runtime never imports."""
    _connector[0] = connect


def store_client(host: str, port: int, timeout_s: float) -> dist.Store:
    """A rendezvous client of our own (the process group's is not for a second thread), namespaced
    by torchelastic's restart count so a restarted group never reads an old abort."""
    store = _connector[0](host, port, timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"meshlearn/{restart}/", store)


def group_store(host: str, port: int, timeout_s: float) -> dist.Store | None:
    """The store a process group meets on: None (torchrun's env:// rendezvous) unless ``use_store``
    gave another rendezvous, on which the group's keys go under ``pg``."""
    if _connector[0] is _tcp_store:
        return None
    return dist.PrefixStore("pg", store_client(host, port, timeout_s))


def run_and_exit(health: Health, label: str, who: str, body: Callable[[], None]) -> NoReturn:
    """A side process's whole life (the verifier, an anchor stage): run ``body``, then end the
    process with its code: 0, EXIT_PEER_FAILURE when another process failed (its message is
    already the run's), 1 for our own failure, published naming ``who``. ``os._exit``: posted
    receives stay in C++ threads, and the workers have finished or failed."""
    try:
        body()
        health.finish()
        code = 0
    except WorkerFailure as err:
        print(f"meshlearn {label}: error: {err}", file=sys.stderr)
        code = EXIT_PEER_FAILURE
    except BaseException as err:  # noqa: BLE001 — our own failure: publish it, naming ourselves
        traceback.print_exc()
        message = health.abort(f"{who} failed: {type(err).__name__}: {err}")
        print(f"meshlearn {label}: error: {message}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
