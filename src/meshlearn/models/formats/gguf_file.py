"""GGUF (llama.cpp's single-file format) → meshlearn: architecture, dequantized weights, tokenizer.

Needs the ``gguf`` package (``pip install 'meshlearn[pretrained]'``), which parses the file and
dequantizes its blocks (Q4_1, Q8_0, ...) to float32 on the CPU. Only the ``llama`` architecture is
read; files that need more than this decoder has (rope scaling, biases, a different tokenizer
family) are refused with the reason.

Q and K: GGUF stores their rows in adjacent-pair rotary order, which is meshlearn's own (see
``rope.py``), so they load as they are. ``tests/models/test_pretrained_oracle.py`` checks this
against transformers, which un-permutes them for its rotate-half Llama.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF tensor names → meshlearn's (per-layer names after "blk.{i}.").
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_output.weight": "attn.o.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
}
TOP_NAMES = {"token_embd.weight": "tok_emb.weight", "output_norm.weight": "norm.weight",
             "output.weight": "head.weight"}

# How the text is cut before BPE merges, by ``tokenizer.ggml.pre`` (llama.cpp's names). "smollm" is
# GPT-2's split with every digit on its own (llama.cpp: "\p{N}" first, then GPT-2's regex; the
# SmolLM2 tokenizer.json: Digits(individual_digits) then ByteLevel).
DIGITS = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence([DIGITS, pre_tokenizers.ByteLevel(add_prefix_space=False)]),
}
CONTROL = 3  # llama.cpp's token type of special tokens (<|endoftext|>, <|im_start|>, ...)


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a .gguf file needs the 'gguf' package: "
                         "pip install 'meshlearn[pretrained]'") from None
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as err:  # a damaged or foreign file
        raise ValueError(f"not a readable GGUF file ({err})") from None


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int):
    return _reader(Path(path))


def open_gguf(path: Path):
    """The parsed file (about 2 s for SmolLM2's 49k-token vocabulary; cached per process)."""
    path = Path(path).resolve()
    return _cached_reader(str(path), path.stat().st_mtime_ns)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(path: Path) -> dict:
    """DecoderConfig fields the file fixes, plus ``context_len`` (its trained context), whether it
    carries a tokenizer, and its BOS/EOS token ids."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture = {arch!r}: only 'llama' GGUF files load into this decoder")
    names = {t.name for t in reader.tensors}
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if "rope_freqs.weight" in names or scaling not in ("none", None):
        raise ValueError("the file uses rope scaling (Llama 3.1 style), which this decoder does not have")
    n_head = int(_field(reader, "llama.attention.head_count"))
    d_model = int(_field(reader, "llama.embedding_length"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    rope_dims = int(_field(reader, "llama.rope.dimension_count", d_model // n_head))
    if rope_dims != d_model // n_head:
        raise ValueError(f"llama.rope.dimension_count = {rope_dims}: partial rotary embeddings are not "
                         f"supported (head width {d_model // n_head})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_field(reader, "llama.vocab_size", embed.shape[-1]))
    return {
        "vocab_size": vocab,
        "n_layer": int(_field(reader, "llama.block_count")),
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": 0 if n_kv == n_head else n_kv,
        "ffn_hidden": int(_field(reader, "llama.feed_forward_length")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "tie_embeddings": "output.weight" not in names,
        "context_len": int(_field(reader, "llama.context_length", 2048)),
        "has_tokenizer": tokens is not None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, under meshlearn's names (``head.weight`` absent when the
    file ties it to the embedding)."""
    import gguf

    state = {}
    for tensor in open_gguf(path).tensors:
        name = tensor.name
        if name in TOP_NAMES:
            ours = TOP_NAMES[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in LAYER_NAMES:
            _, layer, rest = name.split(".", 2)
            ours = f"layers.{int(layer)}.{LAYER_NAMES[rest]}"
        else:
            raise ValueError(f"tensor {name!r} has no place in this decoder")
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        # np.array copies: the file is mapped read-only
        state[ours] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    return state


def gguf_tokenizer(path: Path) -> HFTokenizer:
    """The byte-level BPE tokenizer the file describes: its vocabulary, merges and special tokens,
    with the pre-tokenizer its ``tokenizer.ggml.pre`` names."""
    reader = open_gguf(path)
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model = {kind!r}: only byte-level BPE ('gpt2') tokenizers load")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre = {pre!r}: allowed {sorted(PRE_TOKENIZERS)}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    # Special tokens stay whole in any text (they keep their ids: they are in the vocabulary).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
    return tok
