"""Which hosts may run the first and last stages of a verified cluster run.

Where SENTINEL's threat model assumes the first and last stages honest (``verify.trusted_ends``:
below 3 replicas by default, where their replicas cannot be compared), the verifier never bans them
and attackers there are outside what it defends. Among strangers that assumption must be the run
owner's to keep, so a verified ``[cluster]`` run places those workers only on hosts marked
``trusted = true``. Called by ``config.validate``; free of torch, like the config tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def validate_trusted_ends(cfg, require: Callable[[bool, str, Any, str], None]) -> None:
    """Refuse (one line, naming the host) a first- or last-stage worker of a verified cluster run on
    a host not marked trusted, while the threat model assumes those stages honest."""
    replicas, stages = cfg.mesh.replicas, cfg.mesh.stages
    if (not cfg.cluster.enabled or cfg.verify.name != "sentinel"
            or not cfg.verify.ends_trusted(replicas)):
        return
    ends = {f"r{r}s{s}" for r in range(replicas) for s in (0, stages - 1)}
    for name, host in sorted(cfg.cluster.hosts.items()):
        untrusted = [w for w in host.workers if w in ends]
        require(host.trusted or not untrusted, f"cluster.hosts.{name}.trusted", host.trusted,
                f"{name} runs {', '.join(untrusted)}, of the first or last stage, which SENTINEL "
                f"assumes honest at {replicas} replicas (verify.trusted_ends = "
                f"{cfg.verify.trusted_ends!r}): set trusted = true if you own this machine, or "
                "place those workers on a trusted host (docs/cluster.md)")
