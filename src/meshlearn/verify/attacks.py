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

The wire-level forgeries live in ``verify/forgeries.py`` (installed as the attacker's
``Worker.forge``; receivers refuse them in ``Worker.admit``); the base class in
``verify/attack_base.py``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from meshlearn.compress.codecs import Kind
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.attack_base import TARGETS, Attack, AttackConfig, message_std
from meshlearn.verify.forgeries import (
    FORGERIES,
    ForgeDtype,
    ForgeIds,
    ForgeKind,
    ForgeNonFinite,
    ForgeOversize,
    ForgeSender,
    ForgeShape,
    ForgeStale,
)
from meshlearn.verify.sentinel import BoundaryVerifier, VerifyConfig


class Zeros(Attack):
    """Sends zeros (a crashed or lazy worker)."""

    name = "zeros"

    def corrupt(self, kind, step, microbatch, x):
        return torch.zeros_like(x)


class RandomValues(Attack):
    """Sends Gaussian noise at the message's own std, unrelated to the data."""

    name = "random"

    def corrupt(self, kind, step, microbatch, x):
        return self.randn_like(x) * message_std(x)


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
        return x + self.cfg.bias * message_std(x) * self.channel_vector(x.shape[-1]).to(x.dtype)


class InvisibleNoise(Attack):
    """Adds zero-mean Gaussian noise of std ρ × (message std): small per value, averaged away by
    batch means, visible (if at all) only in the spread of the token distribution."""

    name = "invisible_noise"

    def corrupt(self, kind, step, microbatch, x):
        return x + self.cfg.noise_rho * message_std(x) * self.randn_like(x)


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
        out = super().__call__(kind, step, microbatch, x)
        shadow = self.shadows.get(kind)
        if shadow is None:  # a DP contribution: no pipeline verifier sees it, so nothing to mimic
            return out
        out = out.float()
        summary = shadow.summarize(out)
        shadow.accept((microbatch, 0), tuple(out.shape), summary, shadow.distances(summary),
                      out.norm().item())
        return out

    def corrupt(self, kind, step, microbatch, x):
        shadow = self.shadows[kind]
        if step < self.verify.warmup_steps or shadow.reference is None:
            return x
        direction = message_std(x) * self.channel_vector(x.shape[-1]).to(x.dtype)
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
    "forge_src": lambda cfg, seed, verify: ForgeSender(cfg, seed),
    "forge_kind": lambda cfg, seed, verify: ForgeKind(cfg, seed),
}
MIXABLE = sorted(set(ATTACKS) - {"mixed", "adaptive", *FORGERIES})
"""What ``mixed`` may switch among: the tensor attacks (it applies its parts' ``corrupt``)."""


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


# --- config checks ---------------------------------------------------------------------------


def validate_attack(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``attack.*`` run by ``config.validate`` (``cfg``: the RunConfig); ``require(ok, key,
    value, allowed)`` raises the ConfigError naming the field, its value and what is allowed."""
    a = cfg.attack
    require(a.kind == "none" or a.kind in ATTACKS, "attack.kind", a.kind,
            f"allowed: {['none', *sorted(ATTACKS)]}")
    require(a.target in TARGETS, "attack.target", a.target, f"allowed: {list(TARGETS)}")
    if a.target == "dp" and a.kind != "none":
        require(a.kind not in ("adaptive", *FORGERIES), "attack.kind", a.kind,
                "a tensor attack other than adaptive with attack.target = dp (DP parts are not "
                "pipeline messages, which forgeries rewrite and SENTINEL's shadow verifier scores)")
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
    if a.kind == "none":
        return
    ids = [w.strip() for w in a.workers.split(",") if w.strip()]
    require(bool(ids), "attack.workers", a.workers,
            "name the attackers, e.g. attack.workers=r1s2 (replica 1, stage 2)")
    for text in ids:
        error = _parse_error(text)
        require(error is None, "attack.workers", a.workers, error or "")


def _parse_error(text: str) -> str | None:
    """Why ``text`` is not a worker id, or None."""
    try:
        WorkerId.parse(text)
    except ValueError as err:
        return str(err)
    return None

