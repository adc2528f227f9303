"""Worker (r, s): one pipeline stage of one replica, written sans-IO.

A worker never sleeps, opens a socket or reads a clock. A driver feeds it the data of each step
(``feed``), hands it messages (``receive``), asks it for work (``next_action``), runs it (``run``,
which returns the messages to send) and carries out updates (``apply_update``, after whatever
collective the update needs). What the simulator tests is therefore exactly what a real process runs.

Work is keyed by global microbatch id, not by step, so under the async schedule microbatches of
several steps are in flight at once. Each forward records the weight version it ran with; under
weight stashing its backward runs on exactly those weights (a snapshot kept until the last
microbatch that uses it is backwarded), without stashing on the current ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.func import functional_call

from meshlearn.compress.codecs import Codec, Encoded, Kind, MessageContext, SizedEncoded
from meshlearn.mesh.compute import StageShape, stage_shape
from meshlearn.mesh.messages import Message, carried_kind
from meshlearn.mesh.schedule import Action, StagePlan
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder

Tamper = Callable[[Kind | Literal["dp"], int, int, torch.Tensor], torch.Tensor]
"""(kind, step, microbatch, tensor) → the tensor actually sent; see ``meshlearn.verify.attacks``.
Kind ``dp``: this worker's part of a DP round (``dp_contribution``; microbatch = the round's phase)."""
Forge = Callable[[Message], Message]
"""message → the message actually put on the wire (a wire-level forgery); see ``verify.forgeries``."""


@dataclass(frozen=True)
class CostOnly:
    """Cost-only mode (``meshlearn plan``): F/B do no arithmetic. The stage's module lives on the
    meta device (shapes, no storage), and each F/B sends a message of exactly the codec's wire
    size (the codec's own ``encode`` run on a meta tensor of the message's shape: ``seq_len`` ×
    ``d_model`` per sequence). Everything else — the plan, the inbox, versions, stash bookkeeping
    (a stashed version is an empty placeholder), updates, the DP strategy's phases — is the same
    code, so the simulator's event loop runs unchanged over it."""

    seq_len: int
    d_model: int


@dataclass
class StepWork:
    """What the trainer feeds a worker for one step: its data and the step's learning-rate factor."""

    step: int
    microbatch_size: int  # sequences per microbatch, for FLOP counting on every stage
    lr_factor: float = 1.0
    tokens: list[torch.Tensor] | None = None  # first stage: input ids per microbatch
    targets: list[torch.Tensor] | None = None  # last stage: next-token ids per microbatch


@dataclass
class InFlight:
    """A microbatch between its forward and its backward on this stage."""

    inputs: torch.Tensor | None  # the decoded stage input (requires grad), None on the first stage
    out: torch.Tensor  # the stage output, or the scaled loss on the last stage
    ids: torch.Tensor | None  # token ids, for id-aware codecs
    version: int  # weight version of the forward
    weights: dict[str, torch.Tensor] | None  # the leaves the forward ran on (None: the module's own)


@dataclass
class StepStats:
    """Per-step counters a driver reports: losses (last stage), update norms and staleness."""

    losses: dict[int, float] = field(default_factory=dict)  # global microbatch id → loss
    update_sq_norms: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # versions behind, per applied gradient
    dp_scores: dict[int, list[float]] = field(default_factory=dict)
    """Update u → the outlier scores of its stage's replicas, in replica order (``dp.robust``): every
    replica computes every member's score, so its row carries them all (``mesh/report.py``)."""


class Worker:
    def __init__(self, wid: WorkerId, mesh: MeshShape, module: Decoder,
                 optimizer: torch.optim.Optimizer, codec: Codec, plan: StagePlan, microbatches: int,
                 weight_stashing: bool = True, cost_only: CostOnly | None = None):
        self.id = wid
        self.mesh = mesh
        self.module = module
        self.optimizer = optimizer
        self.codec = codec
        self.plan = plan
        self.microbatches = microbatches
        self.weight_stashing = weight_stashing
        self.is_first = wid.stage == 0
        self.is_last = wid.stage == mesh.stages - 1
        self.n_params = sum(p.numel() for p in module.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        self.version = 0  # optimizer updates applied so far
        self.horizon = 0  # the first microbatch id this stage may not forward yet (set by the driver)
        self.work: dict[int, StepWork] = {}  # fed steps whose microbatches are not all done
        self.inbox: dict[tuple[str, int], Encoded] = {}
        self.in_flight: dict[int, InFlight] = {}
        self.skipped: set[int] = set()  # microbatches a verifier quarantined upstream
        self.stats: dict[int, StepStats] = {}
        self._group_versions: list[int] = []  # forward versions of the gradients awaiting an update
        self._stash: dict[int, dict[str, torch.Tensor]] = {}
        self._stash_users: dict[int, int] = {}
        self.stash_peak = 0  # most weight versions held at once (the live weights excluded)
        # Sees the full-width gradient at this stage's input before it is encoded (for statistics
        # such as the subspace basis update); None when nobody listens.
        self.input_grad_observer: Callable[[torch.Tensor], None] | None = None
        # The No-WS variant's per-stage learning-rate scale at a step (None: 1).
        self.stage_lr_scale: Callable[[int], float] | None = None
        # An adversarial worker: rewrites each tensor it is about to send (before encoding), and
        # each encoded message (a forgery), while its own forward/backward stay honest. None for an
        # honest worker.
        self.tamper: Tamper | None = None
        self.forge: Forge | None = None
        # The receiver's gate (``compress.wire_checks.WireGuard``): drivers pass every arriving
        # message through ``admit`` before anything decodes it. None: trust every peer.
        self.guard = None
        # The data-parallel strategy (``meshlearn.dp``): the drivers walk it through its phases at
        # every update and carry its ``dp`` messages. None: the drivers' built-in all-reduce.
        self.dp = None
        # The spectral correction (``meshlearn.optim.spectral``), attached to the optimizer as a
        # step pre-hook; here so that checkpoints carry its anchor EMAs and an anchor circuit can
        # reach it (``receive_anchor``). None: off.
        self.spectral = None
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.cost_only = cost_only
        if cost_only is not None:
            self.in_flight_peak = 0  # the most microbatches held between F and B (activation memory)
            self._wire: dict[tuple[Kind, int], Encoded] = {}
            self._cost_shape = stage_shape(module)  # no warm-up locks in a cost-only run
            self.trainable_bytes = sum(p.numel() * p.element_size() for p in module.parameters()
                                       if p.requires_grad)

    # --- what the driver feeds and asks ------------------------------------------------------

    def feed(self, work: StepWork) -> None:
        if self.is_first and work.tokens is None:
            raise ValueError(f"worker {self.id}: the first stage needs input tokens")
        if self.is_last and work.targets is None:
            raise ValueError(f"worker {self.id}: the last stage needs targets")
        self.work[work.step] = work

    @property
    def shape(self) -> StageShape:
        """What this stage computes now, for the compute model (follows the module: locked blocks
        of architecture warm-up are not charged)."""
        return self._cost_shape if self.cost_only is not None else stage_shape(self.module)

    @property
    def steps_done(self) -> int:
        """Steps whose every update this worker has applied."""
        return self.version // self.plan.updates_per_step

    @property
    def idle(self) -> bool:
        """Nothing in flight, nothing received and unused: a drain point for this worker."""
        return (not self.in_flight and not self.inbox and not self._group_versions
                and (self.dp is None or self.dp.idle))

    def next_action(self) -> Action | None:
        """The next planned action if its input has arrived; None while waiting (or when done)."""
        planned = self.plan.peek(self.horizon)
        if planned is None:
            return None
        kind, j = planned
        step = j // self.microbatches
        if kind == "F":
            if step not in self.work:
                return None
            if not self.is_first and ("act", j) not in self.inbox:
                return None
            return Action("F", j, self.version)
        if kind == "B":
            if not self.is_last and ("grad", j) not in self.inbox:
                return None
            return Action("B", j, self.in_flight[j].version)
        return Action("U", j, self.version + 1)

    def admit(self, message: Message, slot: tuple[int, int] | None = None) -> Message:
        """What a peer sent, checked against what this worker expects (shape, dtype, bytes, ids,
        finiteness, an open step): the message itself, or a quarantined stand-in with a record in
        ``guard.rejections``. Drivers call it on arrival, before any verifier decodes it.
        ``slot``: the (step, microbatch) the message must be, where the driver knows it from where
        it arrived (a dist worker's); a header naming another is refused and the stand-in fills
        the slot."""
        if self.guard is None or not self.work or carried_kind(message.link[0], self.id) == "dp":
            return message  # a DP link's messages: the strategy's exchange checks them (meshlearn.dp.base)
        if slot is not None and slot[0] in self.work:
            step, microbatches, microbatch = slot[0], (slot[1],), slot[1]
        else:
            # The message's own step if this worker has work for it, else its oldest open step
            # (under a flushing schedule: the one step in progress), so a stale or future step is refused.
            step = message.step if message.step in self.work else min(self.work)
            microbatches, microbatch = range(self.microbatches), None
        # The link it came on says who sent it and what it carries (an activation from the stage
        # before, a gradient from the one after); the header's src and kind are the sender's claims.
        sender = message.link[0]
        carries = carried_kind(sender, self.id)
        return self.guard.admit(message, step, self.work[step].microbatch_size, microbatches,
                                lambda kind, t, m: self.context(kind, t * self.microbatches + m, True),
                                sender, carries, microbatch)

    def receive(self, message: Message) -> None:
        j = message.step * self.microbatches + message.microbatch
        self.inbox[(message.kind, j)] = message.payload
        if message.skip:  # propagate: every later message of this microbatch carries the flag
            self.skipped.add(j)

    def run(self, action: Action) -> list[Message]:
        """Perform F or B ``action`` (the one ``next_action`` returned) and return what to send."""
        assert action.kind != "U" and action == self.next_action(), f"{self.id}: {action} not ready"
        self.plan.advance(action.kind)
        j = action.microbatch
        if self.cost_only is not None:
            outgoing = self._forward_sized(j) if action.kind == "F" else self._backward_sized(j)
        else:
            outgoing = self._forward(j) if action.kind == "F" else self._backward(j)
        return outgoing if self.forge is None else [self.forge(m) for m in outgoing]

    def microbatch_size(self, j: int) -> int:
        return self.work[j // self.microbatches].microbatch_size

    @property
    def device(self) -> torch.device:
        """Where this stage computes: received tensors are decoded onto it."""
        return next(self.module.parameters()).device

    def context(self, kind: Kind, j: int, arriving: bool) -> MessageContext:
        """What the codec is told about microbatch ``j``'s ``kind`` message that this worker
        receives (``arriving``) or sends: an activation arrives over the boundary above this
        stage and leaves over the one below; a gradient the other way round."""
        step, m = divmod(j, self.microbatches)
        boundary = self.id.stage - 1 if (kind == "act") == arriving else self.id.stage
        return MessageContext(step, m, boundary, self.id.replica, device=self.device)

    # --- forward and backward ----------------------------------------------------------------

    def _forward(self, j: int) -> list[Message]:
        step, m = divmod(j, self.microbatches)
        work = self.work[step]
        weights = self._forward_weights()
        if self.is_first:
            inputs, ids = None, work.tokens[m]
            out = self._call(weights, work.tokens[m])
        else:
            message = self.inbox.pop(("act", j))
            ids = message.tensors.get("ids")
            inputs = self.codec.decode(message, "act", self.context("act", j, True)).requires_grad_(True)
            out = self._call(weights, inputs)
        record = InFlight(inputs, out, ids, self.version, weights)
        self.in_flight[j] = record
        if self.is_last:
            loss = Decoder.loss(out, work.targets[m])
            if j in self.skipped:
                # Quarantined upstream: zero weight, so the microbatch moves no weight anywhere, and
                # its loss stays out of the train loss.
                record.out = loss * 0.0
                return []
            self._stats(step).losses[j] = loss.item()
            # Each microbatch's mean loss counts 1/(microbatches per update): the update's gradient
            # is the mean over its group (the whole step's batch for the flushing schedules).
            record.out = loss / self._group_size()
            return []
        dst = self.mesh.next_stage(self.id)
        sent = self._tampered("act", step, m, out.detach())
        payload = self.codec.encode(sent, "act", ids, self.context("act", j, False))
        return [Message("act", step, m, self.id, dst, payload, skip=j in self.skipped,
                        version=self.version)]

    def _backward(self, j: int) -> list[Message]:
        step, m = divmod(j, self.microbatches)
        record = self.in_flight.pop(j)
        if self.is_last:
            record.out.backward()
        else:
            # The codec's backward: for the mask codec the sender's own mask (the same context),
            # so the gradient reaching this stage is m ⊙ ∂L/∂h̃, autograd's through h ↦ h ⊙ m.
            grad = self.codec.decode(self.inbox.pop(("grad", j)), "grad", self.context("grad", j, True))
            record.out.backward(grad)
        self._collect_grads(record)
        self._group_versions.append(record.version)
        skip = j in self.skipped
        self.skipped.discard(j)
        if self.is_first:
            return []
        if self.input_grad_observer is not None:
            self.input_grad_observer(record.inputs.grad)
        dst = self.mesh.prev_stage(self.id)
        sent = self._tampered("grad", step, m, record.inputs.grad)
        payload = self.codec.encode(sent, "grad", record.ids, self.context("grad", j, False))
        return [Message("grad", step, m, self.id, dst, payload, skip=skip, version=record.version)]

    def _forward_sized(self, j: int) -> list[Message]:
        """Cost-only ``_forward``: the bookkeeping, and a message of the codec's wire size."""
        step, m = divmod(j, self.microbatches)
        weights = self._forward_weights()
        if not self.is_first:
            self.inbox.pop(("act", j))
        self.in_flight[j] = InFlight(None, None, None, self.version, weights)
        self.in_flight_peak = max(self.in_flight_peak, len(self.in_flight))
        if self.is_last:
            return []
        payload = self.wire("act", self.work[step].microbatch_size)
        return [Message("act", step, m, self.id, self.mesh.next_stage(self.id), payload,
                        version=self.version)]

    def _backward_sized(self, j: int) -> list[Message]:
        """Cost-only ``_backward``: the bookkeeping, and a message of the codec's wire size."""
        step, m = divmod(j, self.microbatches)
        record = self.in_flight.pop(j)
        if not self.is_last:
            self.inbox.pop(("grad", j))
        if record.weights is not None:
            self._release_stash(record)
        self._group_versions.append(record.version)
        if self.is_first:
            return []
        payload = self.wire("grad", self.work[step].microbatch_size)
        return [Message("grad", step, m, self.id, self.mesh.prev_stage(self.id), payload,
                        version=record.version)]

    def wire(self, kind: Kind, batch: int) -> Encoded:
        """Cost-only: what the codec puts on the wire for one microbatch of ``batch`` sequences."""
        key = (kind, batch)
        if key not in self._wire:
            x = torch.empty(batch, self.cost_only.seq_len, self.cost_only.d_model, device="meta")
            ids = torch.empty(batch, self.cost_only.seq_len, dtype=torch.long, device="meta")
            encoded = self.codec.encode(x, kind, ids)
            self._wire[key] = SizedEncoded(encoded.tensors, encoded.shape, encoded.dtype, encoded.meta)
        return self._wire[key]

    def _group_size(self) -> int:
        return self.microbatches // self.plan.updates_per_step

    def _call(self, weights: dict[str, torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) if weights is None else functional_call(self.module, weights, (x,))

    def _forward_weights(self) -> dict[str, torch.Tensor] | None:
        """The leaves a forward runs on. Flushing schedules use the module's parameters (no update
        happens between a forward and its backward). Under async an update may: with stashing the
        forward runs on a snapshot of the current version (one per version, shared by its
        microbatches); without, on aliases of the live storage that the update rewrites in place,
        so the backward sees the current weights (``.data`` aliases have their own version counter,
        so autograd accepts the in-place change, which here is the point)."""
        if self.plan.flushes:
            return None
        if not self.weight_stashing:
            return self._aliases()
        if self.version not in self._stash:
            self._stash[self.version] = self._snapshot()
            self.stash_peak = max(self.stash_peak, len(self._stash))
        self._stash_users[self.version] = self._stash_users.get(self.version, 0) + 1
        return self._stash[self.version]

    def _aliases(self) -> dict[str, torch.Tensor]:
        """The live parameters' storage as leaves of their own (the No-WS forward's weights)."""
        if self.cost_only is not None:
            return {}
        return {n: p.data.requires_grad_(True) for n, p in self.module.named_parameters()}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """A stashed weight version: a copy of every parameter, a leaf of its own (cost-only: an
        empty placeholder; its memory is ``stash_peak × param_bytes``)."""
        if self.cost_only is not None:
            return {}
        return {n: p.detach().clone().requires_grad_(True) for n, p in self.module.named_parameters()}

    def _collect_grads(self, record: InFlight) -> None:
        """Move a backward's gradients from the forward's leaves onto the module's parameters, in
        the order autograd itself would accumulate them (first assigned, later ones added)."""
        if record.weights is None:
            return
        for name, param in self.module.named_parameters():
            leaf = record.weights[name]
            if leaf.grad is None:
                continue
            if param.grad is None:
                param.grad = leaf.grad.clone()
            else:
                param.grad.add_(leaf.grad)
            leaf.grad = None
        self._release_stash(record)

    def _release_stash(self, record: InFlight) -> None:
        """One user fewer of the record's stashed version; an outdated version nobody uses goes."""
        if not self.weight_stashing:
            return
        users = self._stash_users[record.version] - 1
        self._stash_users[record.version] = users
        if users == 0 and record.version != self.version:
            del self._stash[record.version], self._stash_users[record.version]

    def _tampered(self, kind: Kind, step: int, m: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.tamper is None else self.tamper(kind, step, m, x)

    # --- the update --------------------------------------------------------------------------

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def dp_contribution(self, key: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
        """What leaves this worker of its part ``x`` of DP round ``key`` (update u, phase): the one
        seam where ``attack.target = dp`` corrupts, for every strategy (the flat gradient of the
        built-in all-reduce; the parts of message rounds) and both drivers. The attacker keeps the
        corrupted part as its own too, so it aggregates exactly what its peers do."""
        return self._tampered("dp", key[0] // self.plan.updates_per_step, key[1], x)

    def flat_gradients(self) -> torch.Tensor:
        """This worker's contribution to the built-in all-reduce at its next update: its
        gradients flattened in parameter order (``dp_contribution`` of round (version, 0))."""
        return self.dp_contribution((self.version, 0), torch.cat([g.reshape(-1) for g in self.grads()]))

    def set_flat_gradients(self, flat: torch.Tensor) -> None:
        """Write the stage's aggregate (``flat_gradients``' layout) into this worker's gradients."""
        offset = 0
        for g in self.grads():
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def note_dp_score(self, step: int, scores: list[float], u: int | None = None) -> None:
        """The outlier scores (``dp/robust.outlier_scores``, in replica order: every replica of the
        stage, as this worker computed them) of a robust reduce of this worker's update ``u``
        (default: the coming one, ``version``) of ``step``: reported with the step, per update,
        for attribution (``dp/attribution.py``). An update's score is the largest of its reduces'
        (PowerSGD: its P and Q rounds), replica by replica. Why all of them and not its own: a
        worker's score is then the median over its stage's rows (``mesh_report``), which no
        minority of the stage can set, the worker itself included."""
        u = self.version if u is None else u
        stats = self._stats(step).dp_scores
        before = stats.get(u, scores)
        stats[u] = [max(a, b) for a, b in zip(before, scores, strict=True)]

    def note_round_score(self, u: int, scores: list[float]) -> None:
        """The stage's outlier scores (replica order) in a robust round of its DP strategy (a sparse
        slice, PowerSGD factors, a DiLoCo pseudo-gradient) whose aggregate this worker merges at
        update ``u``: reported with that update's step, as the built-in all-reduce's scores are."""
        self.note_dp_score(u // self.plan.updates_per_step, scores, u)

    def grad_sq_norm(self) -> float:
        if self.cost_only is not None:
            return 0.0  # no values: clipping never scales (it would not change any time or byte)
        return float(sum(g.pow(2).sum() for g in self.grads()))

    def apply_update(self, action: Action, clip_coef: float, sq_norm: float) -> None:
        """Update U ``action``: scale gradients by the clip coefficient, set the lr of the step the
        update belongs to, step, zero; record the staleness of every gradient it applies."""
        assert action == self.next_action(), f"{self.id}: {action} not ready"
        step = action.microbatch // self.microbatches
        if clip_coef < 1.0:
            for g in self.grads():
                g.mul_(clip_coef)
        lr_factor = self.work[step].lr_factor
        if self.stage_lr_scale is not None:
            lr_factor *= self.stage_lr_scale(step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lr_factor
        # A gradient norm of exactly zero (``sq_norm``: the clip's norm, the mesh's or this stage's,
        # which every driver computes anyway) means every microbatch of the update was quarantined
        # (zero loss weight, zeroed gradients): no information. Stepping anyway would move the
        # weights along stale momentum and weight decay (measured with SENTINEL: the loss jumped
        # 4.10 → 4.73 after two fully quarantined steps), so the optimizer is left alone.
        if sq_norm != 0.0:  # a NaN norm still steps: divergence stays visible, as before
            if self.spectral is not None:
                self.spectral.begin_update(step)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._stats(step)
        stats.update_sq_norms.append(sq_norm)
        stats.staleness += [self.version - v for v in self._group_versions]
        self._group_versions = []
        self.version += 1
        self.plan.advance("U")
        stale = [v for v, users in self._stash_users.items() if users == 0 and v != self.version]
        for v in stale:
            del self._stash[v], self._stash_users[v]
        if (action.microbatch + 1) % self.microbatches == 0:
            del self.work[step]

    def spectate(self) -> Action:
        """Stand at the coming step's update without running its pipeline, every gradient zero:
        an elastic replica whose row does not train this step (it joined and waits for the rest
        of its row) takes part in its stage's mean with nothing, then applies the update its peers
        apply (``apply_update``), which keeps it identical to them. Returns that update."""
        assert self.idle and self.plan.flushes, f"{self.id}: spectating needs a flushing plan, when idle"
        for p in self.module.parameters():
            p.grad = torch.zeros_like(p)
        while (planned := self.plan.peek(self.horizon)) is not None and planned[0] != "U":
            self.plan.advance(planned[0])
        action = self.next_action()
        assert action is not None and action.kind == "U", f"{self.id}: no update to spectate"
        return action

    def abandon(self, step: int) -> Action:
        """Drop step ``step``'s pipeline work in flight — an elastic replica whose row broke in the
        middle of it (a partner died): its received messages, its open microbatches, their losses
        and gradients — and stand at the step's update like a spectator (``spectate``). The step
        cannot commit anywhere (its row was agreed to train it and no longer can)."""
        assert self.plan.flushes, f"{self.id}: abandoning a step needs a flushing plan"
        self.in_flight.clear()
        self.inbox.clear()
        self.skipped.clear()
        self._group_versions = []
        self.stats.pop(step, None)
        return self.spectate()

    def discard_update(self, action: Action) -> None:
        """Update U ``action`` that the mesh did not commit (an elastic step a replica failed in):
        the gradients are dropped, the weights and optimizer state stay as they were; the plan
        and the version move on as after ``apply_update``, so the next step runs as usual."""
        assert action == self.next_action(), f"{self.id}: {action} not ready"
        step = action.microbatch // self.microbatches
        self.optimizer.zero_grad(set_to_none=True)
        self._group_versions = []
        self.version += 1
        self.plan.advance("U")
        if (action.microbatch + 1) % self.microbatches == 0:
            del self.work[step]

    def _stats(self, step: int) -> StepStats:
        return self.stats.setdefault(step, StepStats())

    def pop_stats(self, step: int) -> StepStats:
        """The counters of ``step`` (once its updates are applied), forgotten here."""
        return self.stats.pop(step, StepStats())

    @property
    def stash_bytes(self) -> int:
        """Peak memory of stashed weight versions (the live weights not counted)."""
        return self.stash_peak * self.param_bytes

    def state_dict(self) -> dict:
        """Taken at drain points only: nothing is in flight, no stash is held."""
        assert self.idle, f"{self.id}: checkpoint outside a drain point"
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "version": self.version, "plan": self.plan.state(), "stash_peak": self.stash_peak,
                **({"dp": self.dp.state_dict()} if self.dp is not None else {}),
                **({"spectral": self.spectral.state_dict()} if self.spectral is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state.get("version", 0)
        if "plan" in state:
            self.plan.load_state(state["plan"])
        self.stash_peak = state.get("stash_peak", 0)
        if self.dp is not None and "dp" in state:
            self.dp.load_state_dict(state["dp"])
        if self.spectral is not None and "spectral" in state:
            self.spectral.load_state_dict(state["spectral"])
