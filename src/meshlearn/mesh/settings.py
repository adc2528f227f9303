"""The mesh's config section (``mesh.*``): its shape, the pipeline schedule and its knobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshlearn.mesh.schedule import Schedule
from meshlearn.optim.async_lr import AsyncLrRule


@dataclass(frozen=True)
class MeshConfig:
    """The mesh: ``replicas`` × ``stages`` workers and the pipeline schedule."""

    stages: int = 4
    """Pipeline stages P; must divide model.n_layer."""
    replicas: int = 2
    """Data-parallel replicas D of every stage."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b (both flush every step; exact) or async (no flush:
    PipeDream-style 1F1B with stale gradients; see docs/async.md)."""
    microbatches: int = 4
    """Microbatches per replica per step; must divide train.batch_size / mesh.replicas."""
    update_every: int = 1
    """async: microbatches per optimizer update on each stage (must divide mesh.microbatches); a
    step then gives microbatches / update_every updates per stage. Flushing schedules update once
    per step."""
    weight_stashing: bool = True
    """async: the backward uses exactly the weights of its microbatch's forward (PipeDream; stash
    memory reported). false = No-WS: the backward uses the current weights, with per-stage β1 and
    learning rate (method note, No-WS variant)."""
    in_flight: str = "default"
    """async: microbatches a stage may hold between forward and backward: ``default`` (P − s, as
    1F1B), ``auto`` (enough to cover the pipeline round trip on the configured links, capped by
    mesh.max_in_flight) or a positive integer N: the first stage's depth, later stages
    proportionally fewer (1 + ⌈(N − 1)(P − 1 − s)/(P − 1)⌉; N = P is the default), the last 1."""
    max_in_flight: int = 16
    """async: the cap of mesh.in_flight = auto (bounds staleness and stash memory)."""
    async_lr_rule: AsyncLrRule = "microbatch_staleness"
    """async: how each stage's lr follows from train.lr (tuned for one update per step on the whole
    batch), so that switching to async needs no retuning. ``microbatch_staleness``: × 1/√(n·(1 + τ_s))
    with n = microbatches / update_every updates per step (the square-root batch-size rule of Adam)
    and τ_s = (in-flight depth − 1) / update_every the stage's staleness (P − 1 − s by default; a
    delay-adaptive step, PipeMare-style); 1/4 … 1/2 at P = 4, M = 4. ``microbatch``: × 1/√n only.
    ``off``: train.lr as given. No-WS keeps its own staleness rule (optim.no_ws_lr_anneal) and takes
    only the microbatch term. See optim/async_lr.py and docs/async.md."""


def validate_mesh(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """The mesh's own checks beyond its choices (``Literal`` fields the loader checks); the model
    and batch divisibility rules live in config.validate."""
    mesh = cfg.mesh
    require(mesh.update_every >= 1 and mesh.microbatches % mesh.update_every == 0, "mesh.update_every",
            mesh.update_every, f"must divide mesh.microbatches = {mesh.microbatches} "
            f"(allowed: {[d for d in range(1, mesh.microbatches + 1) if mesh.microbatches % d == 0]})")
    text = mesh.in_flight.strip()
    require(text in ("default", "auto") or (text.isdigit() and int(text) >= 1), "mesh.in_flight",
            mesh.in_flight, "allowed: default, auto or a positive integer")
    require(mesh.max_in_flight >= 1, "mesh.max_in_flight", mesh.max_in_flight, "must be >= 1")
    if mesh.schedule != "async":
        for key, value, default in [("mesh.update_every", mesh.update_every, 1),
                                    ("mesh.weight_stashing", mesh.weight_stashing, True),
                                    ("mesh.in_flight", mesh.in_flight, "default"),
                                    ("mesh.async_lr_rule", mesh.async_lr_rule, "microbatch_staleness")]:
            require(value == default, key, value,
                    f"only the async schedule uses it; mesh.schedule = {mesh.schedule!r} flushes "
                    f"every step (leave it at {default!r} or set mesh.schedule = async)")
