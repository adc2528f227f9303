"""The protocol model: the Llama decoder rewritten so that every map of the residual stream can be
morphed (method note "Unextractable Protocol Models", section "Transformer layer").

Write a layer's residual stream in a basis: the stored residual is X' = X·A, with X the plain
model's. Each layer holds, as non-trainable d×d buffers (row-vector convention, ``x @ M``):

- R₁ = A⁻¹Q₁ and R₂ = C⁻¹Q₂, read before each parameter-free RMSNorm n₀ (``BasisNorm``);
- S₁ = A⁻¹C and S₂ = C⁻¹B, the skip matrices,

where A, C, B are the layer's input, middle and output bases and Q₁, Q₂ random orthogonal matrices
drawn once. Since n₀(XQ) = n₀(X)Q for orthogonal Q, folding the RMSNorm gains into the next
matrices (torch's ``Linear`` weight is (out, in), the note's W transposed) gives::

    H' = X'S₁ + Attn'(n₀(X'R₁)),   q, k, v: W·diag(g₁)·Q₁,   o: Cᵀ·W_o
    Y' = H'S₂ + MLP'(n₀(H'R₂)),    gate, up: W·diag(g₂)·Q₂,  down: Bᵀ·W_down

The token embedding keeps its own (fixed) basis behind a non-trainable exit matrix
(``emb_basis``: x₀' = E[ids]·B_emb), and the head sits behind the final norm's R in a fixed basis
(head: W·diag(g_f)·Q_f), so both may keep AdamW. At construction every basis is the identity, so
the model computes what the plain decoder computes; morphs (``protocol/morph.py``) then change
the bases, never the function.

Names match the plain decoder's (``tok_emb``, ``layers.{i}.attn.q``, ``norm``, ``head``), so a
stage is again the full model with parts removed, Muon routes it by the same names, and the
compute model counts it the same way (the d×d basis products are not counted: about 4d² FLOPs per
token per layer, small next to the ~(4d² + 3d·ffn) of the projections).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from meshlearn.models.llama import Attention, Decoder, DecoderConfig, KVCache, SwiGLU, rope_tables
from meshlearn.protocol.transforms import haar_orthogonal, seeded_generator


class BasisNorm(nn.Module):
    """n₀(x·R): the residual read through the basis matrix R (a d×d buffer ``basis``), then a
    parameter-free RMSNorm (its gain lives in the next matrices)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("basis", torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.basis  # (B, T, d)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class ProtocolBlock(nn.Module):
    """A pre-norm block with basis matrices: R₁ (``attn_norm.basis``), S₁ (``attn_skip``), R₂
    (``mlp_norm.basis``), S₂ (``mlp_skip``); attention and SwiGLU are the plain decoder's."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d = cfg.d_model
        self.attn_norm = BasisNorm(d, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.register_buffer("attn_skip", torch.eye(d))
        self.mlp_norm = BasisNorm(d, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.register_buffer("mlp_skip", torch.eye(d))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, key: str = "") -> torch.Tensor:
        h = x @ self.attn_skip + self.attn(self.attn_norm(x), cos, sin, cache, key)  # (B, T, d) in basis C
        return h @ self.mlp_skip + self.mlp(self.mlp_norm(h))  # in basis B


class ProtocolDecoder(nn.Module):
    """The protocol model, or one pipeline stage of it (the same arguments as ``Decoder``).

    Built empty (identity bases); :func:`protocol_model` fills it from a plain decoder.
    """

    loss = staticmethod(Decoder.loss)

    def __init__(self, cfg: DecoderConfig, layer_ids: range | None = None, embed: bool = True,
                 head: bool = True):
        super().__init__()
        if cfg.subspace_rank > 0 or cfg.tie_embeddings:
            raise ValueError("the protocol model is dense and untied (model.subspace_rank = 0, "
                             "model.tie_embeddings = false)")
        self.cfg = cfg
        d = cfg.d_model
        layer_ids = range(cfg.n_layer) if layer_ids is None else layer_ids
        self.tok_emb = nn.Embedding(cfg.vocab_size, d) if embed else None
        if embed:
            self.register_buffer("emb_basis", torch.eye(d))  # B_emb: the embedding's exit matrix
        self.layers = nn.ModuleDict({str(i): ProtocolBlock(cfg) for i in layer_ids})
        self.norm = BasisNorm(d, cfg.norm_eps) if head else None
        self.head = nn.Linear(d, cfg.vocab_size, bias=False) if head else None
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (B, T) → residual (B, T, d) → ... → logits (B, T, V), depending on the parts held.
        With ``cache`` (generation) the tokens continue the cached ones. The cache holds keys and
        values, which live in the fixed basis behind Q₁ (q, k, v never change), so a morph between
        two tokens leaves it valid."""
        tokens = x.shape[1]
        if self.tok_emb is not None:
            x = self.tok_emb(x) @ self.emb_basis  # (B, T, d)
        for name, block in self.layers.items():
            x = block(x, self.rope_cos, self.rope_sin, cache, name)
        if cache is not None:
            cache.length += tokens
        if self.head is not None:
            x = self.head(self.norm(x))  # (B, T, V)
            if self.cfg.logit_softcap > 0:
                x = self.cfg.logit_softcap * torch.tanh(x / self.cfg.logit_softcap)
        return x


@torch.no_grad()
def protocol_model(plain: Decoder, seed: int) -> ProtocolDecoder:
    """The protocol form of ``plain`` (the whole model or a stage): gains folded into the matrices
    that read each norm, behind random orthogonal Q's drawn from ``seed`` and the layer index (so
    every replica of a stage, and a stage cut from the full model, get the same ones); every
    residual basis is the identity. Computes what ``plain`` computes (up to fp32 rounding)."""
    cfg = plain.cfg
    ids = [int(key) for key in plain.layers]
    out = ProtocolDecoder(cfg, range(ids[0], ids[-1] + 1) if ids else range(0),
                          embed=plain.tok_emb is not None, head=plain.head is not None)
    d = cfg.d_model
    if plain.tok_emb is not None:
        out.tok_emb.weight.copy_(plain.tok_emb.weight)
    for key, block in plain.layers.items():
        new = out.layers[key]
        for norm, linears, slot in ((block.attn_norm, ("q", "k", "v"), "attn"),
                                    (block.mlp_norm, ("gate", "up"), "mlp")):
            q = haar_orthogonal(d, seeded_generator(seed, "protocol-norm", int(key), slot)).matrix
            fold = norm.weight.double()[:, None] * q  # diag(g)·Q (d, d)
            getattr(new, f"{slot}_norm").basis.copy_(q.float())  # R = A⁻¹Q with A = I
            for name in linears:
                src, dst = getattr(getattr(block, slot), name), getattr(getattr(new, slot), name)
                dst.weight.copy_(src.weight.double() @ fold)
        new.attn.o.weight.copy_(block.attn.o.weight)
        new.mlp.down.weight.copy_(block.mlp.down.weight)
        if hasattr(block.attn, "q_norm"):  # QK-norm acts per head, after the projection: unchanged
            new.attn.q_norm.weight.copy_(block.attn.q_norm.weight)
            new.attn.k_norm.weight.copy_(block.attn.k_norm.weight)
    if plain.head is not None:
        q = haar_orthogonal(d, seeded_generator(seed, "protocol-norm", cfg.n_layer, "head")).matrix
        out.norm.basis.copy_(q.float())
        fold = plain.norm.weight.double()[:, None] * q
        out.head.weight.copy_(plain.head.weight.double() @ fold)
    return out


def stage_modules(cfg, stages: list[Decoder]) -> list[Decoder | ProtocolDecoder]:
    """The stage modules a run trains: the protocol model's unless ``protocol.morph = off``
    (``cfg``: the resolved RunConfig; every replica of a stage gets the same Q's)."""
    if cfg.protocol.morph == "off":
        return stages
    return [protocol_model(stage, cfg.seed) for stage in stages]
