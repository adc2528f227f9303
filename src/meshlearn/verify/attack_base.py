"""What every attack shares: its config section (``attack.*``), the ``Attack`` base class with its
schedule (start step, period/duty, ramp, target kinds, stop on ban) and the scale helper.

The attacks themselves live in ``verify/attacks.py`` (tensor attacks and the registry) and
``verify/forgeries.py`` (wire-level forgeries and the arrival-path wiring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from meshlearn.compress.codecs import Kind
from meshlearn.mesh.messages import Message

MessageTamper = Callable[[Message], Message]
"""message → the message actually sent (a wire-level forgery); see ``Attack.forge``."""

TARGETS: dict[str, frozenset[str]] = {
    "activations": frozenset({"act"}),
    "gradients": frozenset({"grad"}),
    "both": frozenset({"act", "grad"}),
    "dp": frozenset({"dp"}),  # its part of every DP round (``Worker.dp_contribution``)
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
    """Comma-separated attacker ids such as ``r1s2`` (replica 1, stage 2). The first and last stages only
    where ``verify.trusted_ends`` verifies them (from 3 replicas by default)."""
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
    """What is corrupted: ``activations`` (forward), ``gradients`` (backward), ``both``, or ``dp``:
    the worker's contribution to its stage's data-parallel sync (the gradient it all-reduces, its
    sparse slice, its PowerSGD factors, its DiLoCo pseudo-gradient), with the step of the update
    the round belongs to; needs mesh.replicas >= 2 and a tensor attack (docs/dp_robust.md)."""
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

    def pop_changed(self, step: int | None = None) -> set[tuple[Kind, int, int]]:
        """The messages changed so far (``step``: only those of steps up to it; later steps', sent
        ahead under the async schedule, stay for their own step's end)."""
        if step is None:
            changed, self.changed = self.changed, set()
            return changed
        changed = {c for c in self.changed if c[1] <= step}
        self.changed -= changed
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


def message_std(x: torch.Tensor) -> torch.Tensor:
    return x.float().std().clamp_min(1e-30)
