"""The planner's answer for people: a terminal table and a plot of tokens/s against bandwidth."""

from __future__ import annotations

from pathlib import Path


def _bytes(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def _memory(m: dict) -> str:
    parts = [m[k] for k in ("weights", "grads", "optimizer", "activations", "stashes")]
    if m["total"] >= 1:
        return f"{m['total']:.1f} GB (" + "+".join(f"{x:.1f}" for x in parts) + ")"
    return f"{m['total'] * 1e3:.0f} MB (" + "+".join(f"{x * 1e3:.0f}" for x in parts) + ")"


SHORT = {"compute": "comp", "PP link": "PP", "DP link": "DP", "latency": "lat", "update": "upd",
         "other": "other"}


def _binds(r: dict) -> str:
    """The binding resource with the numbers it was read from: each resource's share of the
    critical path (the parts under 0.005 left out), or tokens/s × when each doubles."""
    if r["gain_if_doubled"]:
        parts = [f"{SHORT[k]} {v:.2f}" for k, v in r["gain_if_doubled"].items()]
    else:
        parts = [f"{SHORT[k]} {v:.2f}" for k, v in r["critical_path"].items() if abs(v) >= 0.005]
    return f"{r['binds']} (" + " ".join(parts) + ")"


def header(result: dict) -> str:
    c = result["config"]
    dev, mesh, link, model = c["device"], c["mesh"], c["link"], c["model"]
    shared = "; one uplink per participant, shared by its sends" if link["access"] == "uplink" else ""
    return (f"model: {model['n_layer']} layers, d {model['d_model']}, heads {model['n_head']}/"
            f"{model['n_kv_head']}, ffn {model['ffn']}, vocab {model['vocab_size']}, seq {model['seq_len']}"
            f"{', tied embeddings' if model['tie_embeddings'] else ''}\n"
            f"mesh: {mesh['stages']} stages × {mesh['replicas']} replicas = {mesh['participants']} "
            f"participants, {mesh['microbatches']} microbatches, {mesh['batch_tokens']} tokens/step\n"
            f"device: {dev['name']} ({dev['peak_tflops']:.0f} TFLOP/s peak at utilization "
            f"{dev['utilization']}, {dev['memory_gb']:.0f} GB, {dev['memory_bandwidth_gbs']:.0f} GB/s)\n"
            f"links: PP {link['pp_bandwidth_mbit']:g} Mbit/s, DP {link['dp_bandwidth_mbit']:g} Mbit/s, "
            f"{link['latency_ms']:g} ms one way{shared}\n")


def _anchor(r: dict) -> str:
    """An anchored row's anchor: bytes per token, and whether it keeps up (shares dropped)."""
    a = r["anchor"]
    if a["keeps_up"]:
        state = f"keeps up (≤ {a['late_max']} of {a['max_late']} steps late)"
    elif a["dropped_late"]:
        state = f"LATE: {a['dropped_late']} of {a['delivered'] + a['dropped_late']} shares dropped"
    else:
        state = "nothing due yet"
    return f"{_bytes(a['bytes_per_token'])} {state}"


def format_table(result: dict) -> str:
    doubling = result["binds_from"] == "doubling"
    anchored = "anchor" in result["given"]
    cols = ["method", "tokens/s", "B/tok PP", "B/tok DP", *(["anchor B/tok"] if anchored else []),
            "memory/worker (w+g+opt+act+stash)", "fits",
            "idle", "binds (tokens/s × if doubled)" if doubling else "binds (share of the critical path)"]
    lines = []
    for r in [result["given"], *result["methods"]]:
        lines.append([r["method"], f"{r['tokens_per_s']:,.0f}", _bytes(r["bytes_per_token_pp"]),
                      _bytes(r["bytes_per_token_dp"]), *([_anchor(r)] if anchored else []),
                      _memory(r["memory_gb"]), "yes" if r["fits"] else "NO", f"{r['idle_fraction']:.2f}",
                      _binds(r)])
    widths = [max(len(x[i]) for x in [cols, *lines]) for i in range(len(cols))]
    fmt = "  ".join(f"{{:<{w}}}" if i in (0, len(cols) - 1) else f"{{:>{w}}}" for i, w in enumerate(widths))
    body = "\n".join(fmt.format(*x) for x in [cols, *lines])
    given = result["given"]
    legend = (f"\nas given: {given['tokens_per_s']:,.0f} tokens/s over train.steps = "
              f"{result['config']['train_steps']} (drain points included; steady state "
              f"{given['steady_tokens_per_s']:,.0f}); method rows: steady state.\n"
              "idle: share of all workers' time. " + (
                  "binds: the resource whose doubling (FLOP rate, PP or DP bandwidth, half the "
                  "latency) raises tokens/s most (none: no doubling gains 5%); " if doubling else
                  "binds: the resource with the largest share of the steady state's critical "
                  "path (compute, PP or DP bandwidth, latency; upd: optimizer steps); doubling "
                  "it gains at most 1/(1 − share/2) (none: under 5%); ")
              + "oversubscribed: a link handed more bytes than it can send, whose queue grows "
              "for as long as the run lasts (no steady state)." + (
                  "\nanchor B/tok: the anchor circuit's bytes (hand-offs, relay, boundaries, shares) "
                  "per training token; keeps up: no share dropped (each arrived by its due step + "
                  "anchor.max_late; the most steps late shown)." if anchored else ""))
    notes = "\n".join(f"note: {n}" for n in result["notes"])
    processes = f"{result['processes']} process{'es' if result['processes'] > 1 else ''}"
    timing = f"\nplanner: {result['planner_s']:.1f} s ({result['simulations']} simulations on {processes})"
    return header(result) + "\n" + body + "\n" + legend + ("\n\n" + notes if notes else "") + timing


def write_plot(result: dict, path: Path) -> Path:
    """One panel per DP strategy (or one panel at D = 1), one line per boundary codec × schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    panels: dict[str, list[str]] = {}
    for label in sweep["tokens_per_s"]:
        dp = label.removeprefix(sweep["pp"][label]).strip(" ·") or "D = 1"
        panels.setdefault(dp, []).append(label)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 4.6), sharey=True,
                             squeeze=False)
    for ax, (dp, labels) in zip(axes[0], panels.items(), strict=True):
        for label in labels:
            pp = sweep["pp"][label]
            ax.plot(sweep["bandwidth_mbit"], sweep["tokens_per_s"][label], marker="o", label=pp,
                    linestyle="--" if "async" in pp else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(dp)
        ax.set_xlabel("every link's bandwidth (Mbit/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("predicted tokens/s (steady state)")
    c = result["config"]
    fig.suptitle(f"{c['mesh']['stages']}×{c['mesh']['replicas']} mesh, {c['model']['n_layer']} layers "
                 f"d={c['model']['d_model']}, {c['device']['name']} at {c['device']['utilization']}, "
                 f"{c['link']['latency_ms']:g} ms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["format_table", "header", "write_plot"]
