"""DPAxis: one dist worker's data-parallel axis, the simulator's arithmetic in real time.

Two kinds of exchange run on it. The stage's built-in collective (``ReduceGradients``): the mean of
its replicas' gradients over a process group (or with untrusted links the framed collectives of
``collectives.py``), a robust rule's reduce of every contribution, each completion held to the
link model as the simulator charges it. A message-based strategy's rounds (``Send`` and ``Wait``,
mesh/update_run.py): point-to-point messages on the stage's DP links, each round waited for until it
lands or its deadline passes.

The DistDriver owns one and hands it what it needs explicitly: the worker, the link model, the
collectives, and ``DPLinks``, the driver's sending and receiving (a message goes where the driver
routes it; an arrival, of any kind, goes to its consumer). It is not a view of the whole driver,
so the DP axis reads as one piece and a runtime on top of dist (elastic) composes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlearn.distributed.collectives import RunCollectives, frame_bytes
from meshlearn.distributed.groups import GroupCollectives
from meshlearn.distributed.shaping import Pacer, allreduce_release_at, hold_until
from meshlearn.distributed.wire import HEADER_ROOM, PREFIX_BYTES
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Network, ring_allreduce_bytes_per_member
from meshlearn.mesh.report import dp_counters
from meshlearn.mesh.timeline import TimelineRecorder, all_gather, transfer
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.update import ReduceGradients, RoundStarts, Wait, receive_round
from meshlearn.mesh.update_run import Send
from meshlearn.mesh.worker import Worker


@dataclass(frozen=True)
class DPLinks:
    """What the DP axis uses of its runtime's links. Callables, not the transport itself: a runtime
    may replace its transport between steps (elastic relinks a row)."""

    send: Callable[[Message, int], None]
    """Send a message with a receive buffer of that capacity, routed and shaped as any message."""
    expect: Callable[[WorkerId, int, int], None]
    """Post receives: (peer, messages, capacity)."""
    next_message: Callable[[str, WorkerId, float | None], Message | None]
    """The next arrival (``what`` names it in a timeout); None if the deadline passed first."""
    deliver: Callable[[Message], None]
    """Hand an arrival of any kind to its consumer (a DP message comes back to ``deliver`` here)."""


class DPAxis:
    """This worker's DP axis; ``strategy`` is its message-based strategy (None: the collective)."""

    def __init__(self, worker: Worker, network: Network, epoch: float, shaped: bool,
                 collectives: RunCollectives | GroupCollectives, ring_next: WorkerId | None,
                 links: DPLinks, timeline: Callable[[], TimelineRecorder | None]):
        self.worker = worker
        self.me, self.mesh = worker.id, worker.mesh
        self.network = network
        self.epoch = epoch
        self.shaped = shaped
        self.collectives = collectives
        self.ring_next = ring_next
        self.links = links
        self.timeline = timeline  # the timeline plugin sets the driver's recorder after we are built
        self.strategy = worker.dp if worker.dp is not None and not worker.dp.collective else None
        # A message-based strategy's peers: the other replicas of this stage (meshlearn.dp).
        self.peers = ([WorkerId(r, self.me.stage) for r in range(self.mesh.replicas) if r != self.me.replica]
                      if self.strategy is not None else [])
        self.started = RoundStarts()  # on the monotonic clock
        self.wait_s = 0.0  # seconds this worker's updates waited on the DP axis
        self.capacity = PREFIX_BYTES + HEADER_ROOM + 4 * worker.n_params  # larger: oversize path
        # Framed collectives: each replica's gradients go to every other replica as a shaped frame.
        self.frame_pacers = {peer: Pacer(network.link(self.me, peer), epoch, shaped)
                             for peer in self.mesh.stage_replicas(self.me.stage)
                             if peer != self.me and collectives.framed}

    # --- a message-based strategy's rounds ----------------------------------------------------

    def send_phase(self, request: Send) -> float:
        """A phase's messages (mesh/update_run.py), the simulator's in real time: a "pre" phase
        posts the update's receives first; after a "post" phase's, what has arrived is delivered.
        Returns the clock its rounds' waits count from."""
        phase = request.phase
        if phase.phase == "pre":
            for peer in self.peers:
                self.links.expect(peer, self.strategy.expects(phase.u), self.capacity)
        self.send(request.messages)
        if phase.phase == "post":
            self.poll()
        return time.monotonic()

    def wait_round(self, wait: Wait) -> float:
        """Deliver one arrival, or none if the round's deadline passes first; returns the clock."""
        self.wait(f"the DP round of update {wait.u + 1}", wait.until)
        return time.monotonic()

    def send(self, messages: list[Message]) -> None:
        self.started.mark(messages, time.monotonic())
        for message in messages:
            self.links.send(message, self.capacity)

    def deliver(self, message: Message) -> None:
        """A DP message to its strategy; what the strategy answers is sent at once."""
        arrived = getattr(message, "received_at", time.monotonic())
        self.send(receive_round(self.strategy, self.started, message, arrived))

    def wait(self, what: str, give_up_at: float | None) -> bool:
        """Take one arrival (any kind); False if ``give_up_at`` passed first."""
        peer = self.peers[0] if self.peers else self.me
        message = self.links.next_message(what, peer, give_up_at)
        if message is None:
            return False
        self.links.deliver(message)
        return True

    def poll(self) -> None:
        """Deliver everything that has already arrived, without waiting."""
        while self.wait("nothing", time.monotonic()):
            pass

    def settle(self) -> None:
        """At a drain point: rounds still open land or miss their deadline (then dropped)."""
        for key in self.strategy.exchange.open_keys():
            give_up_at = self.started.give_up_at(self.strategy, key)
            while key in self.strategy.exchange.open_keys():
                if not self.wait(f"the DP round of update {key[0] + 1}", give_up_at):
                    self.strategy.expire(key)

    # --- the stage's collective ---------------------------------------------------------------

    def reduce_gradients(self, step: int, reduce: ReduceGradients) -> None:
        """The stage's aggregate of its replicas' gradients, as the simulator: the mean, (Σ over
        replicas) / D, or with a robust rule (``reduce.rule``) its reduce of every contribution;
        each wait bounded by ``dist.collective_deadline_s`` (``reduce.deadline_s``, the bound the
        collectives were built with)."""
        replicas = self.mesh.replicas
        if replicas == 1:
            return
        started = time.monotonic()
        flat = self.worker.flat_gradients()
        rule = reduce.rule
        what = f"the data-parallel {'all-gather' if rule.gathers else 'all-reduce'} of stage {self.me.stage}"
        scores = None  # a robust rule's outlier scores, in replica order (attribution)
        if self.collectives.framed:  # each frame held to its own link's model, counted as sent
            release = self._frames_release(flat, step)
            if rule.gathers:
                flat, scores = self.collectives.stage_reduce(flat, rule, what, release)
            else:
                flat = self.collectives.stage_sum(flat, what, release).div_(replicas)
        elif rule.gathers:
            flat, scores = self.collectives.stage_reduce(flat, rule, what)
            self.hold_gather(flat.numel() * flat.element_size(), self.mesh.stage_replicas(self.me.stage),
                             step)
        else:
            flat = self.collectives.stage_sum(flat, what)
            self.hold_ring(flat.numel() * flat.element_size(), replicas, step)
            flat.div_(replicas)
        self.worker.set_flat_gradients(flat)
        if scores is not None:
            self.worker.note_dp_score(step, scores)  # every replica's: the rows vote (mesh_report)
        self.wait_s += time.monotonic() - started

    def _recording(self, step: int) -> TimelineRecorder | None:
        """The timeline recorder if it records ``step``."""
        timeline = self.timeline()
        return timeline if timeline is not None and timeline.wants(step) else None

    def hold_gather(self, nbytes: int, replicas: list[WorkerId], step: int) -> None:
        """An all-gather of ``nbytes`` per member over ``replicas`` (the stage's, or elastic's
        quorum) ran at loopback speed: hold its completion to the simulator's model from here, this
        replica's contribution queued on the link to each peer, and count those bytes."""
        done = all_gather(self.timeline(), step, self.network, [self.me], replicas, nbytes,
                          time.monotonic() - self.epoch, self.epoch)
        if self.shaped:
            hold_until(self.epoch + max(done.values()))

    def hold_ring(self, nbytes: int, replicas: int, step: int) -> None:
        """An all-reduce of ``nbytes`` over ``replicas`` (the stage's group, or elastic's quorum)
        ran at loopback speed once the last replica joined: hold its completion to the ring model
        from there, as the simulator starts it when the group's last member is ready, and count
        the ring's bytes (a ring of one: nothing)."""
        if self.ring_next is None:
            return
        joined = time.monotonic()
        link = self.network.link(self.me, self.ring_next)
        sent_before = link.busy_s
        release = allreduce_release_at(link, self.epoch, joined, nbytes, replicas, self.shaped)
        timeline = self._recording(step)
        if timeline is not None:  # the ring's rounds, as one bar
            timeline.send(str(self.me), str(self.ring_next), "dp", "allreduce", step,
                          ring_allreduce_bytes_per_member(nbytes, replicas), joined,
                          joined + link.busy_s - sent_before, release)
        hold_until(release)

    def _frames_release(self, flat: torch.Tensor, step: int) -> dict[int, float]:
        """Framed collectives: when this replica's frame may leave for each other replica (its
        link's model, as a pipeline message's), each frame counted in the DP bytes as sent."""
        nbytes = frame_bytes(flat)
        return {self.mesh.rank(peer): transfer(self.timeline(), step, self.me, peer, pacer.link, "allreduce",
                                               nbytes, time.monotonic() - self.epoch,
                                               lambda pacer=pacer: pacer.release_at(nbytes), self.epoch,
                                               known=self.shaped)
                for peer, pacer in self.frame_pacers.items()}

    def summary(self, sum_over_workers: Callable[[list[float]], list[float]] | None = None) -> dict:
        """The strategy's counters, summed over every process by ``sum_over_workers`` (a
        collective: all call it; None: this process's own)."""
        return dp_counters(self.wait_s, [self.strategy.summary()] if self.strategy is not None else [],
                           sum_over_workers)
