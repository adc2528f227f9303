"""The ``[protocol]`` config section (unextractable protocol models) and its checks, one line each.

``protocol.morph = off`` (the default) leaves every run as it was. Any other value builds the
protocol model (``protocol/model.py``: folded RMSNorm gains, fixed-basis embedding and head, skip
and norm basis matrices); ``none`` never morphs it, ``orthogonal`` and ``lowcond`` morph every
pipeline and sublayer boundary every ``protocol.every_steps`` steps (``protocol/plugin.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class ProtocolConfig:
    """Unextractable protocol models (arXiv 2605.23464; see docs/protocol.md). Keys under ``protocol.``."""

    morph: Literal["off", "none", "orthogonal", "lowcond"] = "off"
    """``off``: the plain decoder. ``none``: the protocol model, never morphed (computes what the
    plain decoder computes at init). ``orthogonal``: a Haar-orthogonal transform at every boundary
    (training stays exact under Muon). ``lowcond``: a low-condition transform (κ ≤ e^{2ε}); training
    is no longer exact, and ε ≥ 0.1 hurts (the paper)."""
    every_steps: int = 10
    """Steps between morphs, each at a drain point the plugin asks for (unused when
    ``every_tokens`` or ``every_seconds`` is set). Each morph drains an async pipeline, so under
    mesh.schedule = async keep it a multiple of train.eval_every or large enough that the drains
    cost little."""
    every_tokens: int = 0
    """Training tokens between morphs instead of steps (the paper: 500000 in training); a morph
    follows the step whose tokens cross the next multiple. 0: use every_steps."""
    every_seconds: float = 0.0
    """Seconds of the run's clock between morphs instead of steps (the paper: 30 in inference).
    The clock is the simulator's virtual time (``sim_time_s``), not this machine's. A morph falls
    due at the step end where the clock passes the mark and happens at the next drain point, at
    most the driver's feed look-ahead later (a few steps under async, none under gpipe/1f1b;
    ``protocol/schedule.py``). 0: use every_steps."""
    epsilon: float = 0.01
    """Half-width of the log singular values of a ``lowcond`` transform (κ ≤ e^{2ε}): 0.01 is
    harmless in the paper, 0.1 and 0.5 hurt. Unused by the other morphs."""
    keep_snapshots: int = 1
    """Morphs whose stage snapshots the run folder keeps for the attack commands (``meshlearn
    attack``; docs/unextractable.md): for each of the last N morphs, replica 0's stages just
    before and just after it (two epochs), with boundary traffic samples, in ``protocol/``. Each
    snapshot holds the model's parameters and basis matrices (fp32) plus the traffic; 0 keeps none.
    What an attacker who rejoins could have collected, kept so its attacks can be measured."""
    traffic_tokens: int = 2048
    """Tokens of boundary traffic each snapshot keeps per pipeline boundary, twice: the activations
    on fresh training windows (what a passive holder of the next stage sees; the covariance attack)
    and on fixed probe windows, the same in every snapshot (identical inputs at two times; the
    bridge attack). Costs traffic_tokens · d_model · 4 bytes per boundary and kind; the bridge needs
    more than d_model, the covariance attack improves with more."""


def validate_protocol(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``protocol.*`` run by ``config.validate``; what the protocol model and morphs
    cannot combine with are rows of ``meshlearn.compat``."""
    p = cfg.protocol
    require(p.every_steps >= 1, "protocol.every_steps", p.every_steps, "must be >= 1")
    require(p.every_tokens >= 0, "protocol.every_tokens", p.every_tokens,
            "must be >= 0 (training tokens between morphs; 0: use protocol.every_steps)")
    require(math.isfinite(p.every_seconds) and p.every_seconds >= 0, "protocol.every_seconds",
            p.every_seconds, "a finite number of seconds >= 0 (0: use protocol.every_steps)")
    require(not (p.every_tokens and p.every_seconds), "protocol.every_seconds", p.every_seconds,
            f"set one schedule: protocol.every_tokens = {p.every_tokens} is set too (0 turns one off)")
    require(math.isfinite(p.epsilon) and 0 < p.epsilon <= 1, "protocol.epsilon", p.epsilon,
            "in (0, 1] (κ ≤ e^{2ε}; the paper: 0.01 harmless, 0.1 and 0.5 hurt)")
    require(p.keep_snapshots >= 0, "protocol.keep_snapshots", p.keep_snapshots,
            "must be >= 0 (morphs whose before/after stage snapshots are kept; 0: none)")
    require(p.traffic_tokens >= 1, "protocol.traffic_tokens", p.traffic_tokens,
            "must be >= 1 (tokens of boundary traffic per snapshot and boundary)")
