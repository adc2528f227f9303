"""Tiny pretrained checkpoints made on the spot: a random GQA decoder written as a GGUF file (as
llama.cpp lays one out) with a small byte-level BPE tokenizer in its metadata."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshlearn.data import BPETokenizer
from meshlearn.models import Decoder, DecoderConfig, init_model

TEXT = ("the king and the queen speak of love and death, of 12 swords and 345 crowns.\n"
        "what light through yonder window breaks? it is the east, and juliet is the sun.\n") * 40
TINY = dict(vocab_size=0, n_layer=2, d_model=32, n_head=4, n_kv_head=2, ffn_hidden=48, rope_theta=50000.0,
            norm_eps=1e-6, seq_len=32, init_std=0.25)  # large weights: sharp attention, O(1) logits


def tiny_tokenizer() -> BPETokenizer:
    tok = BPETokenizer.train(TEXT, 300)
    tok._tok.add_special_tokens(["<|endoftext|>"])
    return tok


def tiny_model(tokenizer: BPETokenizer, tied: bool, seed: int = 0) -> Decoder:
    cfg = DecoderConfig(**TINY | {"vocab_size": tokenizer.vocab_size, "tie_embeddings": tied})
    model = init_model(cfg, seed)
    with torch.no_grad():  # non-trivial norm gains, so a misplaced norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def write_tiny_gguf(path: Path, model: Decoder, tokenizer: BPETokenizer) -> Path:
    """``model`` as a float32 GGUF, tensors named and laid out as llama.cpp writes them (Q/K rows in
    adjacent-pair order: meshlearn's own, so they are written as they are)."""
    import gguf

    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_width)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    spec = json.loads(tokenizer._tok.to_str())
    vocab = dict(spec["model"]["vocab"]) | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    specials = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    names = {"tok_emb.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "head.weight": "output.weight"}
    layer = {"attn_norm.weight": "attn_norm.weight", "attn.q.weight": "attn_q.weight",
             "attn.k.weight": "attn_k.weight", "attn.v.weight": "attn_v.weight",
             "attn.o.weight": "attn_output.weight", "mlp_norm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "ffn_gate.weight", "mlp.up.weight": "ffn_up.weight",
             "mlp.down.weight": "ffn_down.weight"}
    for name, tensor in model.named_parameters():  # a tied head is not listed: no output.weight
        if name in names:
            theirs = names[name]
        else:
            _, i, rest = name.split(".", 2)
            theirs = f"blk.{i}.{layer[rest]}"
        w.add_tensor(theirs, tensor.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
