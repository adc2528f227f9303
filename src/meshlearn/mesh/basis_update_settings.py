"""The ``[subspace_update]`` section: its own module, so the config tree reads it without
importing the plugin (which imports the hook registry)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BasisUpdateConfig:
    """Optional updates of the subspace basis U (our reading of the paper; off by default)."""

    every: int = 0
    """Steps between Grassmann updates of U; 0 keeps U frozen (as all public Pluralis code does)."""
    lr: float = 1.0
    """Retraction step size η on the trace-normalised gradient second moment (η ≈ 2 reaches the
    top-k gradient subspace in ~20 updates on a stationary spectrum; each update remaps the weights
    lossily, so keep it moderate)."""
