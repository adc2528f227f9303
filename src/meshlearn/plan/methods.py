"""The method combinations ``meshlearn plan`` compares: each is the given config with a few keys
changed (and validated like a run), so every row is a configuration ``meshlearn train`` accepts.

Pipeline boundary: dense (the config's codec, or fp32 identity if it is subspace), subspace k
(an untied model with k < d), random mask at keep rate q. Schedule: the config's synchronous one
(or 1F1B) and async. DP axis (D > 1): all-reduce, sparse averaging, PowerSGD, DiLoCo.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshlearn.compress.registry import SAME
from meshlearn.config import RunConfig, validate
from meshlearn.plan.mask import mask_wire_values

DP_METHODS = ("allreduce", "sparse", "powersgd", "diloco")


@dataclass(frozen=True)
class Method:
    label: str
    pp: str  # the boundary part of the label (the plot's line)
    cfg: RunConfig
    mask_keep: float | None = None  # the planner's mask stand-in (plan.mask)


def replace(cfg: RunConfig, **sections: dict) -> RunConfig:
    """``cfg`` with keys of whole sections replaced, e.g. ``replace(cfg, mesh={"stages": 4})``."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v)
                                       for k, v in sections.items()})


def subspace_rank(cfg: RunConfig, asked: int) -> int:
    """k of the subspace rows: asked, else the model's, else the official code's d/64 (≥ 8)."""
    return asked or cfg.model.subspace_rank or max(8, cfg.model.d_model // 64)


def boundary_variants(cfg: RunConfig, rank: int,
                      keeps: tuple[float, ...]) -> list[tuple[str, dict, float | None]]:
    """(label, config keys, mask keep) of each pipeline-boundary method."""
    m, mesh = cfg.model, cfg.mesh
    dense = cfg.codec.name if cfg.codec.name != "subspace" else "identity"
    out = [(f"dense {dense}", {"model": {"subspace_rank": 0, "subspace_dense_tail": 0},
                               "codec": {"name": dense}}, None)]
    if not m.tie_embeddings and rank < m.d_model:
        out.append((f"subspace k={rank}", {
            "model": {"subspace_rank": rank, "subspace_dense_tail": min(1, m.n_layer // mesh.stages)},
            "codec": {"name": "subspace"}}, None))
    dense_keys = out[0][1]
    for keep in keeps:
        mask_wire_values(keep, m.d_model)  # validates keep
        out.append((f"mask keep={keep:g}", dense_keys, keep))
    return out


def methods(cfg: RunConfig, rank: int, keeps: tuple[float, ...]) -> tuple[list[Method], list[str]]:
    """Every combination that validates, and one line per combination that does not."""
    out, skipped = [], []
    mesh = cfg.mesh
    sync = mesh.schedule if mesh.schedule != "async" else "1f1b"
    schedules = [(sync, {"schedule": sync, "update_every": 1, "weight_stashing": True,
                         "in_flight": "default"}),
                 ("async", {"schedule": "async",
                            **({} if mesh.schedule == "async" else {"in_flight": "default"})})]
    dps = DP_METHODS if mesh.replicas > 1 else ("allreduce",)
    for pp_label, pp_keys, keep in boundary_variants(cfg, rank, keeps):
        for s_label, s_keys in schedules:
            for dp in dps:
                label = " · ".join([pp_label, s_label] + ([dp] if mesh.replicas > 1 else []))
                variant = replace(cfg, **pp_keys, mesh=s_keys, dp={"name": dp}, subspace_update={"every": 0})
                try:
                    validate(variant)
                except ValueError as err:
                    skipped.append(f"{label}: {err}")
                    continue
                out.append(Method(label, f"{pp_label} · {s_label}", variant, keep))
    return out, skipped


def given_label(cfg: RunConfig) -> str:
    """The given config's row label: its boundary codec (with the gradients' own codec where
    ``codec.backward`` names one), schedule and DP strategy."""
    pp = f"subspace k={cfg.model.subspace_rank}" if cfg.model.subspace_rank else f"dense {cfg.codec.name}"
    backward = cfg.codec.backward
    if backward.name != SAME:
        pp += f" / backward {backward.name}" + (f" keep={backward.keep:g}" if backward.name == "mask" else "")
    return f"as given: {pp} · {cfg.mesh.schedule} · {cfg.dp.name}"


__all__ = ["DP_METHODS", "Method", "given_label", "methods", "replace", "subspace_rank"]
