"""Memory per worker: the one planner number the simulator does not produce (it models time).

Weights, gradients and stashed versions are the cost-only workers' own counts (fp32 parameters of
the stage's exact shapes; ``stash_peak`` versions held at once); optimizer state is bytes per
parameter by optimizer; activations are what one microbatch's forward keeps for its backward,
times the most microbatches a worker held in flight during the simulation.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.config import RunConfig
from meshlearn.mesh.compute import StageShape
from meshlearn.mesh.worker import Worker

# Optimizer state in bytes per parameter (fp32): AdamW/NAdamW two moments; SGD its momentum (if
# any); Muon/NuMuon one momentum for matrices (their AdamW part for 1-D tensors is ~1% of a stage).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "nadamw": 8, "sgd": 4, "muon": 4, "numuon": 4}


@dataclass(frozen=True)
class WorkerMemory:
    weights: int
    grads: int
    optimizer: int
    activations: int
    stash: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.stash


def activation_bytes(cfg: RunConfig, stage: StageShape, batch: int) -> int:
    """Bytes one microbatch's forward keeps for its backward on a stage. Per layer and token,
    7d + 2·d_kv + 4·ffn values (norm inputs/outputs, q/k/v, attention output with flash
    attention, the residual, SwiGLU's gate/up/activation/product) at 2 bytes (bf16 compute, the
    device model's assumption); the head stage adds its fp32 logits (V values per token)."""
    m = cfg.model
    tokens = batch * m.seq_len
    per_token = stage.layers * (7 * m.d_model + 2 * m.kv_heads * m.head_dim + 4 * m.ffn_width) * 2
    if stage.head:
        per_token += m.vocab_size * 4 + m.d_model * 2
    return tokens * per_token


def worker_memory(cfg: RunConfig, worker: Worker, micro: int) -> WorkerMemory:
    state = OPTIMIZER_STATE_BYTES.get(cfg.optim.name, 8)
    trainable = worker.trainable_bytes // 4  # fp32 parameters
    return WorkerMemory(worker.param_bytes, worker.trainable_bytes, state * trainable,
                        activation_bytes(cfg, worker.shape, micro) * worker.in_flight_peak,
                        worker.stash_bytes)


def largest(cfg: RunConfig, workers: dict, micro: int) -> tuple[WorkerMemory, str]:
    """The worker that needs the most memory, and its name."""
    best = max(workers, key=lambda w: worker_memory(cfg, workers[w], micro).total)
    return worker_memory(cfg, workers[best], micro), str(best)
