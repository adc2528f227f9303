"""Verification of pipeline-boundary traffic (SENTINEL) and the adversarial workers it is tested on.

``TrustLayer`` (``meshlearn.verify.trust``) wires both into a run; it is imported from there, not
here, because the run config imports this package's config dataclasses.
"""

from meshlearn.verify.attacks import ATTACKS, TARGETS, Attack, AttackConfig, build_attack
from meshlearn.verify.cost import VerifierClock
from meshlearn.verify.distances import (
    DISTANCES,
    PAIR_DISTANCES,
    STATISTICS,
    Summary,
    coherence,
    log_gain,
    normalized_l2,
    sign_flip_ratio,
    sliced_wasserstein,
)
from meshlearn.verify.fence import TukeyFence, tukey_threshold
from meshlearn.verify.ledger import Alert, Ban
from meshlearn.verify.sentinel import BoundaryVerifier, Decision, Sentinel, VerifyConfig

__all__ = [
    "ATTACKS",
    "DISTANCES",
    "PAIR_DISTANCES",
    "STATISTICS",
    "TARGETS",
    "Alert",
    "Attack",
    "AttackConfig",
    "Ban",
    "BoundaryVerifier",
    "Decision",
    "Sentinel",
    "Summary",
    "TukeyFence",
    "VerifierClock",
    "VerifyConfig",
    "build_attack",
    "coherence",
    "log_gain",
    "normalized_l2",
    "sign_flip_ratio",
    "sliced_wasserstein",
    "tukey_threshold",
]
