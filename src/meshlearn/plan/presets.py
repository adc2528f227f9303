"""What ``meshlearn plan`` knows by name: model shapes and device memory."""

from __future__ import annotations

# model.* keys per preset (--model NAME); applied after --config and before --set.
MODELS: dict[str, dict[str, object]] = {
    "demo": {"vocab_size": 256, "n_layer": 4, "d_model": 128, "n_head": 4, "n_kv_head": 0,
             "seq_len": 128, "ffn_hidden": 0},
    # SmolLM2-135M: GQA 9/3, tied embeddings (untied across stages: see untie_note), vocab 49152.
    "smollm2-135m": {"vocab_size": 49152, "n_layer": 30, "d_model": 576, "n_head": 9, "n_kv_head": 3,
                     "seq_len": 2048, "ffn_hidden": 1536, "rope_theta": 100000.0,
                     "tie_embeddings": True},
    # Llama 3.2 1B's shape (tied embeddings).
    "llama-1b": {"vocab_size": 128256, "n_layer": 16, "d_model": 2048, "n_head": 32, "n_kv_head": 8,
                 "seq_len": 2048, "ffn_hidden": 8192, "rope_theta": 500000.0, "tie_embeddings": True},
    # Llama 3 8B's shape.
    "llama-8b": {"vocab_size": 128256, "n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_head": 8,
                 "seq_len": 2048, "ffn_hidden": 14336, "rope_theta": 500000.0,
                 "tie_embeddings": False},
}

# GPU memory per device of the simulator's table (mesh.compute.DEVICES gives peak FLOP/s and
# memory bandwidth); GB = 1e9 bytes.
DEVICE_MEMORY_GB: dict[str, float] = {"rtx3090": 24.0, "rtx4090": 24.0, "a100": 80.0, "h100": 80.0}


def preset_overrides(name: str) -> list[str]:
    """``--set`` strings of a model preset."""
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODELS[name].items()]
