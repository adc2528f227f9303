"""The simulator in cost-only mode: the real SimDriver over cost-only workers.

``CostRun(cfg, drain_at)`` builds every worker of ``cfg``'s mesh on the meta device (exact
parameter shapes, no storage), with the run's plans, codec (its ``encode`` run on meta tensors, so
messages have the codec's exact wire size), DP strategy (``dp.cost``), links (``assemble``'s
network) and compute model, and steps the SimDriver's own event loop. Nothing is a second
formula: time is the virtual clock's, bytes are the links' counters, busy time the clock's.

``simulate(cfg, steps)`` is a whole run with the trainer's drain points (evaluation, checkpoints,
basis updates, the end): what ``meshlearn train`` would report on the virtual clock.

When the replicas are mirror images (``plan.mirror.mirrors``: symmetric links), only replica 0's
row is simulated (``MirrorCollectives``): the same numbers from 1/D of the events. ``mirror=False``
simulates every replica (what the tests compare it with).

With ``anchor.z > 0`` the anchor circuit runs beside the fast one (``plan.anchor``: the trainer's
anchor plugin over a circuit without arithmetic), called at each step end as the trainer calls
it; the window then also has the anchor's bytes and whether it keeps up (``Window.anchor``).

``critical_path=True`` runs the same simulation on seconds that carry their resource
(``plan.critical``): each window then also says how its critical path splits between compute,
PP and DP bandwidth, latency and optimizer steps (``Window.path``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from meshlearn.anchor.feedback import attach_feedback
from meshlearn.compress.directional import DirectionalCodec
from meshlearn.compress.registry import SAME, WIRE_DTYPES, BackwardCodecConfig, build_codec
from meshlearn.compress.subspace import SubspaceCodec, id_dtype
from meshlearn.config import RunConfig
from meshlearn.dp.cost import build_cost_strategy
from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.network import Network, build_run_network
from meshlearn.mesh.schedule import build_plan, pipeline_in_flight
from meshlearn.mesh.sim import SimDriver
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import CostOnly, StepWork, Worker
from meshlearn.models.split import build_stage
from meshlearn.optim.spectral import SpectralCorrection
from meshlearn.plan.anchor import AnchorMarks, AnchorWindow, CostAnchorCallback
from meshlearn.plan.collectives import SizeCollectives
from meshlearn.plan.critical import Seconds, SensitiveCompute, sensitive_network
from meshlearn.plan.mask import MaskCostCodec
from meshlearn.plan.mirror import MirrorCollectives, mirrors


def cost_codec(cfg: RunConfig, mask_keep: float | None = None):
    """The run's codec, each direction's (``codec.backward`` may name the gradients' own); the
    random mask as its cost-only stand-in, whose bytes need no message context. ``mask_keep``: the
    planner's stand-in for the forward mask codec (``plan.mask``)."""
    forward = _forward_cost_codec(cfg, mask_keep)
    back = cfg.codec.backward
    if back.name == SAME:
        return forward
    wire = WIRE_DTYPES[cfg.codec.wire_dtype]
    own = dataclasses.replace(cfg.codec, name=back.name, backward=BackwardCodecConfig())
    backward = MaskCostCodec(back.keep, wire) if back.name == "mask" else build_codec(own, cfg.model)
    return DirectionalCodec(forward, backward)


def _forward_cost_codec(cfg: RunConfig, mask_keep: float | None):
    """The subspace codec gets a meta basis and token table (its wire layout depends on their
    shapes and the vocabulary, not on their values)."""
    if mask_keep is not None:
        return MaskCostCodec(mask_keep, WIRE_DTYPES[cfg.codec.wire_dtype])
    if cfg.codec.name != "subspace":
        return build_codec(dataclasses.replace(cfg.codec, backward=BackwardCodecConfig()), cfg.model)
    m = cfg.model
    codec = SubspaceCodec.__new__(SubspaceCodec)
    codec.table = torch.empty(m.vocab_size, m.d_model, device="meta")
    codec.wire_dtype = WIRE_DTYPES[cfg.codec.wire_dtype]
    codec.ids_dtype = id_dtype(m.vocab_size)
    codec.basis = torch.empty(m.d_model, m.subspace_rank, device="meta")
    codec.version = "cost-only"
    return codec


class NoInitialization(TorchFunctionMode):
    """Leaves out the random initialization of a module's weights (``nn.init``'s fills and the
    tensor methods they call): on the meta device there are no values to draw, and each draw
    still ran through torch's Python decompositions (most of building an 8B model's stages)."""

    FILLS = frozenset({torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_,
                       torch.nn.init.kaiming_uniform_, torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:
            return args[0] if args else kwargs["tensor"]  # in place: the tensor, as it is
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def meta_stages(model, stages: int) -> tuple:
    """The stage modules on the meta device, one per stage, shared by every replica's cost-only
    worker and every simulation of this shape (nothing in cost-only mode writes to them)."""
    with torch.device("meta"), NoInitialization():
        return tuple(build_stage(model, s, stages) for s in range(stages))


class NoArithmetic:
    """The optimizer of a cost-only worker: the update's own code runs around it (lr per step,
    versions, stashes), its arithmetic does not (the device model charges ``update_s``, 28 bytes
    per parameter, whatever the optimizer does)."""

    def __init__(self, lr: float):
        self.param_groups = [{"lr": lr}]
        self.state: dict = {}

    def step(self) -> None:
        """No values to update."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No gradients are ever stored."""


def dp_profile(network: Network, mesh: MeshShape, wid: WorkerId):
    """``assemble.dp_link_profile`` over an already built network."""
    peers = [WorkerId(r, wid.stage) for r in range(mesh.replicas) if r != wid.replica]
    profiles = [network.link(wid, p).profile for p in peers] or [network.link(wid, wid).profile]
    return max(profiles, key=lambda p: (p.serialization_s(1 << 20) + p.latency_s))


def build_cost_workers(cfg: RunConfig, network: Network, mask_keep: float | None = None,
                       row: bool = False) -> dict[WorkerId, Worker]:
    """Every worker of ``cfg``'s mesh (``row``: replica 0's only, each built for the whole mesh)."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    codec = cost_codec(cfg, mask_keep)
    stages = meta_stages(cfg.model, mesh.stages)
    depths = pipeline_in_flight(cfg)
    workers = {}
    for wid in MeshShape(1, mesh.stages).workers() if row else mesh.workers():
        optimizer = NoArithmetic(cfg.train.lr)
        plan = build_plan(cfg.mesh.schedule, wid.stage, mesh.stages, cfg.mesh.microbatches,
                          depths[wid.stage], cfg.mesh.update_every)
        worker = Worker(wid, mesh, stages[wid.stage], optimizer, codec, plan, cfg.mesh.microbatches,
                        cfg.mesh.weight_stashing, cost_only=CostOnly(cfg.model.seq_len, cfg.model.d_model))
        with torch.device("meta"):  # what a strategy allocates (PowerSGD's Q, DiLoCo's copies) is shape only
            worker.dp = build_cost_strategy(cfg.dp, worker, dp_profile(network, mesh, wid))
        if cfg.anchor.z:  # the anchor's targets and its arrivals' counters; never attached (no values)
            worker.spectral = SpectralCorrection(worker.module.named_parameters(), cfg.optim.spectral)
            attach_feedback(worker.spectral, cfg)  # keeps nothing (no updates): counts what arrived
        workers[wid] = worker
    return workers


class CostSource:
    """The trainer's WorkSource without data: each step's microbatch sizes and its drain points.
    ``drain_at``: a single drain after that many steps instead of the configured ones (a
    steady-state measurement); None: the trainer's drain points for a run of ``steps``.
    ``row``: work for replica 0's row only (``plan.mirror``)."""

    def __init__(self, cfg: RunConfig, steps: int, drain_at: int | None = None, row: bool = False):
        self.cfg, self.steps, self.drain_at = cfg, steps, drain_at
        self.mesh = MeshShape(1 if row else cfg.mesh.replicas, cfg.mesh.stages)
        self.micro = cfg.train.batch_size // cfg.mesh.replicas // cfg.mesh.microbatches

    def drains_after(self, done: int) -> bool:
        if self.drain_at is not None:
            return done >= self.drain_at
        return configured_drain(self.cfg, done, self.steps)

    def next_drain(self, step: int) -> int:
        if self.drain_at is not None:
            return max(step, self.drain_at - 1)
        t = step
        while not self.drains_after(t + 1):
            t += 1
        return t

    def work(self, step: int) -> dict[WorkerId, StepWork]:
        m, last = self.cfg.mesh.microbatches, self.mesh.stages - 1
        return {wid: StepWork(step, self.micro, 1.0,
                              tokens=[None] * m if wid.stage == 0 else None,
                              targets=[None] * m if wid.stage == last else None)
                for wid in self.mesh.workers()}


def configured_drain(cfg: RunConfig, done: int, steps: int) -> bool:
    """Whether the trainer drains the pipeline after ``done`` steps of a ``steps``-step run."""
    train, every = cfg.train, cfg.subspace_update.every
    return (done % train.eval_every == 0 or done >= steps
            or bool(train.checkpoint_every) and done % train.checkpoint_every == 0
            or bool(every) and done % every == 0)


@dataclass(frozen=True)
class Counters:
    """The run's cumulative counters at one step's end."""

    steps: int
    sim_s: float
    busy_s: dict[WorkerId, float]
    link_busy_s: dict[tuple[WorkerId, WorkerId], float]
    link_axis: dict[tuple[WorkerId, WorkerId], str]
    bytes_pp: int
    bytes_dp: int
    uplink_busy_s: dict[WorkerId, float]  # each sender's access link (``links.access = uplink``)
    anchor: AnchorMarks | None = None  # ``anchor.z > 0``


@dataclass(frozen=True)
class Window:
    """What the mesh did between two counter snapshots, on the virtual clock."""

    steps: int
    tokens: int
    sim_s: float
    bytes_pp: int
    bytes_dp: int
    compute_share: float  # the busiest worker's compute time / sim_s
    pp_link_share: float  # the busiest PP link's serialization time / sim_s
    dp_link_share: float  # the busiest DP link's
    idle_fraction: float  # idle share of all workers' time
    path: dict[str, float] | None = None  # the critical path's share per resource (plan.critical)
    uplink_share: float = 0.0  # the busiest access link's sending time / sim_s (PP, DP, anchor bytes)
    anchor: AnchorWindow | None = None  # ``anchor.z > 0``: its bytes, and whether it keeps up

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.sim_s


class CostRun:
    """One cost-only simulation, stepped by the caller (``mirror``: one replica row when the
    replicas are mirror images, see ``plan.mirror``)."""

    def __init__(self, cfg: RunConfig, steps: int, drain_at: int | None = None,
                 mask_keep: float | None = None, mirror: bool = True, critical_path: bool = False):
        if cfg.sim.compute != "device":
            raise ValueError("sim.compute = 'measured' times real compute; the planner needs the "
                             "device model (sim.compute = device)")
        self.cfg = cfg
        self.mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
        network = build_run_network(cfg)
        compute = ComputeModel(cfg.sim, cfg.model)
        if critical_path:
            network, compute = sensitive_network(network), SensitiveCompute(cfg.sim, cfg.model)
        self.mirrored = mirror and mirrors(cfg)
        self.workers = build_cost_workers(cfg, network, mask_keep, row=self.mirrored)
        self.collectives = MirrorCollectives(self.mesh) if self.mirrored else SizeCollectives()
        simulated = MeshShape(1, self.mesh.stages) if self.mirrored else self.mesh
        self.driver = SimDriver(simulated, self.workers, network, compute, cfg.train.grad_clip,
                                self.collectives)
        self.source = CostSource(cfg, steps, drain_at, row=self.mirrored)
        self.done = 0
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.anchor = CostAnchorCallback(cfg, self.workers, self.driver, steps) if cfg.anchor.z else None

    def run(self, steps: int) -> Counters:
        if self.anchor is not None and self.done == 0 and steps:
            self.anchor.start()
        for _ in range(steps):
            reports = self.driver.run_step(self.done, self.source)
            if self.anchor is not None:  # as the trainer calls its plugins: once per report
                for report in reports:
                    self.anchor.on_step_end(report.step, report)
            self.done += 1
        return self.counters()

    def counters(self) -> Counters:
        network = self.driver.network
        links = network.links
        return Counters(self.done, self.driver.clock.step_end, dict(self.driver.clock.busy_s),
                        {k: link.busy_s for k, link in links.items()},
                        {k: link.axis for k, link in links.items()},
                        self.collectives.bytes_on_axis(network, "pp"),
                        self.collectives.bytes_on_axis(network, "dp"),
                        {w: up.busy_s for w, up in network.uplinks.items()},
                        AnchorMarks.of(self.anchor) if self.anchor is not None else None)

    def window(self, a: Counters, b: Counters) -> Window:
        seconds = b.sim_s - a.sim_s
        busy = {w: b.busy_s[w] - a.busy_s.get(w, 0.0) for w in b.busy_s}
        shares = {"pp": 0.0, "dp": 0.0}
        for key, axis in b.link_axis.items():
            shares[axis] = max(shares[axis], (b.link_busy_s[key] - a.link_busy_s.get(key, 0.0)) / seconds)
        return Window(b.steps - a.steps, (b.steps - a.steps) * self.tokens_per_step, float(seconds),
                      b.bytes_pp - a.bytes_pp, b.bytes_dp - a.bytes_dp,
                      float(max(busy.values()) / seconds), float(shares["pp"]), float(shares["dp"]),
                      float(1.0 - sum(busy.values()) / (len(busy) * seconds)),
                      seconds.shares() if isinstance(seconds, Seconds) else None,
                      float(max((t - a.uplink_busy_s.get(w, 0.0) for w, t in b.uplink_busy_s.items()),
                                default=0.0) / seconds),
                      AnchorWindow.between(a.anchor, b.anchor, (b.steps - a.steps) * self.tokens_per_step,
                                           self.cfg.anchor.max_late) if b.anchor is not None else None)


def simulate(cfg: RunConfig, steps: int, mask_keep: float | None = None,
             mirror: bool = True, critical_path: bool = False) -> tuple[CostRun, Window]:
    """A whole run of ``steps`` steps of ``cfg`` with its drain points, in cost-only mode."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    run = CostRun(cfg, steps, mask_keep=mask_keep, mirror=mirror, critical_path=critical_path)
    start = run.counters()
    return run, run.window(start, run.run(steps))


__all__ = ["CostRun", "CostSource", "Counters", "Window", "build_cost_workers", "configured_drain",
           "simulate"]
