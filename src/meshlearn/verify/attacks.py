"""Adversarial workers: named attacks on the tensors a worker sends across pipeline boundaries.

An attack is a callable ``(kind, step, microbatch, tensor) → tensor`` installed as a worker's
``tamper`` hook: it sees every activation (``act``) and activation gradient (``grad``) the worker is
about to encode and send, and returns what is sent instead. The worker's own forward and backward stay
honest, so the damage travels only through its messages (the SENTINEL threat model). Each attack has
its own seeded generator, so runs are reproducible; it stays passive before ``start_step``, on kinds
outside its ``target``, and once stopped (its worker was banned and replaced).

Writing a new attack: subclass ``Attack``, implement ``corrupt`` (return a new tensor, never modify
the input in place; return the input object itself to decline), optionally ``observe`` to keep
history, and add a factory to ``ATTACKS``::

    class Halve(Attack):
        name = "halve"
        def corrupt(self, kind, step, microbatch, x):
            return x * 0.5

Scales are relative to the message's own standard deviation, so one setting means the same on
activations and on gradients, whose magnitudes differ by orders of magnitude.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from meshlearn.compress.codecs import Kind
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.sentinel import BoundaryVerifier, VerifyConfig

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
    """Registry name: none, zeros, random, scaling, sign_flip, replay, bias, invisible_noise, mixed,
    adaptive."""
    workers: str = ""
    """Comma-separated attacker ids such as ``r1s2`` (replica 1, stage 2). The threat model keeps the
    first and last stages honest."""
    start_step: int = 0
    """Steps completed before the attack starts (0 = from the first step; 150 = halfway through the
    demo). Start after verify.warmup_steps, or the verifier learns the attack as normal."""
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
    """``replay``: send the tensor this worker sent for the same microbatch this many steps ago."""
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
        return self.stopped_at is None and step >= self.start_step and kind in self.kinds

    def __call__(self, kind: Kind, step: int, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        self.observe(kind, step, microbatch, x)
        if not self.active(kind, step):
            return x
        out = self.corrupt(kind, step, microbatch, x)
        if out is not x:
            self.changed.add((kind, step, microbatch))
        return out

    def observe(self, kind: Kind, step: int, microbatch: int, x: torch.Tensor) -> None:
        """Sees every tensor, before the attack starts too (for attacks that need history)."""

    def corrupt(self, kind: Kind, step: int, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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


ATTACKS: dict[str, Callable[[AttackConfig, int, VerifyConfig], Attack]] = {
    "zeros": lambda cfg, seed, verify: Zeros(cfg, seed),
    "random": lambda cfg, seed, verify: RandomValues(cfg, seed),
    "scaling": lambda cfg, seed, verify: Scaling(cfg, seed),
    "sign_flip": lambda cfg, seed, verify: SignFlip(cfg, seed),
    "replay": lambda cfg, seed, verify: Replay(cfg, seed),
    "bias": lambda cfg, seed, verify: Bias(cfg, seed),
    "invisible_noise": lambda cfg, seed, verify: InvisibleNoise(cfg, seed),
    "mixed": Mixed,
    "adaptive": Adaptive,
}


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
