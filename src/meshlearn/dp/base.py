"""The data-parallel seam: a strategy that keeps one stage's replicas together, written sans-IO.

Each worker owns one ``DPStrategy``. At every update U the driver walks it through fixed phases
(the order is ``mesh/update.py``'s update protocol, the walk its ``PhaseWalk``);
the strategy returns the ``Message``s (kind ``dp``) to send to the other replicas of its stage and
says what it still waits for; the driver carries the messages on the DP links (the simulator
charges them to the links and the virtual clock; the DistDriver sends them point to point in the
background) and hands arrivals back through ``receive``. No strategy sleeps, reads a clock or opens
a socket, so both drivers run the same arithmetic.

One update u (the worker's version before it) goes:

    pre_step(u)   → messages       gradients are in, before clip and optimizer step
    pre_ready(u)                   the driver delivers dp messages until True (blocking strategies)
    [clip, optimizer step]
    post_step(u)  → messages       e.g. start an averaging round on the new weights
    post_wait(u)  → key | None     a round this update must apply: the driver delivers until it is
                                   complete, or until its deadline (``deadline_s``) passes, when it
                                   calls ``expire(key)`` and the round is dropped
    apply(u)                       merges due at u (before the next forward: it sees them)

A round is named by a key ``(u, phase)``: the update that started it and a phase or fragment
index; its messages carry it as (step, microbatch). A message that arrives after its round's
deadline (counted from the receiver's own start of that round) drops the round as well, so the
decision never depends on when the receiver happens to look. ``allreduce`` is the one
``collective`` strategy: the drivers run their built-in ring all-reduce of gradients for it, exactly
as before this seam existed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlearn.basis import BasisTensor
from meshlearn.compress.codecs import Encoded
from meshlearn.dp.robust import Robust
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId

Key = tuple[int, int]  # (the update that started the round, phase or fragment)
Outgoing = Callable[[Key, torch.Tensor], torch.Tensor]
"""(round key, this replica's flat part) → the part that leaves it (``Worker.dp_contribution``)."""
Scored = Callable[[int, list[float]], None]
"""(update u, the outlier scores of every replica, in replica order, in a robust round merged at
u) → attribution."""


class DPStrategy:
    """Base class: the no-op phases of a strategy that needs nothing (and the counters)."""

    name = "base"
    collective = False
    """True: the drivers' built-in all-reduce of gradients runs at U (``allreduce``)."""
    drifts = True
    """True: replicas may differ, so clip norms are per replica and evaluation also averages."""

    def __init__(self, me: WorkerId, replicas: int):
        self.me = me
        self.replicas = replicas
        self.exchange = Exchange(me, replicas)
        self.rounds = 0  # rounds started
        self.dropped = 0  # rounds dropped at their deadline
        # Where this replica's part of a round leaves it (the registry installs the worker's
        # ``dp_contribution``, the seam of ``attack.target = dp``); None: as computed.
        self.outgoing: Outgoing | None = None
        # Where the stage's outlier scores of a robust round go, with the update that merges
        # the round (the registry installs the worker's ``note_round_score``); None: nowhere.
        self.scored: Scored | None = None

    @property
    def robust(self) -> Robust:
        """How this stage aggregates its contributions (``dp.robust``; also the built-in
        all-reduce's rule, read by the drivers)."""
        return self.exchange.robust

    def agreed_weights(self) -> dict[str, torch.Tensor] | None:
        """Weights every replica of this stage holds alike, by parameter name, where the strategy
        keeps them apart from the live ones (streaming DiLoCo: the outer weights); None where it
        keeps none (if ``drifts`` is False, the live weights are common after every update). The
        anchor circuit computes on these under ``anchor.weights = outer``."""
        return None

    def pre_step(self, u: int) -> list[Message]:
        return []

    def pre_ready(self, u: int) -> bool:
        return True

    def post_step(self, u: int) -> list[Message]:
        return []

    def post_wait(self, u: int) -> Key | None:
        return None

    def apply(self, u: int) -> None:
        """Merge what is due at update ``u``."""

    def receive(self, message: Message) -> list[Message]:
        """A dp message arrived (already past its deadline check); returns messages to send."""
        key = self.exchange.receive(message)
        return [] if key is None else self.on_complete(key)

    def share(self, key: Key, values: torch.Tensor, version: int) -> list[Message]:
        """Start round ``key`` with this replica's part (its peers may have sent theirs already)."""
        if self.outgoing is not None:
            values = self.outgoing(key, values.detach().reshape(-1))
        out = self.exchange.share(key, values, version)
        return out + (self.on_complete(key) if self.exchange.complete(key) else [])

    def on_complete(self, key: Key) -> list[Message]:
        """Every replica's part of round ``key`` is in (``exchange.mean`` gives the aggregate)."""
        return []

    def note_score(self, u: int, key: Key) -> None:
        """Round ``key``'s aggregate is merged at update ``u``: report the stage's outlier scores
        in it (every replica's, kept by the exchange since the round was reduced; none under the
        mean) with ``u``.

        Why at the merge and not when the round completes: a round that runs behind the updates
        (sparse ``delay``, DiLoCo ``overlap``) completes whenever its last part arrives, which
        differs between the simulator and real processes; the update that merges it does not
        (it waits for the round or drops it), so every runtime reports the score with the same
        step, and a checkpoint between completion and merge keeps it (``Exchange.scores``)."""
        scores = self.exchange.scores.pop(key, None)
        if scores is not None and self.scored is not None:
            self.scored(u, scores)

    def expire(self, key: Key) -> None:
        """Round ``key`` missed its deadline: drop it (late parts of it are ignored)."""
        if key not in self.exchange.dropped:
            self.exchange.expire(key)
            self.dropped += 1

    def deadline_s(self, key: Key) -> float | None:
        """Seconds after this worker's start of round ``key`` by which it must be complete; None:
        it is waited for (blocking strategies)."""
        return None

    def expects(self, u: int) -> int:
        """Messages each peer sends this worker for the rounds of update ``u`` (the DistDriver
        posts that many receives per DP link)."""
        return 0

    def post_rounds(self, u: int) -> bool:
        """Whether ``post_step(u)`` starts a round: its values follow the optimizer step, so an
        elastic update that does not commit must also undo that step (``elastic/rollback.py``)."""
        return False

    def reset_local(self) -> None:
        """Forget what is this replica's own rather than its stage's: what a replica healed from a
        peer must not inherit (the peer's error feedback, its private drift) and what a replica
        that trains nothing (an elastic spectator) must not accumulate. Default: nothing."""

    def basis_state(self) -> dict[str, BasisTensor]:
        """The state this strategy keeps in its parameters' bases (``meshlearn.basis``), listed
        so that a protocol model's morph transforms it with the weights; it is called at drain
        points, when no round is open. Default: none (all-reduce keeps no state)."""
        return {}

    @property
    def idle(self) -> bool:
        """No round this worker started is still missing a peer's part (a drain point)."""
        return not self.exchange.open_keys()

    def summary(self) -> dict:
        return {"dp_rounds": self.rounds, "dp_dropped_rounds": self.dropped,
                "dp_rejected_messages": self.exchange.rejected}

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "dropped": self.dropped, "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rounds, self.dropped = state["rounds"], state["dropped"]
        self.exchange.load_state_dict(state["exchange"])


class Exchange:
    """An all-gather by messages among one stage's replicas, per round key.

    ``share`` keeps this replica's part and returns one message per peer; ``receive`` stores a
    peer's part; once every replica's part is in, ``mean`` sums them in replica order and divides,
    so every replica computes the bitwise same average. Parts are checked before use: a part that
    is missing, not floating point, not finite or shaped unlike this replica's own drops the round.
    ``robust`` (``dp.robust``) replaces the average by a robust aggregate of the same stacked parts
    and scores each part (``dp/robust.outlier_scores``); the scores of every part are kept in
    ``scores`` until its strategy merges the round (``DPStrategy.note_score``): attribution, as
    the built-in all-reduce's robust reduce is scored.
    """

    def __init__(self, me: WorkerId, replicas: int, robust: Robust | None = None):
        self.me = me
        self.replicas = replicas
        self.robust = robust or Robust()
        self.peers = [WorkerId(r, me.stage) for r in range(replicas) if r != me.replica]
        self.parts: dict[Key, dict[int, torch.Tensor]] = {}
        self.dropped: set[Key] = set()
        self.rejected = 0
        self.scores: dict[Key, list[float]] = {}  # every part's outlier score per robust round, until merged

    def share(self, key: Key, values: torch.Tensor, version: int) -> list[Message]:
        values = values.detach().reshape(-1)
        self.parts.setdefault(key, {})[self.me.replica] = values
        payload = Encoded({"values": values}, tuple(values.shape), values.dtype)
        return [Message("dp", key[0], key[1], self.me, peer, payload, version=version)
                for peer in self.peers]

    def receive(self, message: Message) -> Key | None:
        """Store a peer's part; returns the key if that completed its round."""
        key = (message.step, message.microbatch)
        if key in self.dropped:
            return None  # a straggler of a dropped round
        values = message.payload.tensors.get("values")
        peer = message.src.replica
        if (values is None or not values.is_floating_point() or values.dim() != 1
                or not bool(torch.isfinite(values).all()) or peer == self.me.replica
                or message.src.stage != self.me.stage):
            self.rejected += 1
            self.expire(key)
            return None
        self.parts.setdefault(key, {})[peer] = values
        return key if self.complete(key) else None

    def complete(self, key: Key) -> bool:
        return len(self.parts.get(key, ())) == self.replicas

    def mean(self, key: Key) -> torch.Tensor | None:
        """The aggregate (``robust``; by default the average) of a complete round (None, and the
        round dropped, if a part is misshapen)."""
        parts = self.parts.pop(key)
        own = parts[self.me.replica]
        if any(p.shape != own.shape for p in parts.values()):
            self.rejected += 1
            self.dropped.add(key)
            return None
        if self.replicas == 1:
            return own.clone()
        aggregate, scores = self.robust.reduce_scored(
            torch.stack([parts[r].to(own.dtype) for r in range(self.replicas)]))
        if scores is not None:
            self.scores[key] = scores
        return aggregate

    def expire(self, key: Key) -> None:
        self.parts.pop(key, None)
        self.scores.pop(key, None)  # a dropped round merges nothing: nothing to attribute
        self.dropped.add(key)

    def open_keys(self) -> list[Key]:
        """Rounds this replica has shared whose peers' parts are not all in."""
        return [k for k, parts in self.parts.items() if self.me.replica in parts and not self.complete(k)]

    def state_dict(self) -> dict:
        return {"parts": {f"{k[0]}:{k[1]}": {str(r): t.clone() for r, t in p.items()}
                          for k, p in self.parts.items()},
                "dropped": sorted(self.dropped), "rejected": self.rejected,
                "scores": {f"{k[0]}:{k[1]}": score for k, score in self.scores.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.parts = {}
        for text, parts in state["parts"].items():
            a, b = text.split(":")
            self.parts[(int(a), int(b))] = {int(r): t for r, t in parts.items()}
        self.dropped = {tuple(k) for k in state["dropped"]}
        self.rejected = state["rejected"]
        self.scores = {}
        for text, scores in state.get("scores", {}).items():  # absent: a checkpoint from before scoring
            a, b = text.split(":")
            if isinstance(scores, list):  # a checkpoint from before the rows voted kept its own only: dropped
                self.scores[(int(a), int(b))] = scores


def round_deadline_s(nbytes: int, profile) -> float:
    """The default deadline of a round whose part is ``nbytes`` on a DP link of ``profile``:
    twice its modelled transfer (serialization, latency, jitter, expected resends)."""
    one = profile.serialization_s(nbytes) + profile.latency_s + profile.jitter_ms / 1000.0
    return 2.0 * one / (1.0 - profile.loss_rate)
