"""The anchor circuit as a trainer plugin (``anchor.z > 0``): hand-offs and arrivals at step ends.

Every ``anchor.delay`` = K steps (t = 0, K, 2K, ...) the plugin hands an anchor replica the weights
as they stand when step t begins (at step t − 1's end; at the start for t = 0) and the ids of step
t's batch; the pass runs at once in this process (``AnchorCircuit``) and yields per fast worker the
virtual time its stage's share arrives. The weights: under ``anchor.weights = outer`` those every
fast replica agrees on (fast replica 0's strategy's ``agreed_weights``, else its live ones, which a
non-drifting strategy keeps common), which the anchor follows by listening: at every step end fast
(0, s) relays the reduced result of its stage's new DP rounds over the anchor's link
(``relay_bytes``, ``AnchorCircuit.listen``), and the anchor would apply the replicas' update itself
— modelled, not replayed: the plugin reads the agreed weights from fast replica 0, what a replay
computes (docs/adaptation.md); under ``snapshot`` fast replica 0's live weights, sent at the
hand-off. At each step end the plugin hands each fast worker's spectral correction every share that
is due (computed for step t, now ≥ t + K) and has arrived by that worker's own virtual clock
(``Worker.spectral.receive_basis`` for factors, ``receive_anchor`` for gradients,
``receive_correction`` under ``anchor.use = error_feedback``); one still missing
``anchor.max_late`` steps past its due step is dropped and counted (and the worker frees what it
kept for it). The fast circuit never waits: the plugin reads the run's clocks
(``PluginContext.clock``) and never moves them.

The circuit is charged with the simulator's link and compute models (``PluginContext.time_models``):
its anchor stages are simulated processes beside the mesh.

Why step ends: an arrival is folded in before the worker's next optimizer step that the trainer
can see, so the worker uses exactly what had arrived by then (under the async schedule a worker
already ahead of the step's end has applied updates that could have used it: the plugin is at
worst one step late, never early).

Under async the stages' weights at a step's end belong to slightly different versions (each
stage's own): the pass uses each stage's current weights, as a real hand-off would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from meshlearn.anchor.actor import AnchorCounters, FastSide, Fate
from meshlearn.anchor.circuit import AnchorCircuit
from meshlearn.anchor.settings import link_profile, stage_targets
from meshlearn.data.run_data import RunData
from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.mesh.driver import Clock, TimeModels
from meshlearn.mesh.topology import WorkerId
from meshlearn.optim.spectral import AnchorBasis


def relay_bytes(sent: int, replicas: int, collective: bool) -> int:
    """The reduced result of DP rounds in which one replica sent ``sent`` bytes: what the anchor
    receives to follow the agreed weights (``anchor.weights = outer``), one contribution's size.
    The ring all-reduce (``collective``) sends 2(D − 1) chunks of ⌈N/D⌉ per member, so the result is
    D·⌈N/D⌉ (N up to the padding of the last chunk); the message strategies send their part to each
    of the D − 1 peers, so it is ``sent`` / (D − 1)."""
    if replicas < 2:
        return 0
    return sent * replicas // (2 * (replicas - 1)) if collective else sent // (replicas - 1)


@dataclass
class Delivery:
    """One fast worker's share of a pass, until it is folded in or dropped."""

    step: int  # computed for this step's weights and batch
    worker: WorkerId
    arrival_s: float
    share: dict  # name → gradient (send = gradients) or name → AnchorBasis (send = factors)


class AnchorCallback(Callback):
    circuit_class: type[AnchorCircuit] = AnchorCircuit  # ``plan.anchor``: the cost-only one

    def __init__(self, cfg: Any, workers: dict, clock: Clock, models: TimeModels, data: RunData | None,
                 fresh: bool):
        """``clock``: the fast workers' (virtual) clocks; ``models``: the links and compute the
        circuit is charged with; ``data``: the run's batches (None for a subclass that hands
        batches by shape)."""
        self.cfg, self.a = cfg, cfg.anchor
        self.workers, self.clock, self.network, self.data = workers, clock, models.network, data
        stages, replicas = cfg.mesh.stages, cfg.mesh.replicas
        fast = [workers[WorkerId(0, s)] for s in range(stages)]
        targets = [stage_targets(cfg, w.spectral.params) for w in fast]
        profile = link_profile(self.network.axes.get("pp", self.network.default), self.a)
        self.circuit = self.circuit_class([w.module for w in fast], targets, self.a.z, replicas,
                                          models.compute, profile, self.a.wire_dtype, cfg.seed,
                                          send=self.a.send, rank=self.a.rank,
                                          beta=cfg.optim.spectral.beta_anc, weights=self.a.weights,
                                          uplink=self.network.uplink, **self._circuit_extra())
        self.dp_seen = [0] * stages  # what fast (0, s) had sent on its DP links at the last relay
        self.pending: list[Delivery] = []
        self.fast = FastSide(self.a.delay, self.a.max_late, self.a.send, self.a.use)
        self.steps_seen = 0
        if fresh:
            self._hand_off(0)

    @property
    def counters(self) -> AnchorCounters:
        return self.fast.counters

    def _circuit_extra(self) -> dict:
        """Keys of ``circuit_class`` beyond ``AnchorCircuit``'s (none here)."""
        return {}

    # --- hand-offs and arrivals --------------------------------------------------------------

    def _batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Replica 0's microbatches of ``step``, exactly as the trainer cuts them."""
        return self.data.microbatches_of(step, self.cfg.mesh.replicas, 0)

    def _weights(self, wid: WorkerId) -> dict[str, torch.Tensor]:
        """What the anchor computes on for stage ``wid.stage``: the agreed weights (outer) or the
        live ones (snapshot; and outer under a strategy that keeps the live ones common)."""
        worker = self.workers[wid]
        agreed = (worker.dp.agreed_weights() if self.a.weights == "outer" and worker.dp is not None
                  else None)
        return agreed or {n: p.detach() for n, p in worker.module.named_parameters()}

    def _listen(self) -> None:
        """``weights = outer``: relay to the anchor the reduced result of fast (0, s)'s DP rounds
        since the last step end (``relay_bytes`` of what it sent on its DP links)."""
        links = self.network.links.values()
        fast = [WorkerId(0, s) for s in range(self.cfg.mesh.stages)]
        sent = [sum(link.bytes_sent for link in links if link.axis == "dp" and link.src == w) for w in fast]
        fresh = [relay_bytes(total - seen, self.cfg.mesh.replicas, self._collective(w))
                 for total, seen, w in zip(sent, self.dp_seen, fast, strict=True)]
        self.dp_seen = sent
        self.circuit.listen([self.clock.worker_s(w) for w in fast], fresh)

    def _collective(self, wid: WorkerId) -> bool:
        dp = self.workers[wid].dp
        return dp is None or dp.collective

    def _hand_off(self, step: int) -> None:
        stages = self.cfg.mesh.stages
        fast = [WorkerId(0, s) for s in range(stages)]
        weights = [self._weights(w) for w in fast]
        sent_at = [self.clock.worker_s(w) for w in fast]
        result = self.circuit.run_pass(step, weights, sent_at, self._batches(step))
        for wid, arrival in result.arrival_s.items():
            self.pending.append(Delivery(step, wid, arrival, result.shares[wid.stage]))

    def _deliver(self, now: int) -> dict[str, int]:
        """Fold in what is due and has arrived by each worker's clock; drop what is too late
        (``FastSide``: the rule every runtime applies)."""
        before = (self.counters.delivered, self.counters.dropped_late)
        kept = []
        for d in self.pending:
            fate = self.fast.settle(now, d.step, d.arrival_s <= self.clock.worker_s(d.worker))
            if fate is Fate.DELIVER:
                self.fast.fold(self.workers[d.worker].spectral, d.share, d.step, now)
            elif fate is Fate.DROP:
                self.fast.drop(self.workers[d.worker].spectral, d.step)
            elif fate is Fate.WAIT:
                kept.append(d)
        self.pending = kept
        return {"delivered": self.counters.delivered - before[0],
                "dropped_late": self.counters.dropped_late - before[1]}

    # --- the hooks ---------------------------------------------------------------------------

    def on_step_end(self, step: int, report: Any) -> StepOutput:
        now = step + 1  # the next step to run: what arrived by now is used from its update on
        self.steps_seen = now
        events = self._deliver(now)
        if self.a.weights == "outer":
            self._listen()
        if now % self.a.delay == 0 and now < self.cfg.train.steps:
            self._hand_off(now)
        records = []
        if any(events.values()):
            records.append({"kind": "anchor", "step": now, **events})
        return StepOutput({"bytes_anchor": self.circuit.bytes.total}, records)

    def summary(self) -> dict:
        c, b = self.counters, self.circuit.bytes
        tokens = self.steps_seen * self.cfg.train.batch_size * self.cfg.model.seq_len
        out = {"anchor_passes": self.circuit.passes, "anchor_delivered": c.delivered,
               "anchor_dropped_late": c.dropped_late, "anchor_pending_at_end": len(self.pending),
               "anchor_mean_staleness": c.staleness_sum / c.delivered if c.delivered else None,
               "anchor_max_late_steps": c.late_max,
               "anchor_bytes_snapshot": b.snapshot, "anchor_bytes_boundary": b.boundary,
               "anchor_bytes_gradients": b.gradients, "anchor_bytes_factors": b.factors,
               "anchor_bytes_listen": b.listen,
               "bytes_per_token_anchor": b.total / tokens if tokens else 0.0,
               "anchor_busy_s": {str(w): t for w, t in sorted(self.circuit.busy_s.items())}}
        for worker in self.workers.values():  # the correction's own counters, over every worker
            for key, value in worker.spectral.summary().items():
                out[key] = out.get(key, 0) + value
        return out

    def state_dict(self) -> dict:
        return {"circuit": self.circuit.state(), "counters": vars(self.counters).copy(),
                "steps_seen": self.steps_seen, "dp_seen": list(self.dp_seen),
                "pending": [{"step": d.step, "worker": str(d.worker), "arrival_s": d.arrival_s,
                             "share": {k: _plain(v) for k, v in d.share.items()}} for d in self.pending]}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        self.circuit.load_state(state["circuit"])
        self.fast.counters = AnchorCounters(**state["counters"])
        self.steps_seen, self.dp_seen = state["steps_seen"], list(state["dp_seen"])
        self.pending = [Delivery(d["step"], WorkerId.parse(d["worker"]), d["arrival_s"],
                                 {k: AnchorBasis(**v) if isinstance(v, dict) else v
                                  for k, v in d["share"].items()})
                        for d in state["pending"]]


def _plain(value: Tensor | AnchorBasis) -> Tensor | dict[str, Tensor]:
    """A share's value as a checkpoint holds it: a factor basis as its three tensors (a checkpoint
    stores data, never a class to construct: meshlearn/statefile.py)."""
    return vars(value).copy() if isinstance(value, AnchorBasis) else value


def anchor_plugin(ctx: PluginContext) -> Callback | None:
    """The simulated anchor circuit (under dist the anchor stages are processes of their own, and
    the entry point builds ``distributed.anchor.dist_anchor_plugin`` instead)."""
    if ctx.cfg.anchor.z == 0:
        return None
    if ctx.time_models is None:
        raise RuntimeError("the simulated anchor circuit needs the simulator's link and compute models")
    return AnchorCallback(ctx.cfg, ctx.workers, ctx.clock, ctx.time_models, ctx.data,
                          fresh=ctx.resume_step is None)
