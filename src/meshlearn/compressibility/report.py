"""``compress.md``: the tables of ``compress.json`` in reading order."""

from __future__ import annotations

from meshlearn.compressibility.matrices import BLOCK_KINDS


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(result: dict) -> str:
    base = result["uncompressed_val_loss"]
    first = result["results"][0]["account"] if result["results"] else None
    rows = [["uncompressed", "1.00", "1.0000", "1.0000", f"{base:.4f}", "+0.0000",
             str(first["total_before"]) if first else "—"]]
    for r in result["results"]:
        a = r["account"]
        rows.append([r["pipeline"], f"{r['keep']:.2f}", f"{a['kept_in_compressed']:.4f}",
                     f"{a['kept_total']:.4f}", f"{r['val_loss']:.4f}", f"{r['loss_increase']:+.4f}",
                     str(a["total_after"])])
    return _table(["pipeline", "target keep", "kept in compressed matrices", "kept of all parameters",
                   "val loss", "Δ loss", "parameters"], rows)


def stable_rank_table(result: dict) -> str:
    spectra = result["spectra"]
    kinds = [k for k in BLOCK_KINDS if any(s["kind"] == k for s in spectra)]
    layers = sorted({s["layer"] for s in spectra})
    by_key = {(s["layer"], s["kind"]): s for s in spectra}
    rows = []
    for layer in layers:
        cells = [f"{by_key[(layer, k)]['stable_rank']:.2f}" if (layer, k) in by_key else "—" for k in kinds]
        rows.append([str(layer), *cells])
    rows.append(["mean", *(f"{result['stable_rank']['by_kind'][k]:.2f}" for k in kinds)])
    shapes = {k: "×".join(map(str, next(s["shape"] for s in spectra if s["kind"] == k))) for k in kinds}
    return _table(["layer", *(f"{k} ({shapes[k]})" for k in kinds)], rows)


def render_markdown(result: dict) -> str:
    cal, val = result["calibration"], result["validation"]
    parts = [
        f"# Compressibility of `{result['run']}` (step {result['step']}, {result['optimizer']}, "
        f"lr {result['lr']:g})",
        "",
        f"Validation: {val['batches']} batches × {val['batch_size']} sequences × {val['seq_len']} tokens "
        "(the run's own), through the unsplit model without a boundary codec. Calibration (ASVD, "
        f"SVD-LLM): {cal['sequences']} windows of {cal['seq_len']} tokens from the {cal['split']} split, "
        f"seed {cal['seed']}. Every block matrix (q, k, v, o, gate, up, down) gets rank "
        "⌊keep·mn/(m+n)⌋; the embedding, head and norms stay dense and count in \"kept of all "
        "parameters\".",
        "",
        results_table(result),
        "",
        f"Stable rank ‖W‖_F²/‖W‖₂² per block matrix (mean over all: {result['stable_rank']['mean']:.2f})",
        "",
        stable_rank_table(result),
    ]
    if result["skipped"]:
        parts += ["", "Left dense (not factorized):", ""]
        parts += [f"- `{name}`: {why}" for name, why in result["skipped"].items()]
    parts += ["", "Plots: [spectra](spectra.png), [loss vs kept parameters](loss_vs_kept.png)"]
    return "\n".join(parts) + "\n"
