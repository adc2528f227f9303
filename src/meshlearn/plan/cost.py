"""The simulator in cost-only mode: the real SimDriver over CostWorkers.

``simulate(cfg, steps)`` builds every worker of ``cfg``'s mesh on the meta device (exact parameter
shapes, no storage), with the run's plans, codec (its ``encode`` run on meta tensors, so messages
have the codec's exact wire size), DP strategy (``dp.cost``), links (``train.assemble``'s
network) and compute model, then runs the SimDriver's own event loop for ``steps`` steps with the
trainer's drain points (evaluation, checkpoints, basis updates, the end). Nothing is a second
formula: tokens/s is the virtual clock's, bytes are the links' counters.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from meshlearn.compress.registry import WIRE_DTYPES, build_codec
from meshlearn.compress.subspace import SubspaceCodec, id_dtype
from meshlearn.config import RunConfig
from meshlearn.dp.cost import build_cost_strategy
from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.schedule import build_plan
from meshlearn.mesh.sim import CostSimDriver
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import CostWorker, StepWork
from meshlearn.models.split import build_stage
from meshlearn.train.assemble import build_network, dp_link_profile, stage_in_flight

# Optimizer state in bytes per parameter (fp32): AdamW/NAdamW two moments; SGD its momentum (if
# any); Muon/NuMuon one momentum for matrices (their AdamW part for 1-D tensors is ~1% of a stage).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "nadamw": 8, "sgd": 4, "muon": 4, "numuon": 4}


def cost_codec(cfg: RunConfig):
    """The run's codec; the subspace codec gets a meta basis and token table (its wire layout
    depends on their shapes and the vocabulary, not on their values)."""
    if cfg.codec.name != "subspace":
        return build_codec(cfg.codec, cfg.model)
    m = cfg.model
    codec = SubspaceCodec.__new__(SubspaceCodec)
    codec.table = torch.empty(m.vocab_size, m.d_model, device="meta")
    codec.wire_dtype = WIRE_DTYPES[cfg.codec.wire_dtype]
    codec.ids_dtype = id_dtype(m.vocab_size)
    codec.basis = torch.empty(m.d_model, m.subspace_rank, device="meta")
    codec.version = "cost-only"
    return codec


@functools.lru_cache(maxsize=8)
def meta_stages(model, stages: int) -> tuple:
    """The stage modules on the meta device (shared templates: workers get deep copies)."""
    with torch.device("meta"):
        return tuple(build_stage(model, s, stages) for s in range(stages))


def build_cost_workers(cfg: RunConfig) -> dict[WorkerId, CostWorker]:
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    codec = cost_codec(cfg)
    stages = meta_stages(cfg.model, mesh.stages)
    workers = {}
    for wid in mesh.workers():
        module = copy.deepcopy(stages[wid.stage])
        # The update's own code runs (lr, zero_grad, versions, stashes); its arithmetic is not a
        # cost the device model counts from the optimizer (update_s: 28 bytes per parameter).
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.lr)
        plan = build_plan(cfg.mesh.schedule, wid.stage, mesh.stages, cfg.mesh.microbatches,
                          stage_in_flight(cfg, wid.stage), cfg.mesh.update_every)
        worker = CostWorker(wid, mesh, module, optimizer, codec, plan, cfg.mesh.microbatches,
                            cfg.mesh.weight_stashing, seq_len=cfg.model.seq_len, d_model=cfg.model.d_model)
        worker.dp = build_cost_strategy(cfg.dp, worker, dp_link_profile(cfg, wid))
        workers[wid] = worker
    return workers


class CostSource:
    """The trainer's WorkSource without data: each step's microbatch sizes and its drain points."""

    def __init__(self, cfg: RunConfig, steps: int):
        self.cfg, self.steps = cfg, steps
        self.mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
        self.micro = cfg.train.batch_size // cfg.mesh.replicas // cfg.mesh.microbatches

    def drains_after(self, done: int) -> bool:
        train, every = self.cfg.train, self.cfg.subspace_update.every
        return (done % train.eval_every == 0 or done >= self.steps
                or bool(train.checkpoint_every) and done % train.checkpoint_every == 0
                or bool(every) and done % every == 0)

    def next_drain(self, step: int) -> int:
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


@dataclass
class WorkerMemory:
    weights: int
    grads: int
    optimizer: int
    activations: int
    stash: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.stash


@dataclass
class CostResult:
    """What one cost-only run measured on the virtual clock."""

    steps: int
    tokens: int
    sim_s: float
    tokens_per_s: float
    bytes_per_token_pp: float
    bytes_per_token_dp: float
    bubble_fraction: float
    compute_share: float  # the busiest worker's compute share of virtual time
    pp_link_share: float  # the busiest PP link's serialization share
    dp_link_share: float  # the busiest DP link's share
    binds: str
    memory: WorkerMemory  # the worker with the largest total
    memory_worker: str
    stash_versions: int
    in_flight_peak: int
    dp_wait_s: float = 0.0
    extra: dict = field(default_factory=dict)


def activation_bytes(cfg: RunConfig, stage, batch: int) -> int:
    """Memory one microbatch's forward keeps for its backward on a stage (not a simulator cost:
    the simulator models time, not memory). Per layer and token, 7d + 2·d_kv + 4·ffn values
    (norm inputs/outputs, q/k/v, attention output with flash attention, the residual, SwiGLU's
    gate/up/activation/product) at 2 bytes (bf16 compute, the device model's assumption); the
    head stage adds its fp32 logits (V values per token)."""
    m = cfg.model
    tokens = batch * m.seq_len
    per_token = stage.layers * (7 * m.d_model + 2 * m.kv_heads * m.head_dim + 4 * m.ffn_width) * 2
    if stage.head:
        per_token += m.vocab_size * 4 + m.d_model * 2
    return tokens * per_token


def binding(compute: float, pp: float, dp: float) -> str:
    """The resource with the largest busy share of virtual time; if none is busy half the time, the
    workers wait on propagation delay: latency binds."""
    shares = {"compute": compute, "PP link": pp, "DP link": dp}
    name = max(shares, key=shares.get)
    return name if shares[name] >= 0.5 else "latency"


def simulate(cfg: RunConfig, steps: int) -> CostResult:
    """Run ``steps`` steps of ``cfg`` (its drain points) in cost-only mode."""
    if cfg.sim.compute != "device":
        raise ValueError("sim.compute = 'measured' times real compute; the planner needs the device "
                         "model (sim.compute = device)")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    workers = build_cost_workers(cfg)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    driver = CostSimDriver(mesh, workers, build_network(cfg), ComputeModel(cfg.sim, cfg.model),
                       cfg.train.grad_clip)
    source = CostSource(cfg, steps)
    for t in range(steps):
        driver.run_step(t, source)
    tokens = steps * cfg.train.batch_size * cfg.model.seq_len
    summary = driver.summary_fields(tokens, 0.0)
    sim_s = driver.clock.step_end
    util = summary["worker_utilization"]
    shares = {"pp": 0.0, "dp": 0.0}
    for link in summary["links"]:
        shares[link["axis"]] = max(shares[link["axis"]], link["utilization"])
    compute = max(util.values())
    memory, where = None, ""
    state = OPTIMIZER_STATE_BYTES.get(cfg.optim.name, 8)
    for wid, w in workers.items():
        trainable = sum(p.numel() for p in w.module.parameters() if p.requires_grad)
        act = activation_bytes(cfg, w.shape, source.micro) * w.in_flight_peak
        mem = WorkerMemory(w.param_bytes, 4 * trainable, state * trainable, act, w.stash_bytes)
        if memory is None or mem.total > memory.total:
            memory, where = mem, str(wid)
    return CostResult(
        steps=steps, tokens=tokens, sim_s=sim_s, tokens_per_s=tokens / sim_s,
        bytes_per_token_pp=driver.network.bytes_on_axis("pp") / tokens,
        bytes_per_token_dp=driver.network.bytes_on_axis("dp") / tokens,
        bubble_fraction=summary["bubble_fraction"], compute_share=compute,
        pp_link_share=shares["pp"], dp_link_share=shares["dp"],
        binds=binding(compute, shares["pp"], shares["dp"]), memory=memory, memory_worker=where,
        stash_versions=max(w.stash_peak for w in workers.values()),
        in_flight_peak=max(w.in_flight_peak for w in workers.values()),
        dp_wait_s=driver.dp_wait_s)


__all__ = ["CostResult", "CostSource", "WorkerMemory", "build_cost_workers", "simulate"]
