"""Adversarial workers: named attacks on what a worker sends across pipeline boundaries.

An attack has two hooks. As a callable ``(kind, step, microbatch, tensor) → tensor`` it is installed
as a worker's ``tamper`` hook: it sees every activation (``act``) and activation gradient (``grad``)
the worker is about to encode and send, and returns what is sent instead. As ``forge(message) →
message`` (a ``MessageTamper``) it sees the encoded message itself and can lie on the wire: token ids
out of range, a wrong shape or dtype, non-finite values, an oversized or a stale message — what
``meshlearn.compress.wire_checks`` makes receivers reject. Tensor attacks leave the message alone and
wire forgeries leave the tensor alone. The worker's own forward and backward stay honest, so the
damage travels only through its messages (the SENTINEL threat model). Each attack has its own seeded
generator, so runs are reproducible; it stays passive before ``start_step``, in the off part of its
``period``, on kinds outside its ``target``, and once stopped (its worker was banned and replaced).
With ``ramp_steps`` a tensor attack fades in: the sent tensor is X + r·(attack(X) − X) with r rising
linearly from 1/ramp_steps to 1 (slow drift of a bias, noise or scale).

Writing a new attack: subclass ``Attack``, implement ``corrupt`` (return a new tensor, never modify
the input in place; return the input object itself to decline), optionally ``observe`` to keep
history, and add a factory to ``ATTACKS``::

    class Halve(Attack):
        name = "halve"
        def corrupt(self, kind, step, microbatch, x):
            return x * 0.5

Scales are relative to the message's own standard deviation, so one setting means the same on
activations and on gradients, whose magnitudes differ by orders of magnitude.

The simulator's driver has one monitor slot and the worker no message hook yet, so ``attach_wire``
puts the forgeries and the receivers' guards on the arrival path, in front of the verifier.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from meshlearn.compress.codecs import Encoded, Kind
from meshlearn.compress.wire_checks import INDEX_FIELDS, GuardedArrival, WireGuard
from meshlearn.mesh.messages import Message, MessageMonitor
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.sentinel import BoundaryVerifier, VerifyConfig

if TYPE_CHECKING:  # config.py and the trainer import this module
    from meshlearn.config import RunConfig
    from meshlearn.train import Trainer

MessageTamper = Callable[[Message], Message]
"""message → the message actually sent (a wire-level forgery); see ``Attack.forge``."""

TARGETS: dict[str, frozenset[str]] = {
    "activations": frozenset({"act"}),
    "gradients": frozenset({"grad"}),
    "both": frozenset({"act", "grad"}),
}


@dataclass(frozen=True)
class AttackConfig:
    """Adversarial workers for robustness experiments. Config keys under ``attack.``.

    From the command line one attack applies to every listed worker; the Python API
    (``TrustLayer.add_attack``) can give each worker its own.
    """

    kind: str = "none"
    """Registry name: none, zeros, random, scaling, sign_flip, replay, bias, invisible_noise, permute,
    mixed, adaptive; or a wire forgery: forge_ids, forge_shape, forge_dtype, forge_nonfinite,
    forge_oversize, forge_stale (receivers reject those, see meshlearn.compress.wire_checks)."""
    workers: str = ""
    """Comma-separated attacker ids such as ``r1s2`` (replica 1, stage 2). The threat model keeps the
    first and last stages honest."""
    start_step: int = 0
    """Steps completed before the attack starts (0 = from the first step; 150 = halfway through the
    demo). Before verify.warmup_steps it attacks the warm-up: the verifier may learn it as normal."""
    period: int = 0
    """Intermittent attack: with period > 0 it is on for the first ``duty`` of every ``period`` steps
    counted from start_step, off (honest) for the rest; 0 = always on."""
    duty: int = 1
    """Steps on per ``period`` (1..period)."""
    ramp_steps: int = 0
    """Slow drift: a tensor attack fades in linearly over this many steps from its start, sending
    X + r·(attack(X) − X), r = 1/ramp_steps … 1 (with ``bias``: a bias growing from ~0); 0 = full
    strength at once. Not for adaptive or wire forgeries."""
    target: str = "both"
    """What is corrupted: ``activations`` (forward), ``gradients`` (backward) or ``both``."""
    seed: int = 0
    """Seeds every attacker's generator (combined with its worker id)."""
    scale: float = -1.0
    """``scaling``: the factor c in c·X (−1 reverses the message; 10 inflates; 0.1 shrinks)."""
    sign_fraction: float = 0.5
    """``sign_flip``: fraction of channels (a fixed random subset) whose sign is flipped; norms are
    unchanged, so only direction-aware metrics can see it."""
    replay_delay: int = 100
    """``replay``: send the tensor this worker sent for the same microbatch this many steps ago;
    ``forge_stale``: send that step's whole message, with its old step number."""
    bias: float = 1.0
    """``bias``: add a fixed random per-channel vector of this RMS, in units of the message's std."""
    noise_rho: float = 0.5
    """``invisible_noise``: add Gaussian noise of std ρ · (message std); ρ is reported with results."""
    mixed_kinds: str = "zeros,random,scaling,sign_flip,replay,bias,invisible_noise"
    """``mixed``: the attacks it switches among."""
    mixed_period: int = 5
    """``mixed``: steps between switches (the next attack is drawn at random)."""
    adaptive_margin: float = 0.5
    """``adaptive``: how far toward its shadow verifier's fence each distance may go, from the median
    honest distance (0) to the fence itself (1)."""
    adaptive_max: float = 4.0
    """``adaptive``: the largest bias it tries, in units of the message's std (halved until it fits)."""
    oversize_factor: float = 10.0
    """``forge_oversize``: pad each message with this many times its honest size in extra bytes."""


class Attack:
    """Base class: activity window, generator, and the record of what was actually changed."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: AttackConfig, seed: int):
        self.cfg = cfg
        self.start_step = cfg.start_step
        self.kinds = TARGETS[cfg.target]
        self.generator = torch.Generator().manual_seed(seed)
        self.stopped_at: int | None = None
        self.changed: set[tuple[Kind, int, int]] = set()  # ground truth, drained by the harness
        self._channels: torch.Tensor | None = None

    def active(self, kind: Kind, step: int) -> bool:
        """Started, not stopped, in the on part of its period, and aimed at this direction."""
        if self.stopped_at is not None or step < self.start_step or kind not in self.kinds:
            return False
        return self.cfg.period == 0 or (step - self.start_step) % self.cfg.period < self.cfg.duty

    def ramp(self, step: int) -> float:
        """The attack's strength r at ``step``: linear from 1/ramp_steps at its start to 1."""
        if self.cfg.ramp_steps == 0:
            return 1.0
        return min(1.0, (step - self.start_step + 1) / self.cfg.ramp_steps)

    def __call__(self, kind: Kind, step: int, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        self.observe(kind, step, microbatch, x)
        if not self.active(kind, step):
            return x
        out = self.corrupt(kind, step, microbatch, x)
        if out is not x:
            r = self.ramp(step)
            if r < 1.0:
                out = x + r * (out - x)
            self.changed.add((kind, step, microbatch))
        return out

    def forge(self, message: Message) -> Message:
        """The message-level hook: sees every message this worker sends, after encoding, and returns
        what goes on the wire. Tensor attacks return it unchanged."""
        self.observe_message(message)
        if not self.active(message.kind, message.step):
            return message
        out = self.forge_message(message)
        if out is not message:
            self.changed.add((message.kind, message.step, message.microbatch))
        return out

    def observe(self, kind: Kind, step: int, microbatch: int, x: torch.Tensor) -> None:
        """Sees every tensor, before the attack starts too (for attacks that need history)."""

    def observe_message(self, message: Message) -> None:
        """Sees every message, before the attack starts too (for forgeries that need history)."""

    def corrupt(self, kind: Kind, step: int, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forge_message(self, message: Message) -> Message:
        """A wire forgery; return the message object itself to decline (tensor attacks always do)."""
        return message

    def stop(self, step: int) -> None:
        """The worker was banned and replaced by an honest peer: the attack ends."""
        self.stopped_at = step

    def pop_changed(self) -> set[tuple[Kind, int, int]]:
        changed, self.changed = self.changed, set()
        return changed

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.randn(x.shape, generator=self.generator, dtype=torch.float32).to(x.dtype)

    def channel_vector(self, channels: int) -> torch.Tensor:
        """A fixed random N(0, 1) vector over channels, drawn on first use (so it never changes)."""
        if self._channels is None or self._channels.shape[0] != channels:
            self._channels = torch.randn(channels, generator=self.generator)
        return self._channels

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "stopped_at": self.stopped_at,
                "channels": self._channels}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.stopped_at = state["stopped_at"]
        self._channels = state["channels"]


def _std(x: torch.Tensor) -> torch.Tensor:
    return x.float().std().clamp_min(1e-30)


class Zeros(Attack):
    """Sends zeros (a crashed or lazy worker)."""

    name = "zeros"

    def corrupt(self, kind, step, microbatch, x):
        return torch.zeros_like(x)


class RandomValues(Attack):
    """Sends Gaussian noise at the message's own std, unrelated to the data."""

    name = "random"

    def corrupt(self, kind, step, microbatch, x):
        return self.randn_like(x) * _std(x)


class Scaling(Attack):
    """Sends c·X (``attack.scale``): −1 reverses activations or gradients, |c| ≫ 1 blows them up."""

    name = "scaling"

    def corrupt(self, kind, step, microbatch, x):
        return x * self.cfg.scale


class SignFlip(Attack):
    """Flips the sign of a fixed random subset of channels: every norm is preserved."""

    name = "sign_flip"

    def __init__(self, cfg: AttackConfig, seed: int):
        super().__init__(cfg, seed)
        self._mask: torch.Tensor | None = None

    def corrupt(self, kind, step, microbatch, x):
        channels = x.shape[-1]
        if self._mask is None or self._mask.shape[0] != channels:
            count = round(self.cfg.sign_fraction * channels)
            flips = torch.randperm(channels, generator=self.generator)[:count]
            self._mask = torch.ones(channels)
            self._mask[flips] = -1.0
        return x * self._mask.to(x.dtype)

    def state_dict(self) -> dict:
        return super().state_dict() | {"mask": self._mask}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._mask = state["mask"]


class Replay(Attack):
    """Sends what it sent for the same microbatch ``replay_delay`` steps ago (stale but real data).

    Keeps its own history of the kinds it targets (delay + 1 steps of them); before it has that much,
    it replays the oldest it has.
    """

    name = "replay"

    def __init__(self, cfg: AttackConfig, seed: int):
        super().__init__(cfg, seed)
        self.history: dict[tuple[Kind, int], deque[torch.Tensor]] = {}

    def observe(self, kind, step, microbatch, x):
        if kind in self.kinds and self.stopped_at is None:
            queue = self.history.setdefault((kind, microbatch), deque(maxlen=self.cfg.replay_delay + 1))
            queue.append(x.detach().clone())

    def corrupt(self, kind, step, microbatch, x):
        return self.history[(kind, microbatch)][0].clone()

    def state_dict(self) -> dict:
        return super().state_dict() | {"history": {f"{k}:{m}": list(q) for (k, m), q in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.history = {}
        for key, tensors in state["history"].items():
            kind, m = key.split(":")
            self.history[(kind, int(m))] = deque(tensors, maxlen=self.cfg.replay_delay + 1)


class Bias(Attack):
    """Adds a fixed random per-channel vector of RMS ``bias`` × (message std)."""

    name = "bias"

    def corrupt(self, kind, step, microbatch, x):
        return x + self.cfg.bias * _std(x) * self.channel_vector(x.shape[-1]).to(x.dtype)


class InvisibleNoise(Attack):
    """Adds zero-mean Gaussian noise of std ρ × (message std): small per value, averaged away by
    batch means, visible (if at all) only in the spread of the token distribution."""

    name = "invisible_noise"

    def corrupt(self, kind, step, microbatch, x):
        return x + self.cfg.noise_rho * _std(x) * self.randn_like(x)


class Permute(Attack):
    """Sends the microbatch's sequences in a shuffled order (a random derangement per message).

    Every per-position batch mean, pooled quantile and norm is unchanged: only statistics keyed to
    sequence identity can see it. Declines on a microbatch of one sequence.
    """

    name = "permute"

    def corrupt(self, kind, step, microbatch, x):
        b = x.shape[0]
        if b < 2:
            return x
        # A cyclic shift conjugated by a random permutation: no sequence keeps its slot.
        perm = torch.randperm(b, generator=self.generator)
        shift = int(torch.randint(1, b, (1,), generator=self.generator))
        return x[perm[(torch.argsort(perm) + shift) % b]]


class Mixed(Attack):
    """Switches every ``mixed_period`` steps to an attack drawn at random from ``mixed_kinds``.

    Every sub-attack observes all traffic (so a replay sub-attack has its history when drawn).
    """

    name = "mixed"

    def __init__(self, cfg: AttackConfig, seed: int, verify: VerifyConfig):
        super().__init__(cfg, seed)
        names = [k.strip() for k in cfg.mixed_kinds.split(",") if k.strip()]
        self.parts = [build_attack(n, cfg, seed + 1 + i, verify) for i, n in enumerate(names)]
        self.current = 0
        self.period: int | None = None

    def observe(self, kind, step, microbatch, x):
        for part in self.parts:
            part.observe(kind, step, microbatch, x)

    def corrupt(self, kind, step, microbatch, x):
        period = (step - self.start_step) // self.cfg.mixed_period
        if period != self.period:
            self.period = period
            self.current = int(torch.randint(len(self.parts), (1,), generator=self.generator))
        return self.parts[self.current].corrupt(kind, step, microbatch, x)

    def state_dict(self) -> dict:
        return super().state_dict() | {"parts": [p.state_dict() for p in self.parts],
                                       "current": self.current, "period": self.period}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for part, part_state in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(part_state)
        self.current, self.period = state["current"], state["period"]


class Adaptive(Attack):
    """A white-box mimic: knows SENTINEL's algorithm and settings and tries to stay under its fences.

    It runs a shadow ``BoundaryVerifier`` per kind on its own outgoing traffic (the only traffic it
    sees) and, for each message, adds the largest bias ``α · std · v`` (v a fixed random channel
    vector; α = adaptive_max, halved up to 8 times, else 0) whose distances all stay below
    median + adaptive_margin · (fence − median) of the shadow's windows. The shadow accepts what was
    sent, so its reference — and the real verifier's, in part — drifts toward the attack: the
    "mimicry and drift" pitfall.
    """

    name = "adaptive"
    HALVINGS = 8

    def __init__(self, cfg: AttackConfig, seed: int, verify: VerifyConfig):
        super().__init__(cfg, seed)
        self.verify = verify
        self.shadows = {kind: BoundaryVerifier(verify, verify.beta_act if kind == "act" else verify.beta_grad)
                        for kind in ("act", "grad")}
        self.shadow_step = -1
        self.limits: dict[str, dict[str, float]] = {}  # per kind and metric, for the current step
        self.alphas: list[float] = []  # chosen α per attacked message, for the damage report

    def observe(self, kind, step, microbatch, x):
        if step != self.shadow_step:  # the shadow, like the verifier, updates between steps
            margin = self.cfg.adaptive_margin
            for k, shadow in self.shadows.items():
                shadow.commit()
                if step == self.verify.warmup_steps and self.verify.fpr_target > 0:
                    shadow.calibrate(self.verify.fpr_target)  # as the real verifier does
                self.limits[k] = {}
                for m, fence in shadow.fences.items():
                    median = statistics.median(fence.values) if fence.values else math.inf
                    self.limits[k][m] = median + margin * (shadow.thresholds[m] - median)
            self.shadow_step = step

    def __call__(self, kind, step, microbatch, x):
        out = super().__call__(kind, step, microbatch, x).float()
        shadow = self.shadows[kind]
        summary = shadow.summarize(out)
        shadow.accept((microbatch, 0), tuple(out.shape), summary, shadow.distances(summary),
                      out.norm().item())
        return out

    def corrupt(self, kind, step, microbatch, x):
        shadow = self.shadows[kind]
        if step < self.verify.warmup_steps or shadow.reference is None:
            return x
        direction = _std(x) * self.channel_vector(x.shape[-1]).to(x.dtype)
        alpha = self.cfg.adaptive_max
        for _ in range(self.HALVINGS + 1):
            candidate = x + alpha * direction
            if self._passes(shadow, self.limits[kind], candidate):
                self.alphas.append(alpha)
                return candidate
            alpha /= 2
        self.alphas.append(0.0)
        return x

    @staticmethod
    def _passes(shadow: BoundaryVerifier, limits: dict[str, float], candidate: torch.Tensor) -> bool:
        if shadow.sanity(candidate.float(), candidate.float().norm().item()):
            return False
        distances = shadow.distances(shadow.summarize(candidate.float()))
        return all(math.isfinite(limits[m]) and d <= limits[m] for m, d in distances.items())

    def state_dict(self) -> dict:
        return super().state_dict() | {"shadows": {k: s.state_dict() for k, s in self.shadows.items()},
                                       "shadow_step": self.shadow_step, "limits": self.limits,
                                       "alphas": list(self.alphas)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for kind, shadow in self.shadows.items():
            shadow.load_state_dict(state["shadows"][kind])
        self.shadow_step, self.limits = state["shadow_step"], state["limits"]
        self.alphas = list(state["alphas"])


# --- wire-level forgeries: the tensor is honest, the message lies ------------------------------


class Forgery(Attack):
    """Base of the wire forgeries: leaves the tensor alone and rewrites the encoded payload."""

    def corrupt(self, kind, step, microbatch, x):
        return x

    def forge_message(self, message: Message) -> Message:
        payload = self.forge_payload(message.payload)
        return message if payload is None else dataclasses.replace(message, payload=payload)

    def forge_payload(self, payload: Encoded) -> Encoded | None:
        """The forged payload, or None to decline (nothing to forge in this codec's format)."""
        raise NotImplementedError


def _with_tensors(payload: Encoded, tensors: dict[str, torch.Tensor]) -> Encoded:
    """The payload's header (shape, dtype, meta) over other tensors: the original stays untouched."""
    return Encoded(tensors, payload.shape, payload.dtype, dict(payload.meta))


class ForgeIds(Forgery):
    """Index fields out of range: token ids (subspace activations) or top-k positions become −1 and
    the dtype's maximum. Unchecked, the receiver's table lookup or scatter raises."""

    name = "forge_ids"

    def forge_payload(self, payload):
        names = [n for n in INDEX_FIELDS if n in payload.tensors]
        if not names:
            return None
        tensors = dict(payload.tensors)
        for name in names:
            forged = tensors[name].clone().reshape(-1)
            forged[:] = torch.iinfo(forged.dtype).max
            forged[0] = -1
            tensors[name] = forged.reshape(payload.tensors[name].shape)
        return _with_tensors(payload, tensors)


class ForgeShape(Forgery):
    """Every field one row short along its first dimension, the header unchanged (a lie about size)."""

    name = "forge_shape"

    def forge_payload(self, payload):
        return _with_tensors(payload, {n: t[:-1].clone() for n, t in payload.tensors.items()})


SAME_WIDTH = {torch.float32: torch.int32, torch.int32: torch.float32, torch.bfloat16: torch.int16,
              torch.float16: torch.int16, torch.int16: torch.float16, torch.int8: torch.uint8,
              torch.uint8: torch.int8, torch.float64: torch.int64, torch.int64: torch.float64}


class ForgeDtype(Forgery):
    """Every field's bits reinterpreted as another dtype of the same width: same bytes, wrong type."""

    name = "forge_dtype"

    def forge_payload(self, payload):
        return _with_tensors(payload, {n: t.view(SAME_WIDTH[t.dtype]) for n, t in payload.tensors.items()})


class ForgeNonFinite(Forgery):
    """A NaN and an inf in every floating field (values, scales or coefficients)."""

    name = "forge_nonfinite"

    def forge_payload(self, payload):
        tensors = dict(payload.tensors)
        floats = [n for n, t in tensors.items() if t.is_floating_point()]
        if not floats:
            return None
        for name in floats:
            forged = tensors[name].clone().reshape(-1)
            forged[0], forged[-1] = float("nan"), float("inf")
            tensors[name] = forged.reshape(payload.tensors[name].shape)
        return _with_tensors(payload, tensors)


class ForgeOversize(Forgery):
    """An extra field of ``oversize_factor`` × the honest size: a flood the receiver must not buffer."""

    name = "forge_oversize"

    def forge_payload(self, payload):
        padding = torch.zeros(math.ceil(self.cfg.oversize_factor * payload.wire_bytes), dtype=torch.uint8)
        return _with_tensors(payload, dict(payload.tensors) | {"padding": padding})


class ForgeStale(Forgery):
    """Sends, for (kind, microbatch), its own message from ``replay_delay`` steps earlier with that
    step's number (the oldest it kept, early on); declines while it has no earlier step."""

    name = "forge_stale"

    def __init__(self, cfg: AttackConfig, seed: int):
        super().__init__(cfg, seed)
        self.history: dict[tuple[Kind, int], deque[tuple[int, Encoded]]] = {}

    def observe_message(self, message):
        if message.kind in self.kinds and self.stopped_at is None:
            queue = self.history.setdefault((message.kind, message.microbatch),
                                            deque(maxlen=self.cfg.replay_delay + 1))
            queue.append((message.step, message.payload))

    def forge_message(self, message):
        step, payload = self.history[(message.kind, message.microbatch)][0]
        if step == message.step:
            return message
        return dataclasses.replace(message, step=step, payload=payload)

    def state_dict(self) -> dict:
        return super().state_dict() | {"history": {f"{k}:{m}": [(t, p.tensors, p.shape, p.dtype, p.meta)
                                                                for t, p in q]
                                                   for (k, m), q in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.history = {}
        for key, entries in state["history"].items():
            kind, m = key.split(":")
            self.history[(kind, int(m))] = deque(
                [(t, Encoded(tensors, tuple(shape), dtype, dict(meta))) for t, tensors, shape, dtype, meta
                 in entries], maxlen=self.cfg.replay_delay + 1)


FORGERIES = ("forge_ids", "forge_shape", "forge_dtype", "forge_nonfinite", "forge_oversize", "forge_stale")

ATTACKS: dict[str, Callable[[AttackConfig, int, VerifyConfig], Attack]] = {
    "zeros": lambda cfg, seed, verify: Zeros(cfg, seed),
    "random": lambda cfg, seed, verify: RandomValues(cfg, seed),
    "scaling": lambda cfg, seed, verify: Scaling(cfg, seed),
    "sign_flip": lambda cfg, seed, verify: SignFlip(cfg, seed),
    "replay": lambda cfg, seed, verify: Replay(cfg, seed),
    "bias": lambda cfg, seed, verify: Bias(cfg, seed),
    "invisible_noise": lambda cfg, seed, verify: InvisibleNoise(cfg, seed),
    "permute": lambda cfg, seed, verify: Permute(cfg, seed),
    "mixed": Mixed,
    "adaptive": Adaptive,
    "forge_ids": lambda cfg, seed, verify: ForgeIds(cfg, seed),
    "forge_shape": lambda cfg, seed, verify: ForgeShape(cfg, seed),
    "forge_dtype": lambda cfg, seed, verify: ForgeDtype(cfg, seed),
    "forge_nonfinite": lambda cfg, seed, verify: ForgeNonFinite(cfg, seed),
    "forge_oversize": lambda cfg, seed, verify: ForgeOversize(cfg, seed),
    "forge_stale": lambda cfg, seed, verify: ForgeStale(cfg, seed),
}
MIXABLE = sorted(set(ATTACKS) - {"mixed", "adaptive", *FORGERIES})
"""What ``mixed`` may switch among: the tensor attacks (it applies its parts' ``corrupt``)."""
INDEX_CODECS = ("subspace", "topk")
"""Codecs whose payloads carry index fields (token ids, positions) for ``forge_ids`` to forge."""


def build_attack(kind: str, cfg: AttackConfig, seed: int, verify: VerifyConfig | None = None) -> Attack:
    """One attack by registry name; ``verify`` is what an adaptive attacker knows about the defence."""
    if kind not in ATTACKS:
        raise ValueError(f"attack.kind = {kind!r} is unknown; registered attacks: {sorted(ATTACKS)}")
    return ATTACKS[kind](cfg, seed, verify or VerifyConfig(name="sentinel"))


def attacked_workers(cfg: AttackConfig) -> list[WorkerId]:
    """The ids in ``attack.workers`` (empty when no attack is configured)."""
    if cfg.kind == "none":
        return []
    return [WorkerId.parse(w) for w in cfg.workers.split(",") if w.strip()]


def build_attacks(cfg: AttackConfig, verify: VerifyConfig, mesh: MeshShape,
                  seed: int) -> dict[WorkerId, Attack]:
    """The configured attack on every listed worker, each with its own generator."""
    return {wid: build_attack(cfg.kind, cfg, seed * 7919 + cfg.seed * 104729 + mesh.rank(wid), verify)
            for wid in attacked_workers(cfg)}


# --- the wire: forgeries and receivers' guards on the arrival path ---------------------------


class WireTap:
    """A ``MessageMonitor`` standing for the wire: each attacker's ``forge`` rewrites its messages,
    then the next monitor (the receivers' guards, a verifier) sees what arrives.

    On the arrival path the link has already charged the honest size; a sender-side hook (the
    worker applying ``forge`` to what it sends) would charge an oversized message its real bytes.
    """

    def __init__(self, attacks: Mapping[WorkerId, Attack], monitor: MessageMonitor | None = None):
        self.attacks = attacks
        self.monitor = monitor

    def inspect(self, message: Message) -> Message:
        attack = self.attacks.get(message.src)
        if attack is not None:
            message = attack.forge(message)
        return message if self.monitor is None else self.monitor.inspect(message)


def attach_wire(trainer: Trainer) -> dict[WorkerId, WireGuard]:
    """Put forgeries and receiver-side checks on ``trainer``'s arrival path, in front of its verifier.

    Every worker gets a ``WireGuard`` over its own codec; the driver's monitor becomes
    forgeries → guards → SENTINEL (if on). Returns the guards, whose ``pop_rejections`` hold the
    records of refused messages. Call it once, after building the trainer and before training.
    """
    cfg = trainer.cfg
    guards = {wid: WireGuard(worker.codec, cfg.model.seq_len, cfg.model.d_model, cfg.model.vocab_size)
              for wid, worker in trainer.workers.items()}
    trust = trainer.plugins["trust"].trust
    arrival = GuardedArrival(guards, trainer.workers, trust.sentinel)
    trainer.driver.monitors.clear()  # the chain below ends in the verifier itself
    trainer.driver.attach_monitor(WireTap(trust.attacks, arrival), cfg.verify.charge_time)
    return guards


# --- config checks ---------------------------------------------------------------------------


def validate_attack(cfg: RunConfig, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``attack.*`` run by ``config.validate``; ``require(ok, key, value, allowed)`` raises
    the ConfigError naming the field, its value and what is allowed."""
    a, mesh = cfg.attack, cfg.mesh
    require(a.kind == "none" or a.kind in ATTACKS, "attack.kind", a.kind,
            f"allowed: {['none', *sorted(ATTACKS)]}")
    require(a.target in TARGETS, "attack.target", a.target, f"allowed: {list(TARGETS)}")
    require(a.start_step >= 0, "attack.start_step", a.start_step, "must be >= 0")
    require(a.period >= 0, "attack.period", a.period, "must be >= 0 (0 = always on)")
    if a.period:
        require(1 <= a.duty <= a.period, "attack.duty", a.duty, f"in [1, attack.period = {a.period}]")
    require(a.ramp_steps >= 0, "attack.ramp_steps", a.ramp_steps, "must be >= 0 (0 = no ramp)")
    if a.ramp_steps:
        require(a.kind not in ("adaptive", *FORGERIES), "attack.ramp_steps", a.ramp_steps,
                f"0 for attack.kind = {a.kind!r}: only tensor attacks other than adaptive fade in")
    require(a.replay_delay >= 1, "attack.replay_delay", a.replay_delay, "must be >= 1")
    require(a.mixed_period >= 1, "attack.mixed_period", a.mixed_period, "must be >= 1")
    require(0 <= a.sign_fraction <= 1, "attack.sign_fraction", a.sign_fraction, "in [0, 1]")
    require(0 < a.adaptive_margin <= 1, "attack.adaptive_margin", a.adaptive_margin, "in (0, 1]")
    require(a.adaptive_max > 0, "attack.adaptive_max", a.adaptive_max, "must be > 0")
    require(a.oversize_factor > 0, "attack.oversize_factor", a.oversize_factor, "must be > 0")
    kinds = [k.strip() for k in a.mixed_kinds.split(",") if k.strip()]
    require(bool(kinds) and set(kinds) <= set(MIXABLE), "attack.mixed_kinds", a.mixed_kinds,
            f"comma-separated, from {MIXABLE}")
    if a.kind == "forge_ids":
        require(cfg.codec.name in INDEX_CODECS, "attack.kind", a.kind,
                f"forges index fields, which only codec.name in {list(INDEX_CODECS)} sends "
                f"(codec.name = {cfg.codec.name!r})")
    if a.kind == "none":
        return
    ids = [w.strip() for w in a.workers.split(",") if w.strip()]
    require(bool(ids), "attack.workers", a.workers,
            "name the attackers, e.g. attack.workers=r1s2 (replica 1, stage 2)")
    middle = (f"stages 1..{mesh.stages - 2}" if mesh.stages > 2
              else "none: the mesh needs at least 3 stages to have an attackable one")
    for text in ids:
        error = _parse_error(text)
        require(error is None, "attack.workers", a.workers, error or "")
        wid = WorkerId.parse(text)
        require(wid.replica < mesh.replicas and wid.stage < mesh.stages, "attack.workers", a.workers,
                f"{text} is not in the mesh of {mesh.replicas} replicas × {mesh.stages} stages")
        require(0 < wid.stage < mesh.stages - 1, "attack.workers", a.workers,
                f"{text}: the first and last stages are honest in SENTINEL's threat model; "
                f"attackers may sit on {middle}")


def _parse_error(text: str) -> str | None:
    """Why ``text`` is not a worker id, or None."""
    try:
        WorkerId.parse(text)
    except ValueError as err:
        return str(err)
    return None
