"""Muon for hidden matrices, with AdamW for everything else, in one ``torch.optim.Optimizer``.

Muon (KellerJordan/Muon; "Muon is Scalable for LLM Training", arXiv 2502.16982) updates each 2-D
hidden weight with the orthogonalized momentum ``≈ U Vᵀ`` — steepest descent under the spectral
norm. Embeddings, the LM head and all non-2-D parameters keep AdamW (see :mod:`.routing` for why).
``torch.optim.Muon`` only accepts 2-D tensors, so a model needs two optimizers; :class:`Muon` here
routes a whole module itself, so a trainer can treat it like any single optimizer (one
``state_dict``, one list of ``param_groups`` for the LR schedule).

The math is in free functions (:func:`momentum_input`, :func:`lr_scale`,
:func:`apply_matrix_update`, :func:`adamw_update`); :class:`MatrixOptimizerWithAdamW` holds the
routing and the AdamW half and is shared with :class:`~meshlearn.optim.numuon.NuMuon`.

Semantics match ``torch.optim.Muon`` (same keyword names and meaning): EMA momentum
``B ← μB + (1−μ)G``, Nesterov input ``G + μ(B − G)``, decoupled weight decay with the *unadjusted*
lr, and ``adjust_lr_fn`` in ``{None/"original", "match_rms_adamw"}``. With
``ns_dtype=torch.bfloat16`` the result is bit-identical to ``torch.optim.Muon`` (tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .orthogonalize import NS_COEFFICIENTS, newton_schulz
from .routing import is_embedding_or_head, split_params

ADJUST_LR_FNS: tuple[str | None, ...] = (None, "original", "match_rms_adamw")

ParamsArg = nn.Module | Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]]


# --------------------------------------------------------------------------- math (free functions)


def lr_scale(adjust_lr_fn: str | None, shape: torch.Size | tuple[int, ...]) -> float:
    """Per-matrix multiplier on the lr for an ``(A, B) = (out, in)`` weight.

    * ``None``/``"original"`` (Keller): ``√max(1, A/B)``. The lr is then "spectral norm per
      update"; 0.02 is the reference default. Tall matrices get a bigger step so that the update's
      RMS per input direction matches square ones.
    * ``"match_rms_adamw"`` (Moonlight): ``0.2·√max(A, B)``, which makes the update RMS ≈ 0.2 like
      AdamW's, so you can reuse an AdamW lr (e.g. 3e-4…1e-3) and weight decay (0.1).
    """
    A, B = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def momentum_input(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update the EMA momentum buffer in place and return what gets orthogonalized.

    ``buf ← μ·buf + (1−μ)·grad``; the returned matrix is ``grad + μ(buf − grad)`` with Nesterov,
    else ``buf``. (The sum form ``buf ← μ·buf + grad`` differs only in scale, which
    orthogonalization removes.)
    """
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def apply_matrix_update(
    param: Tensor, direction: Tensor, lr: float, scale: float, weight_decay: float
) -> None:
    """``W ← W·(1 − lr·wd) − lr·scale·direction``, in place. Weight decay is decoupled and uses the
    unadjusted lr, as in ``torch.optim.Muon``."""
    param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-(lr * scale))


def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place (``step`` counts from 1), the same arithmetic as
    ``torch.optim.AdamW(foreach=False)``."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def resolve_ns_dtype(ns_dtype: torch.dtype | None, like: Tensor) -> torch.dtype | None:
    """Compute dtype for Newton–Schulz: the explicit choice, else bf16 on CUDA (the reference's
    speed/accuracy trade-off) and the parameter's own dtype elsewhere (bf16 matmuls are slow on
    CPU). ``None`` means "the input dtype"."""
    if ns_dtype is not None:
        return ns_dtype
    return torch.bfloat16 if like.is_cuda else None


def muon_direction(
    update: Tensor,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | None = None,
) -> Tensor:
    """Muon's step direction for one matrix: Newton–Schulz of the momentum input."""
    return newton_schulz(update, ns_steps, ns_coefficients, eps, resolve_ns_dtype(ns_dtype, update))


# --------------------------------------------------------------------------- shared wrapper


def _check(name: str, value: float, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_common_args(
    lr: float, weight_decay: float, momentum: float, adjust_lr_fn: str | None
) -> None:
    """Validate the arguments Muon and NuMuon share; errors name the argument and what is
    allowed."""
    _check("lr", lr, lr >= 0, ">= 0")
    _check("weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    _check("momentum", momentum, 0 <= momentum < 1, "in [0, 1)")
    _check("adjust_lr_fn", adjust_lr_fn, adjust_lr_fn in ADJUST_LR_FNS, f"one of {ADJUST_LR_FNS}")


def adamw_defaults(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> dict[str, Any]:
    """Validated option dict for the AdamW group."""
    _check("adamw_lr", lr, lr >= 0, ">= 0")
    _check("adamw_betas", betas, all(0 <= b < 1 for b in betas), "two floats in [0, 1)")
    _check("adamw_eps", eps, eps >= 0, ">= 0")
    _check("adamw_weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}


def build_param_groups(
    params: ParamsArg, is_adamw_name: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """Turn a module / (named) parameters into a matrix group and an AdamW group (empty ones
    dropped). Dicts are passed through unchanged; :meth:`MatrixOptimizerWithAdamW.add_param_group`
    routes them."""
    if not isinstance(params, nn.Module):
        params = list(params)
        if params and all(isinstance(g, dict) for g in params):
            return params
    split = split_params(params, is_adamw_name)  # type: ignore[arg-type]
    groups = []
    for use_muon, named in ((True, split.matrix), (False, split.adamw)):
        if named:
            named_ok = all(name is not None for name, _ in named)
            items = [(n, p) for n, p in named] if named_ok else [p for _, p in named]
            groups.append({"params": items, "use_muon": use_muon})
    return groups


class MatrixOptimizerWithAdamW(torch.optim.Optimizer):
    """Base for Muon-like optimizers: routes parameters and runs AdamW on the non-matrix part.

    Every param group has ``use_muon`` (matrix update or AdamW), ``lr`` and ``initial_lr``. A
    trainer's LR schedule should set ``group["lr"] = group["initial_lr"] * factor`` for *every*
    group: matrix and AdamW groups then follow the same schedule from their own base lr
    (``torch.optim.lr_scheduler`` schedulers do exactly this).

    Subclasses pass their matrix-group defaults and implement :meth:`matrix_step`.
    """

    def __init__(
        self,
        params: ParamsArg,
        matrix_defaults: dict[str, Any],
        adamw_group_defaults: dict[str, Any],
        is_adamw_name: Callable[[str], bool] = is_embedding_or_head,
    ) -> None:
        self.matrix_defaults = dict(matrix_defaults)
        self.adamw_defaults = dict(adamw_group_defaults)
        self.is_adamw_name = is_adamw_name
        super().__init__(build_param_groups(params, is_adamw_name), dict(matrix_defaults))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``use_muon`` is inferred from its parameters when absent (all matrices →
        True, none → False, a mix → ValueError). Missing options come from the matrix or AdamW
        defaults of the constructor; ``initial_lr`` defaults to ``lr``."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        param_group["params"] = params
        split = split_params(params, self.is_adamw_name)
        if "use_muon" not in param_group:
            if split.matrix and split.adamw:
                raise ValueError(
                    "param group mixes hidden matrices and AdamW parameters; set use_muon "
                    "explicitly or pass them in separate groups"
                )
            param_group["use_muon"] = bool(split.matrix)
        if param_group["use_muon"]:
            bad = [tuple(p.shape) for _, p in split.adamw if p.ndim != 2]
            if bad:
                raise ValueError(f"use_muon=True groups take only 2-D parameters, got shapes {bad}")
        defaults = self.matrix_defaults if param_group["use_muon"] else self.adamw_defaults
        for key, value in defaults.items():
            param_group.setdefault(key, value)
        param_group.setdefault("initial_lr", param_group["lr"])
        # Optimizer.add_param_group fills missing keys from self.defaults (the matrix options);
        # hide them so AdamW groups hold only AdamW options.
        saved, self.defaults = self.defaults, {}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = saved

    def matrix_step(self, group: dict[str, Any], first_index: int) -> None:
        """Update every parameter with a gradient in a ``use_muon`` group. ``first_index`` is the
        position of the group's first parameter in the optimizer (as in ``state_dict``), a stable
        id for per-parameter randomness."""
        raise NotImplementedError

    def adamw_step(self, group: dict[str, Any]) -> None:
        """AdamW on every parameter with a gradient in a ``use_muon=False`` group."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW part does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            adamw_update(
                p,
                p.grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step for all groups; ``closure`` (optional) re-evaluates and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            if group["use_muon"]:
                self.matrix_step(group, index)
            else:
                self.adamw_step(group)
            index += len(group["params"])
        return loss


# --------------------------------------------------------------------------- Muon


class Muon(MatrixOptimizerWithAdamW):
    """Muon on 2-D hidden matrices plus AdamW on everything else, as one optimizer.

    Example::

        opt = Muon(model, lr=0.02, weight_decay=0.0)      # or model.named_parameters()
        loss.backward(); opt.step(); opt.zero_grad()

    Pass a module or named parameters so embeddings and the head (recognised by name, see
    :func:`~meshlearn.optim.routing.is_embedding_or_head`) go to AdamW; plain tensors are routed
    by shape only.

    Args:
        params: ``nn.Module``, ``named_parameters()``, plain tensors, or group dicts (a dict may
            set ``use_muon``; otherwise it is inferred).
        lr: Muon lr. With ``adjust_lr_fn=None`` it is the spectral norm of each update (before
            the shape factor): 0.02 is the reference; halve it if loss spikes early. With
            ``"match_rms_adamw"`` use an AdamW-sized lr (torch's default is 1e-3).
        weight_decay: decoupled, multiplied by the unadjusted ``lr``. 0 (Keller) or 0.1
            (Moonlight, with ``"match_rms_adamw"``).
        momentum: EMA coefficient μ; 0.95 is the reference (warm up from 0.85 for very short
            runs).
        nesterov: orthogonalize ``G + μ(B − G)`` instead of ``B``; on in the reference.
        ns_coefficients, eps, ns_steps: Newton–Schulz settings (see
            :func:`~meshlearn.optim.orthogonalize.newton_schulz`); rarely worth changing.
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (see :func:`lr_scale`).
        adamw_lr, adamw_betas, adamw_eps: AdamW options for embeddings, head, norms, biases.
            The reference pairs Muon lr 0.02 with AdamW lr ~3e-4 (embeddings often tolerate more).
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` = same as ``weight_decay``.
            Set 0.0 to exempt norm gains and biases.
        ns_dtype: Newton–Schulz compute dtype; ``None`` = bf16 on CUDA, the parameter dtype
            elsewhere. ``torch.bfloat16`` reproduces ``torch.optim.Muon`` exactly.
        is_adamw_name: predicate on parameter names that sends a 2-D parameter to AdamW.
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        ns_dtype: torch.dtype | None = None,
        is_adamw_name: Callable[[str], bool] = is_embedding_or_head,
    ) -> None:
        check_common_args(lr, weight_decay, momentum, adjust_lr_fn)
        _check("ns_steps", ns_steps, 0 <= ns_steps < 100, "an int in [0, 100)")
        matrix = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        aux = adamw_defaults(adamw_lr, adamw_betas, adamw_eps, wd)
        super().__init__(params, matrix, aux, is_adamw_name)

    def matrix_step(self, group: dict[str, Any], first_index: int) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            update = momentum_input(
                p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"]
            )
            direction = muon_direction(
                update, group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"]
            )
            scale = lr_scale(group["adjust_lr_fn"], p.shape)
            apply_matrix_update(p, direction, group["lr"], scale, group["weight_decay"])
