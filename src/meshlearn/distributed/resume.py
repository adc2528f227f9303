"""What a distributed run cannot resume from yet, refused in one line before any process starts.

The launcher checks before it spawns anything, and every worker checks again (a worker started by
hand with ``meshlearn worker --resume`` has no launcher in front of it).
"""

from __future__ import annotations

from pathlib import Path

from meshlearn.config import RunConfig
from meshlearn.distributed.groups import anchors
from meshlearn.elastic.evictions import refuse_resume_when_verified
from meshlearn.errors import ConfigError


def refuse_resume(cfg: RunConfig, run_dir: Path) -> None:
    if anchors(cfg):
        raise ConfigError("--resume", str(run_dir), "a dist run with an anchor circuit (anchor.z > 0) cannot "
                                                    "resume yet (its passes in flight are not checkpointed)")
    refuse_resume_when_verified(cfg, run_dir)
