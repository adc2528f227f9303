"""The anchor's clean gradient as a delayed error feedback (``anchor.use = error_feedback``).

Issue 29, item 4(b). A fast worker's update at step t used its masked gradient g_masked(t); the
anchor later delivers the clean gradient g_clean(t) of the same matrices, computed on step t's
batch at the weights step t began with. Instead of using it as the spectral filter's basis, the
worker adds the error it made at t to its updates of the step at which the anchor's share arrives
(t + K when the anchor keeps up):

    c_t = g_clean(t) − g_masked(t),   G ← G + c_t   at every update of the first step ≥ arrival

so that, summed over time, the updates follow the clean gradients (error feedback, as in
EF-SGD / EF21, with the anchor as the reference). Why the pieces:

- **What is kept.** Only the steps the anchor is handed (t ≡ 0 mod K): per targeted matrix the
  mean, over the step's updates, of the gradient that entered the update (after the DP average and
  the clip, before any correction), in fp32. Under async a step has one update per microbatch
  group, each a group's mean, so their mean is the step's mean gradient: the anchor's normalization.
- **How long.** Until the share for t arrives (``receive``: the kept gradient becomes c_t and is
  freed), until the anchor's share is dropped as late (``forget``), and never longer than
  ``horizon`` (= K + anchor.max_late) steps: at most ⌊horizon / K⌋ + 1 steps are held.
- **Where c_t goes.** Into every update of the first step whose updates start after the arrival
  (one update under 1F1B/GPipe; under async one per microbatch group, M updates that made the
  error M times at step t, so a step already begun when the share arrives waits for the next),
  after the clip: the clip bounds the fast gradient, the correction is the anchor's measurement
  of that gradient's error.

Memory: one fp32 copy of the targeted matrices per kept step and per pending correction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class FeedbackCounters:
    corrections: int = 0  # matrices whose clean gradient became a correction
    unmatched: int = 0  # clean gradients for a step (or matrix) with nothing kept: not used
    forgotten: int = 0  # kept steps freed without their share (dropped late, or past the horizon)
    applied_updates: int = 0  # updates that had a correction added
    held_bytes_peak: int = 0  # the most bytes of kept gradients and corrections held at once


@dataclass
class Kept:
    """One handed-off step's masked gradients: their sum over the step's updates, and the count."""

    sums: dict[str, Tensor]
    updates: int = 0


class AnchorErrorFeedback:
    """The kept masked gradients and pending corrections of one worker's targeted matrices.

    ``params``: name → parameter (the anchor's targets on this stage); ``every``: K, the steps
    handed to the anchor are its multiples; ``horizon``: the most steps a kept gradient waits.
    ``before_update(step)`` runs inside each optimizer step (the spectral correction's pre-hook).
    """

    def __init__(self, params: dict[str, Tensor], every: int, horizon: int):
        self.params, self.every, self.horizon = params, every, horizon
        self.kept: dict[int, Kept] = {}
        self.ready: dict[str, Tensor] = {}  # arrived, not yet bound to a step
        self.bound_step = -1  # the step whose updates get ``bound``
        self.last_step = -1  # the step of the last update seen
        self.bound: dict[str, Tensor] = {}
        self.counters = FeedbackCounters()

    # --- the update ----------------------------------------------------------------------------

    @torch.no_grad()
    def before_update(self, step: int) -> None:
        """Keep this update's gradients if ``step`` is handed off, then add the pending corrections."""
        first = step != self.last_step  # this update starts step ``step``
        self.last_step = step
        if step % self.every == 0:
            self._keep(step)
        if self.bound and self.bound_step < step:
            self.bound, self.bound_step = {}, -1  # its step's updates are over
        if self.ready and first:  # a step already begun waits: every update of one step gets c
            self.bound, self.bound_step = self.ready, step
            self.ready = {}
        self.counters.held_bytes_peak = max(self.counters.held_bytes_peak, self.held_bytes)
        touched = False
        for name, c in self.bound.items():
            grad = self.params[name].grad
            if grad is not None:
                grad.add_(c.to(grad.dtype))
                touched = True
        self.counters.applied_updates += touched

    def _keep(self, step: int) -> None:
        for old in [t for t in self.kept if t < step - self.horizon]:
            del self.kept[old]
            self.counters.forgotten += 1
        kept = self.kept.setdefault(step, Kept({}))
        for name, param in self.params.items():
            if param.grad is None:
                continue
            grad = param.grad.detach().float()
            if name in kept.sums:
                kept.sums[name].add_(grad)
            else:
                kept.sums[name] = grad.clone()
        kept.updates += 1

    # --- arrivals ------------------------------------------------------------------------------

    def receive(self, name: str, clean: Tensor, step: int) -> bool:
        """The anchor's clean gradient of ``name`` for ``step``: c = clean − (kept mean), queued for
        the next update's step; the kept gradient is freed. False if nothing was kept for it."""
        kept = self.kept.get(step)
        if kept is None or name not in kept.sums:
            self.counters.unmatched += 1
            return False
        masked = kept.sums.pop(name).div_(kept.updates)
        if not kept.sums:
            del self.kept[step]
        correction = clean.to(device=masked.device, dtype=torch.float32) - masked
        self.ready[name] = self.ready[name].add_(correction) if name in self.ready else correction
        self.counters.corrections += 1
        return True

    def forget(self, step: int) -> None:
        """The anchor's share for ``step`` will not come (dropped as late): free what was kept."""
        if self.kept.pop(step, None) is not None:
            self.counters.forgotten += 1

    @property
    def held_bytes(self) -> int:
        """Bytes of kept gradients and pending corrections now (fp32)."""
        tensors = [*(t for k in self.kept.values() for t in k.sums.values()), *self.ready.values(),
                   *self.bound.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- bookkeeping ---------------------------------------------------------------------------

    def summary(self) -> dict[str, int]:
        c = self.counters
        return {"ef_corrections": c.corrections, "ef_unmatched": c.unmatched, "ef_forgotten": c.forgotten,
                "ef_applied_updates": c.applied_updates, "ef_held_bytes_peak": c.held_bytes_peak}

    def state_dict(self) -> dict:
        return {"kept": {str(t): {"sums": dict(k.sums), "updates": k.updates} for t, k in self.kept.items()},
                "ready": dict(self.ready), "bound": dict(self.bound), "bound_step": self.bound_step,
                "last_step": self.last_step,
                "counters": dict(vars(self.counters))}

    def load_state_dict(self, state: dict) -> None:
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")

        def here(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
            return {n: t.to(device) for n, t in tensors.items()}

        self.kept = {int(t): Kept(here(k["sums"]), k["updates"]) for t, k in state["kept"].items()}
        self.ready, self.bound = here(state["ready"]), here(state["bound"])
        self.bound_step, self.last_step = state["bound_step"], state["last_step"]
        self.counters = FeedbackCounters(**state["counters"])
