"""How long compute takes on the virtual clock: measured on this machine, or from a device model.

On these CPUs a small model's compute is slow enough to hide any link, while our users run GPUs
whose compute is fast and whose links are the bottleneck. The device model stands in for such a GPU:
time = FLOPs / (peak FLOP/s × utilization). Measured mode uses the wall time of the real
forward/backward and is what real-process runs are checked against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from meshlearn.models.llama import DecoderConfig

# Dense fp16/bf16 tensor-core peak with fp32 accumulate (no sparsity), and memory bandwidth.
DEVICES: dict[str, tuple[float, float]] = {
    "rtx3090": (71.0, 936.0),
    "rtx4090": (165.2, 1008.0),
    "a100": (312.0, 2039.0),
    "h100": (989.0, 3350.0),
    "l4": (121.0, 300.0),
}

# GPU memory capacity (GB = 1e9 bytes) of the same devices: not a simulator cost (the simulator
# models time), the planner's "does a worker fit?".
DEVICE_MEMORY_GB: dict[str, float] = {"rtx3090": 24.0, "rtx4090": 24.0, "a100": 80.0, "h100": 80.0,
                                      "l4": 24.0}


@dataclass(frozen=True)
class ComputeConfig:
    """Where the virtual clock's compute durations come from. Config keys under ``sim.``."""

    compute: Literal["device", "measured"] = "device"
    """``device`` (FLOP model of ``device``) or ``measured`` (wall time of the real compute here)."""
    device: str = "rtx4090"
    """A GPU from the device table: rtx3090, rtx4090, a100, h100, l4."""
    peak_tflops: float = 0.0
    """Override of the device's peak TFLOP/s; 0 keeps the table's value."""
    utilization: float = 0.4
    """Fraction of peak a real training step reaches (model FLOPs utilization), in (0, 1]."""

    def describe(self) -> str:
        return f"device:{self.device}" if self.compute == "device" else "measured"


class StageShape(NamedTuple):
    """What a stage computes, for FLOP counting (a named tuple: a key the simulator looks up
    at every compute action, hashed and compared in C)."""

    layers: int
    embed: bool
    head: bool


def stage_shape(module: Any) -> StageShape:
    """What a stage module computes now: blocks switched off (``Block.locked``, architecture
    warm-up) are skipped in its forward, so they are not counted."""
    layers = sum(1 for block in module.layers.values() if not getattr(block, "locked", False))
    return StageShape(layers, module.tok_emb is not None, module.head is not None)


@functools.lru_cache(maxsize=256)  # the simulator asks once per compute action, with few distinct shapes
def forward_flops(cfg: DecoderConfig, stage: StageShape, batch: int) -> float:
    """Matmul FLOPs of one forward pass of a stage over ``batch`` sequences of ``cfg.seq_len``.

    Per layer: 2·tokens·(2d² + 2·d·d_kv + 3·d·ffn) for the projections (d_kv = n_kv_head · head
    width: d without grouped-query attention), plus 2·tokens·T·d for the causal attention scores and
    their product with V (half of the dense 4·tokens·T·d). Norms, RoPE and the embedding lookup are
    negligible and not counted.
    """
    tokens = batch * cfg.seq_len
    d, ffn, d_kv = cfg.d_model, cfg.ffn_width, cfg.kv_heads * cfg.head_dim
    per_layer = 2 * tokens * (2 * d * d + 2 * d * d_kv + 3 * d * ffn) + 2 * tokens * cfg.seq_len * d
    flops = stage.layers * per_layer
    if stage.head:
        flops += 2 * tokens * d * cfg.vocab_size
    return float(flops)


class ComputeModel:
    """Turns a compute action into virtual seconds."""

    def __init__(self, cfg: ComputeConfig, model: DecoderConfig):
        self.cfg = cfg
        self.model = model
        peak, mem_gbs = DEVICES[cfg.device]
        peak = cfg.peak_tflops or peak
        self.flops_per_s = peak * 1e12 * cfg.utilization
        self.mem_bytes_per_s = mem_gbs * 1e9
        # Seconds per (stage shape, kind, batch): asked at every compute action of a simulation,
        # with few distinct keys (``forward_flops``'s own cache hashes the whole model config).
        self._seconds: dict[tuple[StageShape, str, int], float] = {}

    def compute_s(self, stage: StageShape, kind: str, batch: int, measured_s: float) -> float:
        """Forward costs its FLOPs; backward twice that (gradients w.r.t. inputs and weights)."""
        if self.cfg.compute == "measured":
            return measured_s
        key = (stage, kind, batch)
        seconds = self._seconds.get(key)
        if seconds is None:
            flops = forward_flops(self.model, stage, batch) * (2.0 if kind == "B" else 1.0)
            seconds = self._seconds[key] = flops / self.flops_per_s
        return seconds

    def update_s(self, n_params: int, measured_s: float) -> float:
        """An optimizer step is memory-bound: ~7 fp32 tensors read or written per parameter."""
        if self.cfg.compute == "measured":
            return measured_s
        return 28.0 * n_params / self.mem_bytes_per_s
