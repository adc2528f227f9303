"""NuMuon: Muon restricted to the top-k singular directions (nuclear-norm constrained Muon).

"NuMuon: Nuclear-Norm-Constrained Muon for Compressible LLM Training" (arXiv 2603.03597; only the
abstract was checked, details follow reimplementations — see
``shared/methods/optimizers_and_compressibility.md``). Adding ``‖Δ‖_* ≤ τ`` to Muon's
spectral-norm ball makes the linear minimization oracle ``−ρ·U_k V_kᵀ`` with ``k = ⌊τ/ρ⌋``: the
top-k singular directions of the momentum with unit singular values. Each step then has rank k,
which pushes weights toward low rank and makes them compress better with post-hoc SVD. At
``k = min(m, n)`` it is Muon exactly (this implementation then uses the same Newton–Schulz path).

Per matrix and step ``t``::

    M_t = β M_{t−1} + (1−β) G_t              (Nesterov optional, off by default)
    k_t = clamp(⌈r(t)·min(m, n)⌉, 1, min(m, n))
    W_t = (1 − ηλ) W_{t−1} − η·s·U_k V_kᵀ     (s = √max(1, m/n); × √(min(m,n)/k) if match_muon_rms)

The rank fraction ``r(t)`` comes from a named schedule (:data:`RANK_SCHEDULES`), so the whole
configuration is plain data that round-trips through ``state_dict``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .muon import (
    MatrixOptimizerWithAdamW,
    ParamsArg,
    adamw_defaults,
    apply_matrix_update,
    check_common_args,
    lr_scale,
    momentum_input,
    resolve_ns_dtype,
)
from .orthogonalize import NS_COEFFICIENTS, topk_lmo_with_basis
from .routing import is_embedding_or_head

# --------------------------------------------------------------------------- rank schedules


def fixed_fraction(step: int, start_fraction: float) -> float:
    """``r(t) = start_fraction``."""
    return start_fraction


def piecewise_fraction(
    step: int, start_fraction: float, milestones: Sequence[Sequence[float]]
) -> float:
    """Step function: ``r(t)`` is the fraction of the last milestone ``(step_i, fraction_i)`` with
    ``step_i ≤ t``, and ``start_fraction`` before the first milestone."""
    fraction = start_fraction
    for at, value in milestones:
        if step >= at:
            fraction = value
    return fraction


def cosine_fraction(
    step: int,
    start_fraction: float,
    end_fraction: float,
    total_steps: int,
    start_step: int = 0,
) -> float:
    """Hold ``start_fraction`` until ``start_step``, cosine-anneal to ``end_fraction`` at
    ``total_steps``, then hold. The note's recipe ("hold r_start for 10 % of training, reach
    r_final at 80 %") is ``start_step=0.1·T, total_steps=0.8·T``."""
    if step <= start_step:
        return start_fraction
    if step >= total_steps:
        return end_fraction
    progress = (step - start_step) / (total_steps - start_step)
    return end_fraction + (start_fraction - end_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


RANK_SCHEDULES: dict[str, Callable[..., float]] = {
    "fixed": fixed_fraction,
    "piecewise": piecewise_fraction,
    "cosine": cosine_fraction,
}
"""Name → ``fn(step, start_fraction, **rank_schedule_kwargs) -> fraction``."""

_SCHEDULE_KWARGS: dict[str, tuple[set[str], set[str]]] = {  # name -> (required, optional)
    "fixed": (set(), set()),
    "piecewise": ({"milestones"}, set()),
    "cosine": ({"end_fraction", "total_steps"}, {"start_step"}),
}


def _is_fraction(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 < x <= 1


def validate_rank_args(
    rank: int | None,
    rank_fraction: float | None,
    rank_schedule: str,
    rank_schedule_kwargs: Mapping[str, Any],
) -> None:
    """Raise ``ValueError`` (naming the argument, its value and what is allowed) unless exactly
    one of ``rank``/``rank_fraction`` is set and the schedule and its kwargs are valid."""
    if (rank is None) == (rank_fraction is None):
        raise ValueError(
            "NuMuon needs exactly one of rank (int >= 1) or rank_fraction (float in (0, 1]); "
            f"got rank={rank!r}, rank_fraction={rank_fraction!r}"
        )
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank must be an int >= 1, got rank={rank!r}")
    if rank_fraction is not None and not _is_fraction(rank_fraction):
        raise ValueError(f"rank_fraction must be a float in (0, 1], got {rank_fraction!r}")
    if rank_schedule not in RANK_SCHEDULES:
        raise ValueError(
            f"rank_schedule must be one of {sorted(RANK_SCHEDULES)}, got {rank_schedule!r}"
        )
    if rank is not None and rank_schedule != "fixed":
        raise ValueError(
            f"rank_schedule={rank_schedule!r} schedules a fraction: pass rank_fraction "
            f"(the starting fraction) instead of rank={rank!r}"
        )
    required, optional = _SCHEDULE_KWARGS[rank_schedule]
    given = set(rank_schedule_kwargs)
    if not required <= given or not given <= required | optional:
        raise ValueError(
            f"rank_schedule_kwargs for {rank_schedule!r} must have keys {sorted(required)}"
            f"{f' (optional {sorted(optional)})' if optional else ''}, got {sorted(given)}"
        )
    if rank_schedule == "piecewise":
        ms = list(rank_schedule_kwargs["milestones"])
        ok = all(len(m) == 2 and int(m[0]) >= 0 and _is_fraction(m[1]) for m in ms)
        if not ok or [m[0] for m in ms] != sorted(m[0] for m in ms):
            raise ValueError(
                "rank_schedule_kwargs['milestones'] must be (step >= 0, fraction in (0, 1]) "
                f"pairs sorted by step, got {ms!r}"
            )
    if rank_schedule == "cosine":
        end = rank_schedule_kwargs["end_fraction"]
        total = rank_schedule_kwargs["total_steps"]
        start = rank_schedule_kwargs.get("start_step", 0)
        if not _is_fraction(end):
            raise ValueError(f"rank_schedule_kwargs['end_fraction'] must be in (0, 1], got {end!r}")
        if not 0 <= start < total:
            raise ValueError(
                "rank_schedule_kwargs must satisfy 0 <= start_step < total_steps, got "
                f"start_step={start!r}, total_steps={total!r}"
            )


def rank_for_fraction(fraction: float, shape: Sequence[int]) -> int:
    """``k = ⌈fraction·min(m, n)⌉`` clamped to ``[1, min(m, n)]``. The product is rounded to 9
    decimals first so that float noise (e.g. a cosine landing on 0.25 + 1e-16) cannot add one."""
    full = min(shape[0], shape[1])
    return max(1, min(full, math.ceil(round(fraction * full, 9))))


def matrix_rank(
    step: int,
    shape: Sequence[int],
    rank: int | None,
    rank_fraction: float | None,
    rank_schedule: str = "fixed",
    rank_schedule_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """The k NuMuon uses for a matrix of ``shape`` at ``step`` (0 for the first step)."""
    full = min(shape[0], shape[1])
    if rank is not None:
        return min(rank, full)
    assert rank_fraction is not None
    fn = RANK_SCHEDULES[rank_schedule]
    return rank_for_fraction(fn(step, rank_fraction, **(rank_schedule_kwargs or {})), shape)


def param_key(name: str | None, index: int) -> int:
    """Stable integer id of a parameter for :func:`krylov_seed`: a CRC of its name when it has
    one (so a pipeline stage's optimizer draws what the unsplit model's draws for the same
    weight), else its position in the optimizer."""
    return zlib.crc32(name.encode()) + (1 << 32) if name is not None else index


def krylov_seed(seed: int, key: int, step: int) -> int:
    """A 63-bit seed for one parameter's random Krylov start at one step (splitmix64 finaliser).

    Deriving it from ``(seed, param_key, step)`` instead of advancing one generator makes the draw
    independent of history: a resumed run, or a peer on another device, draws the same block
    without saving any RNG state."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + key * 0xD1B54A32D192ED03 + step) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


# --------------------------------------------------------------------------- optimizer


class NuMuon(MatrixOptimizerWithAdamW):
    """NuMuon on 2-D hidden matrices plus AdamW on everything else, as one optimizer.

    Example::

        opt = NuMuon(model, lr=0.02, rank_fraction=1.0, rank_schedule="cosine",
                     rank_schedule_kwargs={"end_fraction": 0.25, "total_steps": 8000,
                                           "start_step": 1000})

    Args:
        params: as for :class:`~meshlearn.optim.muon.Muon` (module, named params, tensors, dicts).
        lr: as Muon's. At a fixed lr the update RMS is ``√(k/min(m,n))`` times Muon's, so as the
            rank anneals the effective step shrinks: sweep lr at each final rank, or turn on
            ``match_muon_rms``.
        rank: a fixed k for every matrix (clamped to ``min(m, n)``). Exclusive with
            ``rank_fraction``; only with ``rank_schedule="fixed"``.
        rank_fraction: r in (0, 1]: ``k = ⌈r·min(m, n)⌉``; the starting fraction of a schedule.
            1.0 is Muon. 0.25 ≈ the rank a 50 % SVD parameter cut keeps on square matrices.
        weight_decay: decoupled, multiplied by the unadjusted lr (as Muon).
        momentum: EMA coefficient β (as Muon).
        nesterov: off in the reimplementations' "paper recipe"; on makes rank 1.0 match Muon
            with its default settings.
        rank_schedule: ``"fixed"``, ``"piecewise"`` or ``"cosine"`` (see :data:`RANK_SCHEDULES`).
        rank_schedule_kwargs: ``piecewise``: ``milestones=[(step, fraction), ...]``; ``cosine``:
            ``end_fraction``, ``total_steps`` and optional ``start_step`` (hold before it).
        match_muon_rms: multiply the step by ``√(min(m,n)/k)`` so its RMS equals Muon's at the
            same lr. This enlarges every kept singular direction; off by default (the later
            reimplementation insists on unit singular values).
        oversample: extra Krylov columns; raise (16) if the spectrum has no gap after k.
        krylov_iters: block Krylov iterations; 2 with warm start is plenty for slowly changing
            momentum, 3–4 without.
        warm_start: start each step's Krylov block from the previous ``V_k`` (kept in state).
        seed: seeds the random Krylov columns, per parameter name and step (see
            :func:`krylov_seed`), so runs are reproducible without saving RNG state.
        adjust_lr_fn: shape factor ``s`` as in Muon (``None`` → ``√max(1, m/n)``).
        ns_coefficients, eps, ns_steps, ns_dtype: Newton–Schulz settings for the full-rank path.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, is_adamw_name: as in Muon.
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 0.02,
        rank: int | None = None,
        rank_fraction: float | None = None,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = False,
        rank_schedule: str = "fixed",
        rank_schedule_kwargs: Mapping[str, Any] | None = None,
        match_muon_rms: bool = False,
        oversample: int = 8,
        krylov_iters: int = 2,
        warm_start: bool = True,
        seed: int = 0,
        adjust_lr_fn: str | None = None,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        is_adamw_name: Callable[[str], bool] = is_embedding_or_head,
    ) -> None:
        check_common_args(lr, weight_decay, momentum, adjust_lr_fn)
        kwargs = dict(rank_schedule_kwargs or {})
        validate_rank_args(rank, rank_fraction, rank_schedule, kwargs)
        if not isinstance(oversample, int) or oversample < 0:
            raise ValueError(f"oversample must be an int >= 0, got {oversample!r}")
        if not isinstance(krylov_iters, int) or krylov_iters < 1:
            raise ValueError(f"krylov_iters must be an int >= 1, got {krylov_iters!r}")
        matrix = {
            "lr": lr,
            "rank": rank,
            "rank_fraction": rank_fraction,
            "rank_schedule": rank_schedule,
            "rank_schedule_kwargs": kwargs,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "match_muon_rms": match_muon_rms,
            "oversample": oversample,
            "krylov_iters": krylov_iters,
            "warm_start": warm_start,
            "seed": seed,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "ns_dtype": ns_dtype,
        }
        wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        aux = adamw_defaults(adamw_lr, adamw_betas, adamw_eps, wd)
        self._generator = torch.Generator()  # CPU: the same draws on every device
        super().__init__(params, matrix, aux, is_adamw_name)

    @staticmethod
    def rank_at(group: dict[str, Any], step: int, shape: Sequence[int]) -> int:
        """k for a matrix of ``shape`` in ``group`` at ``step`` (for logging and tests)."""
        return matrix_rank(
            step,
            shape,
            group["rank"],
            group["rank_fraction"],
            group["rank_schedule"],
            group["rank_schedule_kwargs"],
        )

    def matrix_step(self, group: dict[str, Any], first_index: int) -> None:
        names = group.get("param_names")
        for offset, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("NuMuon does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = state["step"]
            update = momentum_input(
                p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"]
            )
            k = self.rank_at(group, step, p.shape)
            key = param_key(names[offset] if names else None, first_index + offset)
            self._generator.manual_seed(krylov_seed(group["seed"], key, step))
            direction, basis = topk_lmo_with_basis(
                update,
                k,
                oversample=group["oversample"],
                iters=group["krylov_iters"],
                warm_start=state.get("basis") if group["warm_start"] else None,
                generator=self._generator,
                ns_steps=group["ns_steps"],
                ns_coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_dtype=resolve_ns_dtype(group["ns_dtype"], p),
            )
            if basis is None or not group["warm_start"]:
                state.pop("basis", None)
            else:
                state["basis"] = basis
            scale = lr_scale(group["adjust_lr_fn"], p.shape)
            if group["match_muon_rms"]:
                scale *= math.sqrt(min(p.shape) / k)
            apply_matrix_update(p, direction, group["lr"], scale, group["weight_decay"])
            state["step"] = step + 1
