"""Architecture warm-up's config section (``warmup.*``) and its checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class WarmupConfig:
    """Architecture warm-up ("Taming Curvature", arXiv 2606.16768): train with some blocks locked as
    exact identities (all matrices zero, outside the optimizer, skipped in the forward), then unlock
    them in groups after the learning-rate warm-up. See docs/warmup.md."""

    enabled: bool = False
    """Lock blocks at the start and unlock them on the schedule below."""
    locked_fraction: float = 0.5
    """Fraction of each stage's blocks locked at the start (rounded; the paper locks half)."""
    placement: Literal["interleaved", "top"] = "interleaved"
    """``interleaved``: every other block within each stage (no stage idles in a pipeline);
    ``top``: the top blocks of the network (whole upper stages idle in a pipeline)."""
    groups: int = 4
    """Unlock groups; more than the locked blocks means one block per group."""
    start_step: int = -1
    """Completed steps after which the first group unlocks; -1 = ``train.warmup_steps`` (the end of
    the learning-rate warm-up, at least 1)."""
    unlock_every: int = 500
    """Steps between group unlocks (the paper's 500; results were reported insensitive to it)."""
    order: Literal["bottom_up", "across_stages"] = "bottom_up"
    """``bottom_up``: groups are consecutive locked blocks from the bottom of the network (the
    note's default); ``across_stages``: round-robin over stages, so stage depths grow together."""
    unlock_init: Literal["zero_out_small_in", "zero_out_std_in", "literal_zero"] = "zero_out_small_in"
    """At unlock: ``zero_out_small_in`` keeps W_o and W_down at 0 (the function is unchanged) and
    draws q, k, v, gate, up from the model's init scaled by ``init_scale``; ``zero_out_std_in``
    the same at full scale; ``literal_zero`` leaves all zeros (a saddle: it never trains; kept for
    the negative test)."""
    init_scale: float = 0.1
    """Scale of the input-side init of ``zero_out_small_in``."""
    lr_ramp_steps: int = 0
    """Steps over which an unlocked group's learning rate ramps linearly from 0 to the scheduled
    one; 0 = the scheduled lr at once (the paper). A fresh Adam state's first update is ±lr per
    coordinate, so a ramp of R makes the unlocked output projections' first jump lr/R; the default
    stays 0 because the loss showed no unlock jump to damp (docs/warmup.md, issue 29). Set it to
    about ``unlock_every`` if the train loss jumps in the steps right after ``warmup_unlock`` events."""


def validate_warmup(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``warmup.*`` run by ``config.validate``."""
    w = cfg.warmup
    if not w.enabled:
        return
    require(0 < w.locked_fraction < 1, "warmup.locked_fraction", w.locked_fraction, "in (0, 1)")
    require(w.init_scale > 0, "warmup.init_scale", w.init_scale, "must be > 0")
    require(w.unlock_every >= 1, "warmup.unlock_every", w.unlock_every, "must be >= 1")
    require(w.start_step >= -1, "warmup.start_step", w.start_step, "-1 (train.warmup_steps) or >= 0")
    require(w.lr_ramp_steps >= 0, "warmup.lr_ramp_steps", w.lr_ramp_steps, "must be >= 0")
    require(w.groups >= 1, "warmup.groups", w.groups, "must be >= 1")
