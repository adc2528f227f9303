"""``meshlearn plan``: predicted throughput, bytes and memory per method, from the simulator.

Every number except memory comes from ``plan.cost.simulate``: the SimDriver's own event loop over
cost-only workers (the codec's exact wire sizes, the device model's durations, the run's links and
DP strategies). A method combination is the config with a few keys changed; the table is one
simulation per combination, the plot one per combination and link bandwidth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from meshlearn.config import RunConfig, validate
from meshlearn.mesh.compute import DEVICES
from meshlearn.plan.cost import CostResult, simulate
from meshlearn.plan.presets import DEVICE_MEMORY_GB

DP_METHODS = ("allreduce", "sparse", "powersgd", "diloco")
SWEEP_MBIT = (25.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
NOT_MODELLED = ("mask keep: no mask codec exists yet (adaptation issue); no row",)


@dataclass
class Method:
    label: str
    cfg: RunConfig


def subspace_rank(cfg: RunConfig, asked: int) -> int:
    if asked:
        return asked
    if cfg.model.subspace_rank:
        return cfg.model.subspace_rank
    return max(8, cfg.model.d_model // 64)


def _replace(cfg: RunConfig, **sections) -> RunConfig:
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v)
                                       for k, v in sections.items()})


def methods(cfg: RunConfig, rank: int) -> tuple[list[Method], list[str]]:
    """Dense / subspace k × sync / async × the DP strategies (D > 1), each validated like a run."""
    out, skipped = [], []
    m, mesh = cfg.model, cfg.mesh
    dense_codec = cfg.codec.name if cfg.codec.name != "subspace" else "identity"
    last_layers = m.n_layer // mesh.stages
    pp = [("dense " + dense_codec, {"model": {"subspace_rank": 0, "subspace_dense_tail": 0},
                                     "codec": {"name": dense_codec}})]
    if not m.tie_embeddings and rank < m.d_model:
        pp.append((f"subspace k={rank}", {
            "model": {"subspace_rank": rank, "subspace_dense_tail": min(1, last_layers)},
            "codec": {"name": "subspace", "wire_dtype": cfg.codec.wire_dtype}}))
    sync = mesh.schedule if mesh.schedule != "async" else "1f1b"
    schedules = [(sync, {"schedule": sync, "update_every": 1, "weight_stashing": True,
                         "in_flight": "default"}),
                 ("async", {"schedule": "async",
                            **({} if mesh.schedule == "async" else {"in_flight": "default"})})]
    dps = DP_METHODS if mesh.replicas > 1 else ("allreduce",)
    for pp_label, pp_keys in pp:
        for s_label, s_keys in schedules:
            for dp in dps:
                label = f"{pp_label} · {s_label} · {dp}" if mesh.replicas > 1 else f"{pp_label} · {s_label}"
                variant = _replace(cfg, **pp_keys, mesh=s_keys, dp={"name": dp},
                                   subspace_update={"every": 0})
                try:
                    validate(variant)
                except ValueError as err:
                    skipped.append(f"{label}: {err}")
                    continue
                out.append(Method(label, variant))
    return out, skipped


def with_bandwidth(cfg: RunConfig, mbit: float) -> RunConfig:
    """Every link at ``mbit`` (per-axis bandwidths and per-link overrides dropped)."""
    return _replace(cfg, link={"bandwidth_mbit": mbit},
                    links={"dp_bandwidth_mbit": 0.0, "pp_bandwidth_mbit": 0.0, "overrides": ""})


def row(label: str, cfg: RunConfig, result: CostResult) -> dict:
    memory = result.memory
    capacity = DEVICE_MEMORY_GB[cfg.sim.device] * 1e9
    return {
        "method": label, "tokens_per_s": result.tokens_per_s,
        "bytes_per_token_pp": result.bytes_per_token_pp, "bytes_per_token_dp": result.bytes_per_token_dp,
        "memory_gb": {"weights": memory.weights / 1e9, "grads": memory.grads / 1e9,
                      "optimizer": memory.optimizer / 1e9, "activations": memory.activations / 1e9,
                      "stashes": memory.stash / 1e9, "total": memory.total / 1e9,
                      "worker": result.memory_worker},
        "fits": memory.total <= capacity,
        "bubble_fraction": result.bubble_fraction, "binds": result.binds,
        "busy_share": {"compute": result.compute_share, "pp_link": result.pp_link_share,
                       "dp_link": result.dp_link_share},
        "steps_simulated": result.steps, "virtual_s": result.sim_s,
    }


def describe(cfg: RunConfig) -> dict:
    m, mesh, sim = cfg.model, cfg.mesh, cfg.sim
    peak, bandwidth = DEVICES[sim.device]
    return {
        "model": {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head, "n_kv_head": m.kv_heads,
                  "ffn": m.ffn_width, "vocab_size": m.vocab_size, "seq_len": m.seq_len,
                  "subspace_rank": m.subspace_rank},
        "mesh": {"stages": mesh.stages, "replicas": mesh.replicas,
                 "participants": mesh.stages * mesh.replicas,
                 "schedule": mesh.schedule, "microbatches": mesh.microbatches,
                 "batch_tokens": cfg.train.batch_size * m.seq_len},
        "device": {"name": sim.device, "peak_tflops": sim.peak_tflops or peak, "utilization": sim.utilization,
                   "memory_gb": DEVICE_MEMORY_GB[sim.device], "memory_bandwidth_gbs": bandwidth},
        "link": {"bandwidth_mbit": cfg.link.bandwidth_mbit, "latency_ms": cfg.link.latency_ms,
                 "pp_bandwidth_mbit": cfg.links.pp_bandwidth_mbit or cfg.link.bandwidth_mbit,
                 "dp_bandwidth_mbit": cfg.links.dp_bandwidth_mbit or cfg.link.bandwidth_mbit},
        "codec": cfg.codec.name, "dp": cfg.dp.name, "optim": cfg.optim.name,
    }


def given_label(cfg: RunConfig) -> str:
    pp = f"subspace k={cfg.model.subspace_rank}" if cfg.model.subspace_rank else f"dense {cfg.codec.name}"
    return f"as given: {pp} · {cfg.mesh.schedule} · {cfg.dp.name}"


def plan(cfg: RunConfig, steps: int, sweep_steps: int, rank: int = 0,
         sweep: tuple[float, ...] = SWEEP_MBIT) -> dict:
    """The planner's whole answer as a JSON-able object (``tokens_per_s``: the config as given)."""
    horizon = min(cfg.train.steps, steps)
    given = simulate(cfg, horizon)
    notes = list(NOT_MODELLED)
    for key, on in [("verify.name", cfg.verify.name != "none"), ("warmup.enabled", cfg.warmup.enabled),
                    ("attack.kind", cfg.attack.kind != "none")]:
        if on:
            notes.append(f"{key}: not modelled by the planner (its time is not in these numbers)")
    if horizon < cfg.train.steps:
        notes.append(f"simulated the first {horizon} of train.steps = {cfg.train.steps} steps "
                     f"(drain points as configured; --steps to change)")
    variants, skipped = methods(cfg, subspace_rank(cfg, rank))
    notes += [f"skipped {s}" for s in skipped]
    rows = [row(v.label, v.cfg, simulate(v.cfg, horizon)) for v in variants]
    curves = {}
    for v in variants:
        curves[v.label] = [simulate(with_bandwidth(v.cfg, mbit), sweep_steps).tokens_per_s for mbit in sweep]
    return {"tokens_per_s": given.tokens_per_s, "given": row(given_label(cfg), cfg, given),
            "config": describe(cfg), "methods": rows,
            "sweep": {"bandwidth_mbit": list(sweep), "steps_simulated": sweep_steps,
                      "tokens_per_s": curves},
            "notes": notes}


def _bytes(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def _memory(m: dict) -> str:
    parts = [m[k] for k in ("weights", "grads", "optimizer", "activations", "stashes")]
    if m["total"] >= 1:
        return f"{m['total']:.1f} GB (" + "+".join(f"{x:.1f}" for x in parts) + ")"
    return f"{m['total'] * 1e3:.1f} MB (" + "+".join(f"{x * 1e3:.1f}" for x in parts) + ")"


def format_table(result: dict) -> str:
    c = result["config"]
    dev, mesh, link = c["device"], c["mesh"], c["link"]
    head = (f"model: {c['model']['n_layer']} layers, d {c['model']['d_model']}, heads "
            f"{c['model']['n_head']}/{c['model']['n_kv_head']}, vocab {c['model']['vocab_size']}, "
            f"seq {c['model']['seq_len']}\n"
            f"mesh: {mesh['stages']} stages × {mesh['replicas']} replicas = {mesh['participants']} "
            f"participants, {mesh['microbatches']} microbatches, {mesh['batch_tokens']} tokens/step\n"
            f"device: {dev['name']} ({dev['peak_tflops']:.0f} TFLOP/s peak at utilization "
            f"{dev['utilization']}, {dev['memory_gb']:.0f} GB, {dev['memory_bandwidth_gbs']:.0f} GB/s)\n"
            f"links: PP {link['pp_bandwidth_mbit']:g} Mbit/s, DP {link['dp_bandwidth_mbit']:g} Mbit/s, "
            f"{link['latency_ms']:g} ms\n")
    cols = ["method", "tokens/s", "B/tok PP", "B/tok DP", "memory/worker (w+g+opt+act+stash)", "fits",
            "bubble", "binds (busy: comp/PP/DP)"]
    lines = []
    for r in [result["given"], *result["methods"]]:
        m, b = r["memory_gb"], r["busy_share"]
        lines.append([
            r["method"], f"{r['tokens_per_s']:,.0f}", _bytes(r["bytes_per_token_pp"]),
            _bytes(r["bytes_per_token_dp"]),
            _memory(m),
            "yes" if r["fits"] else "NO", f"{r['bubble_fraction']:.3f}",
            f"{r['binds']} ({b['compute']:.2f}/{min(b['pp_link'], 1):.2f}/{min(b['dp_link'], 1):.2f})"])
    widths = [max(len(x[i]) for x in [cols, *lines]) for i in range(len(cols))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    body = "\n".join(fmt.format(*x) for x in [cols, *lines])
    notes = "\n".join(f"note: {n}" for n in result["notes"])
    return head + "\n" + body + ("\n\n" + notes if notes else "")


def write_plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, values in sweep["tokens_per_s"].items():
        ax.plot(sweep["bandwidth_mbit"], values, marker="o", label=label,
                linestyle="-" if "subspace" in label else "--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s, every link)")
    ax.set_ylabel("predicted tokens/s (virtual clock)")
    c = result["config"]
    ax.set_title(f"{c['mesh']['stages']}×{c['mesh']['replicas']} mesh, d={c['model']['d_model']}, "
                 f"{c['model']['n_layer']} layers, {c['device']['name']} @ {c['device']['utilization']}, "
                 f"{c['link']['latency_ms']:g} ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["format_table", "methods", "plan", "write_plot"]
