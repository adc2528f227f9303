"""Hugging Face Llama folders (config.json + *.safetensors [+ tokenizer.json]) in and out.

Reading takes ``LlamaForCausalLM`` checkpoints (any dtype, one file or shards); writing produces a
folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads as the same function. Q and
K rows are permuted between Hugging Face's rotate-half order and meshlearn's adjacent pairs
(``rope.py``). Needs ``safetensors`` (``pip install 'meshlearn[pretrained]'``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from meshlearn.models.formats.rope import halves_to_pairs, pairs_to_halves

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Hugging Face names → meshlearn's (per layer after "model.layers.{i}.").
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "head.weight"}


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("Hugging Face folders need the 'safetensors' package: "
                         "pip install 'meshlearn[pretrained]'") from None
    return safetensors.torch


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file() and any(path.glob("*.safetensors"))


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"rope type {kind!r}: only the plain rotary embedding is supported")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def hf_architecture(folder: Path) -> dict:
    """DecoderConfig fields config.json fixes, plus ``context_len``, tokenizer presence and BOS/EOS."""
    config = json.loads((folder / CONFIG).read_text())
    kind = config.get("model_type")
    if kind != "llama":
        raise ValueError(f"config.json model_type = {kind!r}: only 'llama' folders load into this decoder")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"config.json {flag} = true: this decoder has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act = {config['hidden_act']!r}: only 'silu' (SwiGLU)")
    d_model, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, d_model // n_head):
        raise ValueError(f"config.json head_dim = {config['head_dim']}: must be hidden_size / "
                         f"num_attention_heads = {d_model // n_head}")
    n_kv = int(config.get("num_key_value_heads") or n_head)
    return {
        "vocab_size": int(config["vocab_size"]),
        "n_layer": int(config["num_hidden_layers"]),
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": 0 if n_kv == n_head else n_kv,
        "ffn_hidden": int(config["intermediate_size"]),
        "rope_theta": _rope_theta(config),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "context_len": int(config.get("max_position_embeddings", 2048)),
        "has_tokenizer": (folder / TOKENIZER).is_file(),
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
    }


def hf_state_dict(folder: Path, n_head: int, n_kv_head: int) -> dict[str, torch.Tensor]:
    """Every tensor as float32 under meshlearn's names, Q/K rows in adjacent-pair order."""
    st = _safetensors()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in st.load_file(str(file)).items():
            if name in TOP_NAMES:
                ours = TOP_NAMES[name]
            elif name.startswith("model.layers.") and name.split(".", 3)[3] in LAYER_NAMES:
                _, _, layer, rest = name.split(".", 3)
                ours = f"layers.{int(layer)}.{LAYER_NAMES[rest]}"
            elif name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints saved the frequency table; we compute it
            else:
                raise ValueError(f"{file.name}: tensor {name!r} has no place in this decoder")
            tensor = tensor.float()
            if ours.endswith("attn.q.weight"):
                tensor = halves_to_pairs(tensor, n_head)
            elif ours.endswith("attn.k.weight"):
                tensor = halves_to_pairs(tensor, n_kv_head)
            state[ours] = tensor
    return state


def write_hf(state: dict[str, torch.Tensor], arch: dict, out: Path, dtype: str = "fp32",
             tokenizer: HFTokenizer | None = None) -> Path:
    """Write ``out/`` (config.json, model.safetensors, and tokenizer.json + tokenizer_config.json when
    ``tokenizer`` is given) from a meshlearn state dict of the unsplit model and its architecture
    (the ``hf_architecture`` keys; ``context_len`` becomes max_position_embeddings)."""
    st = _safetensors()
    torch_dtype = DTYPES[dtype]
    n_head, n_kv = arch["n_head"], arch["n_kv_head"] or arch["n_head"]
    inverse_top = {v: k for k, v in TOP_NAMES.items()}
    inverse_layer = {v: k for k, v in LAYER_NAMES.items()}
    tensors = {}
    for name, tensor in state.items():
        if name == "head.weight" and arch["tie_embeddings"]:
            continue  # transformers ties lm_head to embed_tokens itself
        if name in inverse_top:
            theirs = inverse_top[name]
        else:
            _, layer, rest = name.split(".", 2)
            theirs = f"model.layers.{layer}.{inverse_layer[rest]}"
        if name.endswith("attn.q.weight"):
            tensor = pairs_to_halves(tensor, n_head)
        elif name.endswith("attn.k.weight"):
            tensor = pairs_to_halves(tensor, n_kv)
        tensors[theirs] = tensor.detach().to(torch_dtype).contiguous()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": arch["vocab_size"],
        "hidden_size": arch["d_model"],
        "intermediate_size": arch["ffn_hidden"],
        "num_hidden_layers": arch["n_layer"],
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": arch["d_model"] // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": arch["context_len"],
        "rms_norm_eps": arch["norm_eps"],
        "rope_theta": arch["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": arch["rope_theta"]},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": arch["tie_embeddings"],
        "torch_dtype": TORCH_DTYPE_NAMES[torch_dtype],
        "bos_token_id": arch.get("bos_token_id"),
        "eos_token_id": arch.get("eos_token_id"),
    }
    out.mkdir(parents=True, exist_ok=True)
    st.save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(out / TOKENIZER))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": arch["context_len"]},
            indent=2) + "\n")
    return out
