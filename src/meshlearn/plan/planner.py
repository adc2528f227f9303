"""``meshlearn plan``: predicted throughput, bytes and memory per method, from the simulator.

Every number except memory comes from the SimDriver's own event loop over cost-only workers
(``plan.cost``: the codec's exact wire sizes, the device model's durations, the run's links and
DP strategies), run just long enough to show the steady state (``plan.steady``). The answer:

- ``tokens_per_s``: the configuration as given, over its whole run (drain points included);
- ``methods``: one row per method combination, in steady state, with what binds it (measured:
  the steady state's critical path split by resource, ``plan.critical``; or, with
  ``binds = "doubling"``, tokens/s × when each resource doubles, four more simulations a row);
- ``sweep``: steady-state tokens/s of each combination with every link at each bandwidth (none
  asked: no sweep simulated).
"""

from __future__ import annotations

import time

from meshlearn.config import RunConfig
from meshlearn.mesh.compute import DEVICE_MEMORY_GB, DEVICES
from meshlearn.plan.methods import given_label, methods, replace, subspace_rank
from meshlearn.plan.parallel import run_all
from meshlearn.plan.steady import Prediction, doublings, with_gains, with_path

SWEEP_MBIT = (25.0, 100.0, 400.0, 1600.0)
MASK_KEEP = (0.05,)
BINDS = ("path", "doubling")


def with_bandwidth(cfg: RunConfig, mbit: float) -> RunConfig:
    """Every link at ``mbit`` (per-axis bandwidths and per-link overrides dropped)."""
    return replace(cfg, link={"bandwidth_mbit": mbit},
                   links={"dp_bandwidth_mbit": 0.0, "pp_bandwidth_mbit": 0.0, "overrides": ""})


def row(label: str, cfg: RunConfig, p: Prediction) -> dict:
    memory, window = p.memory, p.window
    return {
        "method": label, "tokens_per_s": p.steady_tokens_per_s,
        "bytes_per_token_pp": window.bytes_pp / window.tokens,
        "bytes_per_token_dp": window.bytes_dp / window.tokens,
        "memory_gb": {"weights": memory.weights / 1e9, "grads": memory.grads / 1e9,
                      "optimizer": memory.optimizer / 1e9, "activations": memory.activations / 1e9,
                      "stashes": memory.stash / 1e9, "total": memory.total / 1e9,
                      "worker": p.memory_worker},
        "fits": memory.total <= DEVICE_MEMORY_GB[cfg.sim.device] * 1e9,
        "idle_fraction": window.idle_fraction, "binds": p.binds,
        "critical_path": dict(window.path or {}),
        "gain_if_doubled": dict(p.gains),
        "busy_share": {"compute": window.compute_share, "pp_link": window.pp_link_share,
                       "dp_link": window.dp_link_share, "uplink": window.uplink_share},
        "stash_versions": p.stash_versions, "in_flight_peak": p.in_flight_peak,
        "steps_simulated": p.steps_simulated,
        **({"anchor": window.anchor.as_dict()} if window.anchor is not None else {}),
    }


def describe(cfg: RunConfig) -> dict:
    m, mesh, sim = cfg.model, cfg.mesh, cfg.sim
    peak, bandwidth = DEVICES[sim.device]
    return {
        "model": {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head, "n_kv_head": m.kv_heads,
                  "ffn": m.ffn_width, "vocab_size": m.vocab_size, "seq_len": m.seq_len,
                  "tie_embeddings": m.tie_embeddings, "subspace_rank": m.subspace_rank},
        "mesh": {"stages": mesh.stages, "replicas": mesh.replicas,
                 "participants": mesh.stages * mesh.replicas, "schedule": mesh.schedule,
                 "microbatches": mesh.microbatches, "batch_tokens": cfg.train.batch_size * m.seq_len},
        "device": {"name": sim.device, "peak_tflops": sim.peak_tflops or peak,
                   "utilization": sim.utilization, "memory_gb": DEVICE_MEMORY_GB[sim.device],
                   "memory_bandwidth_gbs": bandwidth},
        "link": {"bandwidth_mbit": cfg.link.bandwidth_mbit, "latency_ms": cfg.link.latency_ms,
                 "pp_bandwidth_mbit": cfg.links.pp_bandwidth_mbit or cfg.link.bandwidth_mbit,
                 "dp_bandwidth_mbit": cfg.links.dp_bandwidth_mbit or cfg.link.bandwidth_mbit,
                 "access": cfg.links.access},
        "codec": cfg.codec.name, "dp": cfg.dp.name, "optim": cfg.optim.name,
        "train_steps": cfg.train.steps,
    }


def plan(cfg: RunConfig, rank: int = 0, keeps: tuple[float, ...] = MASK_KEEP,
         sweep: tuple[float, ...] = SWEEP_MBIT, processes: int = 1, binds: str = "path") -> dict:
    """The planner's whole answer as a JSON-able object; its simulations run on ``processes``
    processes (``plan.parallel``: the same numbers whatever the count). ``binds``: ``path``
    (each row's critical path, from its own simulation) or ``doubling`` (each resource doubled
    in a simulation of its own: the reference, four more simulations per row)."""
    if binds not in BINDS:
        raise ValueError(f"binds = {binds!r}: allowed {list(BINDS)}")
    started = time.perf_counter()
    notes = ["mask rows: the mask codec's wire size through a cost-only stand-in (plan.mask: "
             "its K = round(keep·d) values per token in codec.wire_dtype, no indices)" + (
                 "" if cfg.anchor.z else "; anchor.z = 0: no anchor circuit")]
    if cfg.anchor.z:
        notes.append(f"anchor.z = {cfg.anchor.z}: every row runs the anchor circuit beside the fast "
                     "one (plan.anchor: its hand-offs, relay, passes and shares on its own clocks and "
                     "links; on the senders' uplinks with links.access = uplink); tokens/s is the fast "
                     "circuit's")
    for key, on in [("verify.name", cfg.verify.name != "none"), ("warmup.enabled", cfg.warmup.enabled),
                    ("attack.kind", cfg.attack.kind != "none")]:
        if on:
            notes.append(f"{key}: not modelled by the planner (its time is not in these numbers)")
    variants, skipped = methods(cfg, subspace_rank(cfg, rank), keeps)
    notes += [f"skipped {s}" for s in skipped]
    path = binds == "path"  # the rows' simulations split their critical path; no doublings
    jobs = [("predict", cfg, None, path)]
    rows_run = {(v.cfg, v.mask_keep) for v in variants}
    for v in variants:
        jobs.append(("steady", v.cfg, v.mask_keep, path))
        jobs += [("steady", c, v.mask_keep, False) for c in ([] if path else doublings(v.cfg).values())]
        jobs += [("steady", c, v.mask_keep, False) for c in (with_bandwidth(v.cfg, mbit) for mbit in sweep)
                 if not (path and (c, v.mask_keep) in rows_run)]  # a sweep point that is a row: its run
    jobs += [("steady", c, None, False) for c in ([] if path else doublings(cfg).values())]
    done = run_all(jobs, processes)

    def lookup(c: RunConfig, keep: float | None) -> Prediction:
        return done.get(("steady", c, keep, path)) or done[("steady", c, keep, False)]

    def bound(c: RunConfig, p: Prediction, keep: float | None) -> Prediction:
        return with_path(c, p) if path else with_gains(c, p, keep, lookup)

    given = bound(cfg, done[("predict", cfg, None, path)], None)
    rows = [row(v.label, v.cfg, bound(v.cfg, lookup(v.cfg, v.mask_keep), v.mask_keep)) for v in variants]
    curves = {v.label: [lookup(with_bandwidth(v.cfg, mbit), v.mask_keep).tokens_per_s for mbit in sweep]
              for v in variants}
    given_row = row(given_label(cfg), cfg, given)
    given_row["steady_tokens_per_s"] = given_row["tokens_per_s"]
    given_row["tokens_per_s"] = given.tokens_per_s
    given_row["drain_overhead_s"] = given.overhead_s
    given_row["whole_run_simulated"] = given.whole_run
    return {"tokens_per_s": given.tokens_per_s, "given": given_row, "config": describe(cfg),
            "methods": rows,
            "sweep": {"bandwidth_mbit": list(sweep), "tokens_per_s": curves,
                      "pp": {v.label: v.pp for v in variants}},
            "notes": notes, "planner_s": time.perf_counter() - started, "binds_from": binds,
            "simulations": len(set(jobs)), "processes": processes}


__all__ = ["plan", "with_bandwidth"]
