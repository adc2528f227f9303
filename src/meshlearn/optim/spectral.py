"""Spectral correction: denoise masked gradients with a low-rank prior from clean anchor gradients.

Method note ``mesh_adaptation.md`` (arXiv 2609.14339). The fast circuit's gradients are noisy (the
mask codec drops most boundary entries); an anchor circuit occasionally computes clean, unmasked
gradients of the same matrices on stale weights. Per targeted matrix W (q, k, v, o, gate, up, down;
never norms, biases, embeddings or the head):

    on anchor arrival:  M ← β_anc·M + (1 − β_anc)·G_anchor ;  M = U S Vᵀ   (thin SVD, fp32, only here)
    before every step:  D = diag(s_i / (s_i + τ)) ;  G_filt = U·D·(UᵀGV)·D·Vᵀ
                        G ← α·G + (1 − α)·G_filt   → the base optimizer (AdamW, ...)

The filter is linear in G (it commutes with data-parallel averaging), damps entry (i, j) of UᵀGV by
d_i·d_j ∈ [0, 1], and so never increases ‖G‖_F; α = 1 is the base optimizer. τ is ``absolute`` (in
gradient units: it depends on the loss normalization and the model size) or ``relative`` (τ·s_max
of each matrix). The first arrival sets M to that gradient (no zero start: with an absolute τ a
zero-started EMA would shrink the first spectra by 1 − β_anc).

Two entry points for the anchor circuit: ``receive_anchor(name, grad, step, now)`` folds a clean
gradient into this worker's own EMA and recomputes the SVD (the note's "simulation mode");
``receive_basis(name, basis, step, now)`` installs a basis the anchor computed from the EMA it keeps
itself (its top-r factors, open detail 3: no EMA or SVD here). Arrivals are indexed by the step they
were computed for; one more than ``max_staleness`` steps old, or older than the last one installed,
is dropped. Until something arrives a matrix has no basis and its gradient passes
unchanged, so without an anchor circuit (``anchor.z = 0``) the correction is inert: the run is the
base optimizer's, bit for bit. The simulator's anchor circuit (``meshlearn.anchor``) feeds it.

Usage, with or without the mesh::

    correction = SpectralCorrection(model.named_parameters(), SpectralConfig(enabled=True))
    correction.attach(optimizer)            # runs before every optimizer.step()
    correction.receive_anchor("layers.0.attn.q.weight", clean_grad, step=t - 20, now=t)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from meshlearn.optim.error_feedback import AnchorErrorFeedback

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class SpectralConfig:
    """The spectral correction of targeted matrices' gradients (``optim.spectral.*``)."""

    enabled: bool = False
    """Attach the correction to every worker's optimizer. Inert until anchor gradients arrive
    (``anchor.z`` > 0 runs the anchor circuit that sends them; without it a run with the
    correction on equals one without)."""
    alpha: float = 0.3
    """Weight of the raw gradient in the blend α·G + (1 − α)·G_filt, in [0, 1]. 1 = the base
    optimizer; 0 trusts the (stale) anchor geometry fully (the paper: 0 → 0.26, 0.3 → 0.32, 1 → 0.18
    MedQA accuracy)."""
    tau: float = 1e-3
    """τ of the damping s_i / (s_i + τ), >= 0. Absolute: in the units of the anchor EMA's singular
    values (scale it with the loss normalization and model size); relative: a fraction of each
    matrix's largest singular value. The paper's 1e-3 is absolute."""
    tau_mode: Literal["absolute", "relative"] = "absolute"
    """``absolute`` or ``relative`` (τ·s_max per matrix)."""
    beta_anc: float = 0.95
    """Decay of the anchor-gradient EMA per arrival, in [0, 1) (an older sketch of the paper uses
    0.99; 0 keeps only the latest arrival)."""
    targets: str = "q,k,v,o,gate,up,down"
    """Comma-separated matrix names to correct, from q, k, v, o, gate, up, down (the ``.weight`` of
    those linear layers in every block)."""
    max_staleness: int = 30
    """Arrivals computed more than this many steps before the current step are dropped (>= 0)."""


def target_names(cfg: SpectralConfig) -> tuple[str, ...]:
    return tuple(t.strip() for t in cfg.targets.split(",") if t.strip())


def validate_spectral(cfg: SpectralConfig, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``optim.spectral.*``; ``require(ok, key, value, allowed)`` raises the ConfigError."""
    require(0 <= cfg.alpha <= 1, "optim.spectral.alpha", cfg.alpha, "in [0, 1] (1 = no correction)")
    require(cfg.tau >= 0, "optim.spectral.tau", cfg.tau, "must be >= 0")
    require(0 <= cfg.beta_anc < 1, "optim.spectral.beta_anc", cfg.beta_anc, "in [0, 1)")
    names = target_names(cfg)
    unknown = [n for n in names if n not in TARGETS]
    require(bool(names) and not unknown, "optim.spectral.targets", cfg.targets,
            f"comma-separated names from {list(TARGETS)}" + (f"; unknown: {unknown}" if unknown else ""))
    require(cfg.max_staleness >= 0, "optim.spectral.max_staleness", cfg.max_staleness, "must be >= 0")


# --- the math ------------------------------------------------------------------------------------


@dataclass
class AnchorBasis:
    """Thin SVD of one matrix's anchor EMA: M = U·diag(s)·Vh, s descending."""

    u: Tensor  # (m, r)
    s: Tensor  # (r,)
    vh: Tensor  # (r, n)

    @classmethod
    def of(cls, ema: Tensor) -> AnchorBasis:
        u, s, vh = torch.linalg.svd(ema.float(), full_matrices=False)
        return cls(u, s, vh)

    def top(self, rank: int) -> AnchorBasis:
        """The leading ``rank`` singular triplets (all of them if ``rank`` >= min(m, n))."""
        return AnchorBasis(self.u[:, :rank], self.s[:rank], self.vh[:rank])

    def orthonormalized(self) -> AnchorBasis:
        """U and V with orthonormal columns again (QR), as received over a narrow wire: the filter's
        ‖G_filt‖_F ≤ ‖G‖_F needs them orthonormal, and bf16 rounding breaks that slightly. A column's
        sign does not matter (u_i and v_i each appear twice in the filter)."""
        u, _ = torch.linalg.qr(self.u.float())
        v, _ = torch.linalg.qr(self.vh.float().T)
        return AnchorBasis(u, self.s.float(), v.T)


def fold_ema(ema: Tensor | None, grad: Tensor, beta: float) -> Tensor:
    """M ← β·M + (1 − β)·G in fp32, in place; the first arrival sets M to G (no zero start). Used by
    the correction (gradients sent) and by the anchor stage itself (factors sent): the same EMA."""
    grad = grad.detach().to(torch.float32)
    return grad.clone() if ema is None else ema.mul_(beta).add_(grad, alpha=1 - beta)


def damping(s: Tensor, tau: float) -> Tensor:
    """d_i = s_i / (s_i + τ) in [0, 1]; 0 where s_i + τ = 0 (a zero direction with τ = 0)."""
    denominator = s + tau
    return torch.where(denominator > 0, s / denominator.clamp_min(torch.finfo(s.dtype).tiny), 0.0)


def filter_gradient(grad: Tensor, basis: AnchorBasis, tau: float) -> Tensor:
    """G_filt = U·D·(UᵀGV)·D·Vᵀ in fp32: linear in G, and ‖G_filt‖_F ≤ ‖G‖_F."""
    d = damping(basis.s, tau)
    core = basis.u.T @ grad.float() @ basis.vh.T  # (r, r) = UᵀGV
    return basis.u @ (d[:, None] * core * d[None, :]) @ basis.vh


def effective_tau(cfg: SpectralConfig, basis: AnchorBasis) -> float:
    if cfg.tau_mode == "relative":
        return cfg.tau * float(basis.s[0]) if basis.s.numel() else 0.0
    return cfg.tau


# --- the strategy --------------------------------------------------------------------------------


@dataclass
class AnchorPrior:
    """One targeted matrix: its anchor EMA, the basis of that EMA, and the last step folded in."""

    ema: Tensor | None = None
    basis: AnchorBasis | None = None
    last_step: int = -1
    arrivals: int = 0


@dataclass
class SpectralCounters:
    accepted: int = 0
    dropped_stale: int = 0
    dropped_out_of_order: int = 0
    corrected_steps: int = field(default=0)  # optimizer steps in which some matrix was filtered


class SpectralCorrection:
    """The correction for one module's targeted matrices; see the module docstring.

    ``named_params``: the module's ``named_parameters()``; 2-D ``.weight`` parameters of layers
    named in ``cfg.targets`` are corrected, everything else passes through.
    """

    def __init__(self, named_params: Iterable[tuple[str, Tensor]], cfg: SpectralConfig):
        self.cfg = cfg
        wanted = set(target_names(cfg))
        self.params: dict[str, Tensor] = {
            name: p for name, p in named_params
            if p.ndim == 2 and name.endswith(".weight") and name.split(".")[-2] in wanted}
        self.priors = {name: AnchorPrior() for name in self.params}
        self.counters = SpectralCounters()
        # ``anchor.use = error_feedback``: the anchor's gradients become delayed corrections instead
        # of a basis (optim/error_feedback.py); it needs the step of each update (``begin_update``).
        self.feedback: AnchorErrorFeedback | None = None
        self.update_step = 0

    def begin_update(self, step: int) -> None:
        """The worker's next optimizer step belongs to step ``step`` (the error feedback keeps and
        corrects per step; the filter does not need it)."""
        self.update_step = step

    def receive_correction(self, name: str, grad: Tensor, step: int, now: int) -> bool:
        """``anchor.use = error_feedback``: the anchor's clean gradient of ``name`` for step ``step``
        becomes the correction g_clean − g_masked of that step, added from the next update on
        (``now`` is unused: the kept gradient's age is bounded by the feedback's horizon)."""
        if self.feedback is None or name not in self.feedback.params:
            raise KeyError(f"spectral correction: no error feedback kept for {name!r}")
        return self.feedback.receive(name, grad, step)

    def forget(self, step: int) -> None:
        """The anchor's share for ``step`` was dropped as late: free what the feedback kept for it."""
        if self.feedback is not None:
            self.feedback.forget(step)

    def receive_anchor(self, name: str, grad: Tensor, step: int, now: int) -> bool:
        """Fold the anchor gradient of matrix ``name``, computed for step ``step``, into its EMA and
        recompute its basis; ``now`` is the receiver's current step. False if dropped (older than
        ``max_staleness`` steps, or older than the last arrival folded in)."""
        if name not in self.params:
            raise KeyError(f"spectral correction: {name!r} is not a targeted matrix here; "
                           f"targeted: {sorted(self.params)}")
        param, prior = self.params[name], self.priors[name]
        if tuple(grad.shape) != tuple(param.shape):
            raise ValueError(f"spectral correction: anchor gradient of {name} has shape "
                             f"{tuple(grad.shape)}, the matrix {tuple(param.shape)}")
        if not self._admit(prior, step, now):
            return False
        prior.ema = fold_ema(prior.ema, grad.to(param.device), self.cfg.beta_anc)
        self._install(prior, AnchorBasis.of(prior.ema), step)
        return True

    def receive_basis(self, name: str, basis: AnchorBasis, step: int, now: int) -> bool:
        """Install the basis of matrix ``name`` that the anchor computed from its own EMA for step
        ``step`` (U: (m, r), s: (r,), Vh: (r, n), as received; re-orthonormalized here). The same
        staleness and order rules as ``receive_anchor``; no EMA is kept here."""
        if name not in self.params:
            raise KeyError(f"spectral correction: {name!r} is not a targeted matrix here; "
                           f"targeted: {sorted(self.params)}")
        param, prior = self.params[name], self.priors[name]
        m, n = param.shape
        r = basis.s.numel()
        if basis.u.shape != (m, r) or basis.vh.shape != (r, n) or not 1 <= r <= min(m, n):
            raise ValueError(f"spectral correction: anchor basis of {name} has U {tuple(basis.u.shape)}, "
                             f"s {tuple(basis.s.shape)}, Vh {tuple(basis.vh.shape)}; the matrix is "
                             f"{(m, n)}")
        if not self._admit(prior, step, now):
            return False
        moved = AnchorBasis(basis.u.to(param.device), basis.s.to(param.device), basis.vh.to(param.device))
        self._install(prior, moved.orthonormalized(), step)
        return True

    def _admit(self, prior: AnchorPrior, step: int, now: int) -> bool:
        """Whether an arrival for ``step`` is used at ``now`` (counted if not)."""
        if now - step > self.cfg.max_staleness:
            self.counters.dropped_stale += 1
            return False
        if step < prior.last_step:
            self.counters.dropped_out_of_order += 1
            return False
        return True

    def _install(self, prior: AnchorPrior, basis: AnchorBasis, step: int) -> None:
        prior.basis = basis
        prior.last_step, prior.arrivals = step, prior.arrivals + 1
        self.counters.accepted += 1

    @torch.no_grad()
    def correct(self) -> None:
        """Replace each targeted gradient that has a basis by α·G + (1 − α)·G_filt, in place (after
        the error feedback, if on, kept the raw gradient and added its pending corrections)."""
        if self.feedback is not None:
            self.feedback.before_update(self.update_step)
        alpha = self.cfg.alpha
        if alpha == 1.0:
            return  # the base optimizer exactly: nothing to compute
        touched = False
        for name, param in self.params.items():
            basis = self.priors[name].basis
            if basis is None or param.grad is None:
                continue
            grad = param.grad
            filtered = filter_gradient(grad, basis, effective_tau(self.cfg, basis))
            grad.copy_(torch.lerp(filtered, grad.float(), alpha))  # α·G + (1 − α)·G_filt
            touched = True
        self.counters.corrected_steps += touched

    def attach(self, optimizer: torch.optim.Optimizer):
        """Run ``correct`` before every ``optimizer.step()`` (after any clipping done before the
        call); returns the hook handle (``.remove()`` detaches it)."""
        return optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.correct())

    def summary(self) -> dict[str, int]:
        c = self.counters
        return {"spectral_anchor_accepted": c.accepted, "spectral_anchor_dropped_stale": c.dropped_stale,
                "spectral_anchor_dropped_out_of_order": c.dropped_out_of_order,
                "spectral_corrected_steps": c.corrected_steps,
                **(self.feedback.summary() if self.feedback is not None else {})}

    def state_dict(self) -> dict:
        """The EMAs and their steps (bases are recomputed on load: the SVD is deterministic); a
        basis installed by ``receive_basis`` has no EMA here and is saved itself."""
        priors = {}
        for name, p in self.priors.items():
            if p.basis is None:
                continue
            saved = {"ema": p.ema} if p.ema is not None else {"basis": (p.basis.u, p.basis.s, p.basis.vh)}
            priors[name] = saved | {"last_step": p.last_step, "arrivals": p.arrivals}
        return {"priors": priors, "counters": dict(self.counters.__dict__),
                **({"feedback": self.feedback.state_dict()} if self.feedback is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        for name, saved in state["priors"].items():
            prior, device = self.priors[name], self.params[name].device
            if "ema" in saved:
                prior.ema = saved["ema"].to(device)
                prior.basis = AnchorBasis.of(prior.ema)
            else:
                prior.basis = AnchorBasis(*(t.to(device) for t in saved["basis"]))
            prior.last_step, prior.arrivals = saved["last_step"], saved["arrivals"]
        self.counters = SpectralCounters(**state["counters"])
        if self.feedback is not None and "feedback" in state:
            self.feedback.load_state_dict(state["feedback"])
