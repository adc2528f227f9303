"""Inference under morphs: a protocol model served as a pipeline of stages that morph every N
generated tokens, while the text it writes stays the text of the plain model.

The stages are cut from a plain decoder (a pretrained one: ``models/pretrained.py``), converted
to the protocol model (``protocol/model.py``) and chained in this process; each keeps its own KV
cache. Morphs happen between two tokens, when nothing is in flight (the generation's drain point):
every boundary folds a fresh transform on its fp64 masters (``protocol/morph.py``), stage s sending
the boundary transform to stage s + 1. The KV caches need nothing: keys and values are computed
after each layer's fixed rotation Q₁ (q, k, v never change basis), so they are the same numbers in
every epoch. The first morph happens before the first token: at epoch 0 every residual basis is
the identity, i.e. the plain checkpoint's, which must never be served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder, KVCache, generate_tokens
from meshlearn.models.split import split_model
from meshlearn.protocol.model import protocol_model
from meshlearn.protocol.morph import StageMorph, morph_mesh

INFERENCE_MORPHS = ("none", "orthogonal", "lowcond")


@dataclass
class MorphCounters:
    morphs: int = 0
    transforms: int = 0
    boundary_bytes: int = 0  # the transforms sent across pipeline boundaries (fp64)
    wall_s: float = 0.0


def untied(model: Decoder) -> Decoder:
    """``model`` with its head as its own copy of a tied embedding (the protocol model folds the
    head, not the embedding); the same function."""
    if not model.cfg.tie_embeddings:
        return model
    state = dict(model.state_dict())
    state["head.weight"] = state["tok_emb.weight"].clone()
    with torch.random.fork_rng(devices=[]):
        out = Decoder(replace(model.cfg, tie_embeddings=False))
    out.load_state_dict(state, strict=True)
    return out.eval()


class MorphingPipeline:
    """``plain`` (an unsplit, untied Decoder) served as ``stages`` protocol-model stages that
    morph every ``every_tokens`` tokens (``kind``: ``none`` never morphs). Usage::

        pipe = MorphingPipeline(model, stages=4, kind="orthogonal", every_tokens=16)
        ids = pipe.generate(prompt_ids, 60, greedy=True)
    """

    def __init__(self, plain: Decoder, stages: int, kind: str, every_tokens: int, epsilon: float = 0.01,
                 seed: int = 0, master_dtype: torch.dtype = torch.float64):
        if kind not in INFERENCE_MORPHS:
            raise ValueError(f"morph = {kind!r}; allowed: {list(INFERENCE_MORPHS)}")
        if every_tokens < 1:
            raise ValueError(f"morph every {every_tokens} tokens; must be >= 1")
        self.cfg = plain.cfg
        self.kind, self.every_tokens, self.epsilon, self.seed = kind, every_tokens, epsilon, seed
        self.stages = [protocol_model(part, seed).eval() for part in split_model(untied(plain), stages)]
        self.mesh = MeshShape(1, stages)
        self.morphs = {WorkerId(0, s): StageMorph(m, None, master_dtype) for s, m in enumerate(self.stages)}
        self.counters = MorphCounters()
        self.caches = [KVCache() for _ in self.stages]
        if kind != "none":
            self.morph()  # never serve the epoch-0 bases (the plain checkpoint's)

    def morph(self) -> None:
        """One morph epoch over every boundary (between tokens: nothing in flight)."""
        started = time.perf_counter()
        stats = morph_mesh(self.morphs, self.mesh, self.kind, self.epsilon, self.seed, self.counters.morphs)
        counters = self.counters
        counters.wall_s += time.perf_counter() - started
        counters.morphs += 1
        counters.transforms += stats.transforms
        counters.boundary_bytes += stats.boundary_bytes

    def forward(self, ids: Tensor, restart: bool) -> Tensor:
        """Token ids (B, T) through every stage, continuing the KV caches (fresh ones when
        ``restart``) → logits (B, T, V)."""
        if restart:
            self.caches = [KVCache() for _ in self.stages]
        x = ids
        for stage, cache in zip(self.stages, self.caches, strict=True):
            x = stage(x, cache)
        return x

    def _after_token(self, n: int, logits: Tensor) -> None:
        if self.kind != "none" and n % self.every_tokens == 0:
            self.morph()

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, greedy: bool = False,
                 on_logits=None) -> Tensor:
        """``Decoder.generate``'s loop on the pipeline, morphing every ``every_tokens`` tokens;
        ``on_logits(n, logits)`` sees the logits the n-th token was drawn from (the tests)."""
        def after(n: int, logits: Tensor) -> None:
            if on_logits is not None:
                on_logits(n, logits)
            self._after_token(n, logits)

        return generate_tokens(self.forward, self.cfg.seq_len, idx, max_new_tokens, temperature, top_k,
                               generator, greedy, after)

    def master_bytes(self) -> int:
        """The fp64 master copies of all stages (the memory morphs add, beside the basis matrices)."""
        masters = [t for m in self.morphs.values() for t in m.master.tensors.values()]
        return sum(t.numel() * t.element_size() for t in masters)
