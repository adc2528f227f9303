"""Architecture warm-up: locked identity blocks unlocked in groups (see docs/warmup.md)."""

from meshlearn.warmup.locking import (
    BlockLocks,
    init_unlocked,
    lock_block,
    locked_layers,
    unlock_block,
    unlock_groups,
)
from meshlearn.warmup.plugin import WarmupCallback, WarmupSchedule, warmup_plugin
from meshlearn.warmup.settings import WarmupConfig, validate_warmup
from meshlearn.warmup.spikes import SPIKE_DELTA_NATS, SPIKE_EMA_BETA, Spikes, find_spikes

__all__ = [
    "SPIKE_DELTA_NATS",
    "SPIKE_EMA_BETA",
    "Spikes",
    "BlockLocks",
    "WarmupCallback",
    "WarmupConfig",
    "WarmupSchedule",
    "find_spikes",
    "init_unlocked",
    "lock_block",
    "locked_layers",
    "unlock_block",
    "unlock_groups",
    "validate_warmup",
    "warmup_plugin",
]
