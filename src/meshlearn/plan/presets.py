"""What ``meshlearn plan`` knows by name: model shapes (devices: ``mesh.compute.DEVICES``)."""

from __future__ import annotations

# model.* keys per preset (--model NAME); applied after --config and before --set.
MODELS: dict[str, dict[str, object]] = {
    "demo": {"vocab_size": 256, "n_layer": 4, "d_model": 128, "n_head": 4, "n_kv_head": 0,
             "seq_len": 128, "ffn_hidden": 0},
    # SmolLM2-135M: GQA 9/3, tied embeddings, vocab 49152.
    "smollm2-135m": {"vocab_size": 49152, "n_layer": 30, "d_model": 576, "n_head": 9, "n_kv_head": 3,
                     "seq_len": 2048, "ffn_hidden": 1536, "rope_theta": 100000.0,
                     "tie_embeddings": True},
    # Llama 3.2 1B's shape (GQA 32/8, tied embeddings).
    "llama-1b": {"vocab_size": 128256, "n_layer": 16, "d_model": 2048, "n_head": 32, "n_kv_head": 8,
                 "seq_len": 2048, "ffn_hidden": 8192, "rope_theta": 500000.0, "tie_embeddings": True},
    # Llama 3 8B's shape (GQA 32/8).
    "llama-8b": {"vocab_size": 128256, "n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_head": 8,
                 "seq_len": 2048, "ffn_hidden": 14336, "rope_theta": 500000.0,
                 "tie_embeddings": False},
}


def preset_overrides(name: str, tied: bool = True) -> list[str]:
    """``--set`` strings of a model preset. ``tied = False`` unties a tied preset: the loader
    refuses tying across stages, where the last stage holds its own copy of the embedding."""
    keys = dict(MODELS[name])
    if not tied and keys.get("tie_embeddings"):
        keys["tie_embeddings"] = False
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
