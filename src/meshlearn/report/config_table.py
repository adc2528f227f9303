"""The configuration of every compared run, one column per run and one row per aspect, from the
resolved config.toml each run folder holds. Rows where the runs differ are marked, so a comparison
says at a glance what was varied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshlearn.report.records import RunData
from meshlearn.report.table import MISSING, Table

Section = dict[str, Any]


def _get(config: dict[str, Any], section: str) -> Section:
    value = config.get(section)
    return value if isinstance(value, dict) else {}


def _mesh(c: dict) -> str:
    m = _get(c, "mesh")
    return f"{m.get('stages', '?')} × {m.get('replicas', '?')}"


def _schedule(c: dict) -> str:
    m = _get(c, "mesh")
    text = f"{m.get('schedule', '?')}, M = {m.get('microbatches', '?')}"
    if m.get("schedule") == "async":
        text += (f", in flight {m.get('in_flight', '?')}, update every {m.get('update_every', '?')}, "
                 f"{'weight stashing' if m.get('weight_stashing', True) else 'no stashing'}")
    return text


def _model(c: dict) -> str:
    m = _get(c, "model")
    text = (f"{m.get('n_layer', '?')} layers, d {m.get('d_model', '?')}, {m.get('n_head', '?')} heads, "
            f"seq {m.get('seq_len', '?')}, vocab {m.get('vocab_size', '?')}")
    if m.get("subspace_rank"):
        text += f", subspace rank {m['subspace_rank']}"
    if m.get("init"):
        text += f", init {m['init']}"
    return text


_CODEC_OPTIONS = {"topk": ("topk", "k"), "lowrank": ("lowrank", "rank")}


def _codec(c: dict) -> str:
    codec = _get(c, "codec")
    name = codec.get("name", "?")
    text = str(name)
    if name in _CODEC_OPTIONS:
        key, label = _CODEC_OPTIONS[name]
        text += f" ({label} {codec.get(key, '?')}, {codec.get('wire_dtype', '?')} wire)"
    elif name == "subspace":
        text += f" ({codec.get('wire_dtype', '?')} wire)"
    return text


_DP_OPTIONS = {
    "sparse": ("fraction", "delay", "rule"),
    "powersgd": ("rank",),
    "diloco": ("inner_steps", "outer_lr", "outer_momentum", "fragments"),
}


def _dp(c: dict) -> str:
    dp = _get(c, "dp")
    name = dp.get("name", "allreduce")
    options = ", ".join(f"{k} {dp[k]}" for k in _DP_OPTIONS.get(name, ()) if k in dp)
    return f"{name} ({options})" if options else str(name)


def _profile(bandwidth: Any, latency: Any) -> str:
    return f"{bandwidth:g} Mbit/s, {latency:g} ms" if isinstance(bandwidth, int | float) and isinstance(
        latency, int | float) else MISSING


def _links(c: dict) -> str:
    link, links = _get(c, "link"), _get(c, "links")
    bandwidth, latency = link.get("bandwidth_mbit"), link.get("latency_ms")
    text = _profile(bandwidth, latency)
    for axis in ("pp", "dp"):
        b, lat = links.get(f"{axis}_bandwidth_mbit", 0), links.get(f"{axis}_latency_ms", -1)
        if (b or 0) > 0 or (lat is not None and lat >= 0):
            text += f"; {axis}: " + _profile(b if b else bandwidth, lat if lat is not None and lat >= 0
                                              else latency)
    for key, unit in (("jitter_ms", "ms jitter"), ("loss_rate", "loss")):
        if link.get(key):
            text += f", {link[key]:g} {unit}"
    if links.get("overrides"):
        text += f"; overrides: {links['overrides']}"
    return text


def _optimizer(c: dict) -> str:
    o, t = _get(c, "optim"), _get(c, "train")
    return (f"{o.get('name', '?')}, lr {t.get('lr', '?')}, weight decay {o.get('weight_decay', '?')}, "
            f"warm-up {t.get('warmup_steps', '?')}, clip {t.get('grad_clip', '?')}")


def _batch(c: dict) -> str:
    t, m = _get(c, "train"), _get(c, "model")
    return (f"{t.get('steps', '?')} steps × {t.get('batch_size', '?')} sequences × "
            f"{m.get('seq_len', '?')} tokens")


def _trust(c: dict) -> str:
    v, a = _get(c, "verify"), _get(c, "attack")
    verifier = v.get("name", "none")
    text = str(verifier) + (f" (warm-up {v.get('warmup_steps')})" if verifier != "none" else "")
    if a.get("kind", "none") != "none":
        text += f"; attack {a['kind']} by {a.get('workers', '?')} from step {a.get('start_step', 0) + 1}"
    return text


def _compute(c: dict) -> str:
    if c.get("backend") == "dist":
        return "real processes (--backend dist)"
    sim = _get(c, "sim")
    if sim.get("compute") == "measured":
        return "measured on this machine"
    return f"{sim.get('device', '?')} model at {sim.get('utilization', '?')} utilization"


ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("P × D (stages × replicas)", _mesh),
    ("schedule", _schedule),
    ("model", _model),
    ("codec (pp boundary)", _codec),
    ("DP strategy", _dp),
    ("links", _links),
    ("optimizer", _optimizer),
    ("data", _batch),
    ("verifier / attack", _trust),
    ("compute model", _compute),
]


def config_table(runs: Sequence[RunData]) -> tuple[Table, list[bool]]:
    """The table (rows = aspects, columns = runs) and, per row, whether the runs differ in it."""
    rows, differs = [], []
    for name, describe in ROWS:
        cells = [describe(r.config) if r.config else MISSING for r in runs]
        rows.append([name, *cells])
        differs.append(len(set(cells)) > 1)
    table = Table(headers=["", *(r.label for r in runs)], rows=rows, numeric=[False] * (len(runs) + 1))
    return table, differs
