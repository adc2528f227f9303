"""Checks of the model.* keys that pretrained checkpoints brought (GQA, tied embeddings, RoPE θ,
norm ε, init) and of the stability options (soft-caps), one line each; config.py calls
``validate_model`` with its ``require``."""

from __future__ import annotations


def validate_model(cfg, require) -> None:
    """``cfg`` is a resolved RunConfig (model.init already filled in the architecture)."""
    m = cfg.model
    kv_ok = [k for k in range(1, m.n_head + 1) if m.n_head % k == 0]
    require(m.n_kv_head == 0 or m.n_kv_head in kv_ok, "model.n_kv_head", m.n_kv_head,
            f"0 (= model.n_head) or a divisor of model.n_head = {m.n_head}: {kv_ok}")
    require(m.rope_theta > 1, "model.rope_theta", m.rope_theta, "must be > 1 (the RoPE frequency base)")
    require(0 < m.norm_eps < 1, "model.norm_eps", m.norm_eps, "must be in (0, 1) (RMSNorm's epsilon)")
    for key in ("attn_softcap", "logit_softcap"):  # a negative cap would silently mean "off"
        require(getattr(m, key) >= 0, f"model.{key}", getattr(m, key), "must be >= 0 (0 = off)")
    if m.tie_embeddings:
        require(m.subspace_rank == 0, "model.tie_embeddings", m.tie_embeddings,
                "a subspace-constrained embedding has no dense weight to share; set model.subspace_rank = 0")
