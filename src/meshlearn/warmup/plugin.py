"""Architecture warm-up as a trainer plugin: lock blocks when the run is built, unlock each group at
a drain point the plugin asks for (weights settled, nothing in flight), on the global schedule.

Every process locks and unlocks the blocks of its own workers from the config alone, so the
simulator and the DistDriver agree without a message, and every replica of a stage draws the same
unlock init (a generator seeded from the run seed and the layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.warmup.locking import BlockLocks, locked_layers, unlock_groups
from meshlearn.warmup.settings import WarmupConfig


@dataclass(frozen=True)
class WarmupSchedule:
    """Which blocks start locked, the unlock groups and the step after which each unlocks."""

    locked: list[int]
    groups: list[list[int]]
    steps: list[int]  # completed steps after which group g unlocks (ascending)

    @classmethod
    def from_config(cls, w: WarmupConfig, n_layer: int, stages: int, lr_warmup_steps: int) -> WarmupSchedule:
        locked = locked_layers(n_layer, stages, w.locked_fraction, w.placement)
        groups = unlock_groups(locked, w.groups, w.order, n_layer, stages)
        start = max(1, lr_warmup_steps if w.start_step < 0 else w.start_step)
        return cls(locked, groups, [start + g * w.unlock_every for g in range(len(groups))])

    def due(self, done: int) -> list[int]:
        return [g for g, step in enumerate(self.steps) if step == done]

    def unlocked_by(self, done: int) -> list[int]:
        return [g for g, step in enumerate(self.steps) if step <= done]

    def depth(self, unlocked: list[int], n_layer: int) -> int:
        """Blocks of the whole model that compute, with groups ``unlocked`` open."""
        return n_layer - len(self.locked) + sum(len(self.groups[g]) for g in unlocked)


class WarmupCallback(Callback):
    """Locks at construction; at each unlock step's drain point unlocks the group on every worker."""

    def __init__(self, cfg: Any, workers: dict, resume_step: int | None):
        self.w: WarmupConfig = cfg.warmup
        self.n_layer, self.seed = cfg.model.n_layer, cfg.seed
        self.schedule = WarmupSchedule.from_config(self.w, cfg.model.n_layer, cfg.mesh.stages,
                                                   cfg.train.warmup_steps)
        self.locks = [BlockLocks(worker.module, worker.optimizer) for worker in workers.values()]
        for locks in self.locks:
            locks.lock(self.schedule.locked)
        self.unlocked: list[int] = []
        self.ramps: list[dict] = []  # {"step", "groups": [(optimizer group, base initial_lr)]}
        # A resumed run opens the groups its checkpoint had open before the optimizer state loads,
        # so the group structure matches (the weights then come from the checkpoint).
        for g in self.schedule.unlocked_by(resume_step or 0):
            self._unlock(g, self.schedule.steps[g])
        if resume_step:
            self._ramp(resume_step)

    def _unlock(self, g: int, done: int) -> None:
        added = []
        for locks in self.locks:
            added += locks.unlock(self.schedule.groups[g], self.w.unlock_init, self.w.init_scale, self.seed)
        self.unlocked.append(g)
        if self.w.lr_ramp_steps:
            self.ramps.append({"step": done, "groups": [(group, group["initial_lr"]) for group in added]})

    def _ramp(self, done: int) -> None:
        """Set each ramping group's base lr for the update of step ``done`` (0-based)."""
        for ramp in self.ramps:
            factor = min(1.0, (done - ramp["step"] + 1) / self.w.lr_ramp_steps)
            for group, base in ramp["groups"]:
                group["initial_lr"] = base * factor
        self.ramps = [r for r in self.ramps if done - r["step"] + 1 < self.w.lr_ramp_steps]

    @property
    def depth(self) -> int:
        return self.schedule.depth(self.unlocked, self.n_layer)

    # --- the hooks ---------------------------------------------------------------------------

    def drains_after(self, done: int) -> bool:
        return bool(self.schedule.due(done))

    def on_drain(self, done: int) -> list[dict]:
        records = []
        for g in self.schedule.due(done):
            if g in self.unlocked:
                continue
            self._unlock(g, done)
            records.append({"kind": "event", "step": done, "event": "warmup_unlock", "group": g,
                            "layers": self.schedule.groups[g], "active_layers": self.depth})
        if records and self.w.lr_ramp_steps:
            self._ramp(done)
        return records

    def on_step_end(self, step: int, report: Any) -> StepOutput:
        if self.ramps:
            self._ramp(step + 1)
        return StepOutput(fields={"active_layers": self.depth})

    def state_dict(self) -> dict:
        return {"unlocked": list(self.unlocked)}

    def load_state_dict(self, state: Any) -> None:
        if state is not None and sorted(state["unlocked"]) != sorted(self.unlocked):
            raise ValueError(f"warm-up: the checkpoint has groups {state['unlocked']} unlocked, the "
                             f"schedule {self.unlocked} at this step; warmup.* changed since it was saved")

    def summary(self) -> dict:
        return {"warmup_locked": self.schedule.locked, "warmup_unlock_steps": self.schedule.steps,
                "warmup_final_depth": self.depth}


def warmup_plugin(ctx: PluginContext) -> WarmupCallback | None:
    if not ctx.cfg.warmup.enabled:
        return None
    return WarmupCallback(ctx.cfg, ctx.workers, ctx.resume_step)
