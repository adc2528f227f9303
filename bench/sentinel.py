"""SENTINEL against adversarial workers on the demo mesh, side by side with no verification and a clean run.

Every attack sits on worker r1s2 (replica 1, stage 2: a middle stage; ``--attacker`` moves it, to the
first or last stage too where ``verify.trusted_ends`` verifies them: from 3 replicas by default) and
starts halfway through the run; with the demo's two replicas that is
50% of one stage's workers (``--replicas 4`` gives exactly 25%). For each attack the same run is
trained three times: with SENTINEL, with SENTINEL that flags but never bans (``verify.ban=false``:
the attacker keeps sending, so the detector is scored per message over a whole attack), and without
verification; next to clean runs with and without SENTINEL. Runs are independent processes
(``--jobs``), one torch thread each.

Also measured: false positives on a clean run of the full demo length (300 steps), and the verifiers'
overhead — two trainers (with and without SENTINEL) stepped alternately in one process, so both see
the same machine load; wall-clock and virtual-clock step times side by side.

    python bench/sentinel.py [--steps 200] [--jobs 2] [--replicas 2] [--overhead-steps 30] [--reuse]
    python bench/sentinel.py --replicas 4 --demo-steps 0 --overhead-steps 0  # 25% of stage 2
    python bench/sentinel.py --harness extras             # variants and gradient-only attacks
    python bench/sentinel.py --harness main,grown --replicas 4 --attacker r1s1  # issue 17's harness
    python bench/sentinel.py --replicas 4 --only adaptive  # 25% malicious: inside the threat model
    python bench/sentinel.py --replicas 4 --harness main,grown --attacker r1s0 --only zeros,permute
    python bench/sentinel.py --only scaling,zeros --tag subspace --set codec.name=subspace
        --set model.subspace_rank=8  # (one line) verify the compressed wire form
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from common import ROOT, demo_config, finished_run, markdown_table, scratch_trainer, slug, write_results

from meshlearn.atomic import atomic_write_json
from meshlearn.errors import ConfigError
from meshlearn.jsonl import read_records
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer
from meshlearn.verify.attacks import AttackConfig
from meshlearn.verify.forgeries import FORGERIES

OUT = ROOT / "bench" / "out" / "sentinel"
ATTACKER = WorkerId(1, 2)  # the default placement (--attacker): a middle stage
DEFAULTS = AttackConfig()
# (label, attack overrides, what the parameters are)
ATTACKS: list[tuple[str, list[str], str]] = [
    ("zeros", ["attack.kind=zeros"], ""),
    ("random", ["attack.kind=random"], "N(0, σ²), σ = the message's std"),
    ("scaling", ["attack.kind=scaling"], f"c = {DEFAULTS.scale:g}"),
    ("sign_flip", ["attack.kind=sign_flip"], f"{DEFAULTS.sign_fraction:.0%} of channels"),
    ("replay", ["attack.kind=replay"], "delay {replay_delay} steps"),  # the run's, filled in below
    ("bias", ["attack.kind=bias"], f"RMS {DEFAULTS.bias:g}σ per channel"),
    ("invisible_noise", ["attack.kind=invisible_noise"], f"ρ = {DEFAULTS.noise_rho:g}"),
    ("mixed", ["attack.kind=mixed"], f"switches every {DEFAULTS.mixed_period} steps among 7"),
    ("adaptive", ["attack.kind=adaptive"],
     f"bias ≤ {DEFAULTS.adaptive_max:g}σ, margin {DEFAULTS.adaptive_margin:g} of the fence above the median"),
]
EXTRAS: list[tuple[str, list[str], str]] = [
    ("scaling ×10", ["attack.kind=scaling", "attack.scale=10"], "c = 10"),
    ("scaling ×0.1", ["attack.kind=scaling", "attack.scale=0.1"], "c = 0.1"),
    ("invisible_noise ρ=1", ["attack.kind=invisible_noise", "attack.noise_rho=1"], "ρ = 1"),
    ("invisible_noise ρ=2", ["attack.kind=invisible_noise", "attack.noise_rho=2"], "ρ = 2"),
    ("scaling, gradients only", ["attack.kind=scaling", "attack.target=gradients"],
     f"c = {DEFAULTS.scale:g}"),
    ("sign_flip, gradients only", ["attack.kind=sign_flip", "attack.target=gradients"],
     f"{DEFAULTS.sign_fraction:.0%} of channels"),
]

COLLUDERS = f"{WorkerId(1, 1)},{WorkerId(0, 2)}"  # two middle stages, two replicas
RAMP = 50
WARMUP_START = "warmup_half"  # placeholder: half the run's verify.warmup_steps, filled in by main()
# The harness grown for issue 17: symmetric corruptions, slow drift, attacks that begin inside the
# verifier's warm-up, intermittent and colluding attackers, and wire-level forgeries (receivers check
# every payload; a refused message is quarantined and counted under "wire rejects").
GROWN: list[tuple[str, list[str], str]] = [
    ("permute", ["attack.kind=permute"], "sequences of each microbatch deranged"),
    ("permute, gradients only", ["attack.kind=permute", "attack.target=gradients"],
     "sequences of each microbatch deranged"),
    ("drift bias", ["attack.kind=bias", f"attack.ramp_steps={RAMP}"],
     f"bias {DEFAULTS.bias:g}σ reached over {RAMP} steps"),
    ("drift noise", ["attack.kind=invisible_noise", "attack.noise_rho=2", f"attack.ramp_steps={RAMP}"],
     f"ρ = 2 reached over {RAMP} steps"),
    ("bias from warm-up", ["attack.kind=bias", f"attack.start_step={WARMUP_START}"],
     "starts halfway through the verifier's warm-up"),
    ("intermittent scaling", ["attack.kind=scaling", "attack.period=10", "attack.duty=2"],
     f"c = {DEFAULTS.scale:g}, on 2 of every 10 steps"),
    ("colluding bias", ["attack.kind=bias", f"attack.workers={COLLUDERS}"], f"{COLLUDERS}, RMS 1σ"),
    *[(kind, [f"attack.kind={kind}", "attack.replay_delay=1"], "wire forgery") for kind in FORGERIES],
]
HARNESSES = {"main": ATTACKS, "extras": EXTRAS, "grown": GROWN}


def base_overrides(steps: int, replicas: int) -> list[str]:
    return [f"train.steps={steps}", f"mesh.replicas={replicas}", "train.checkpoint_every=0",
            f"train.eval_every={steps // 2}", "verify.decision_log=none"]


def train_one(name: str, overrides: list[str], attacker: WorkerId, run_dir: Path, reuse: bool) -> dict:
    """One run in ``run_dir``, or the result of the run already finished there with the same config
    (``--reuse``). Checkpoints are deleted afterwards (a replaying attacker's is large); the config,
    metrics, summary and this bench's own result stay."""
    torch.set_num_threads(1)
    cfg = demo_config(*overrides)
    result_path = run_dir / "bench_result.json"
    if reuse and finished_run(run_dir, cfg) is not None and result_path.is_file():
        result = json.loads(result_path.read_text())
        print(f"  {name}: val {result['final_val_loss']:.4f} (reused {run_dir.name})", flush=True)
        return result
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    started = time.perf_counter()
    trainer = Trainer(cfg, run_dir, progress=False)
    summary = trainer.train()
    rejections = summary["wire_rejections"] if trainer.cfg.attack.kind in FORGERIES else None
    trust_summary = summary.get("trust") or {}
    train = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    result = {"name": name, "overrides": overrides, "final_val_loss": summary["final_val_loss"],
              "banned_workers": summary.get("banned_workers"), "trust": summary.get("trust"),
              "alert": bool(trust_summary.get("alert")),
              "step_sim_s": statistics.mean(r["step_sim_s"] for r in train),
              "step_wall_s": statistics.mean(r["step_wall_s"] for r in train),
              "run_wall_s": time.perf_counter() - started,
              "wire_rejections": rejections}
    trust = trainer.plugins.get("trust")  # absent from a clean run without verification
    attack = trust.trust.attacks.get(attacker) if trust is not None else None
    if attack is not None and attack.name == "adaptive":
        alphas = attack.alphas
        result["adaptive"] = {"messages": len(alphas), "alpha_max": max(alphas, default=0.0),
                              "alpha_mean": statistics.mean(alphas) if alphas else 0.0,
                              "alpha_zero": sum(a == 0 for a in alphas)}
    for checkpoint in run_dir.glob("checkpoint*.pt"):
        checkpoint.unlink()
    atomic_write_json(result_path, result)
    print(f"  {name}: val {summary['final_val_loss']:.4f} in {result['run_wall_s']:.0f}s", flush=True)
    return result


def run_folder(tag: str, name: str, overrides: list[str]) -> Path:
    """Where a run lives: the label plus a digest of its overrides and of meshlearn's source (the
    package and this script), so different invocations (replicas, placement, --set) never share a
    folder and ``--reuse`` never mixes runs of different code."""
    digest = hashlib.sha1("\n".join(overrides).encode() + SOURCE_DIGEST.encode()).hexdigest()[:10]
    return OUT / (tag or "default") / f"{slug(name)}-{digest}"


def source_digest() -> str:
    files = sorted((ROOT / "src" / "meshlearn").rglob("*.py")) + [Path(__file__).resolve()]
    return hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()


SOURCE_DIGEST = source_digest()


def measure_overhead(steps: int, warmup: int, replicas: int, overrides: list[str]) -> dict:
    """Alternate steps of a verified and an unverified trainer; the order flips every step."""
    torch.set_num_threads(1)
    base = [*base_overrides(steps + warmup, replicas), *overrides]
    trainers = {v: scratch_trainer(demo_config(*base, f"verify.name={v}")) for v in ("sentinel", "none")}
    wall = {v: [] for v in trainers}
    sim = {v: [] for v in trainers}
    for t in range(warmup + steps):
        order = ["sentinel", "none"] if t % 2 == 0 else ["none", "sentinel"]
        for v in order:
            trainer = trainers[v]
            sim_before = trainer.driver.clock.step_end
            started = time.perf_counter()
            trainer.step()
            if t >= warmup:
                wall[v].append(time.perf_counter() - started)
                sim[v].append(trainer.driver.clock.step_end - sim_before)
    out = {v: {"wall_s": statistics.mean(wall[v]), "sim_s": statistics.mean(sim[v])} for v in trainers}
    out["wall_overhead"] = out["sentinel"]["wall_s"] / out["none"]["wall_s"] - 1
    out["sim_overhead"] = out["sentinel"]["sim_s"] / out["none"]["sim_s"] - 1
    out["steps"] = steps
    return out


def steps_to_ban(run: dict) -> int | None:
    """Steps until the last attacker's ban (None while any of them is still unbanned)."""
    steps = [a["steps_to_ban"] for a in (run["trust"] or {}).get("attackers") or []]
    return None if not steps or None in steps else max(steps)


def attack_row(label: str, params: str, target: str, verified: dict, observed: dict | None,
               unverified: dict | None, clean: dict) -> dict:
    """Per-message scores from the run without bans (None: not run); bans, damage and the with-ban
    scores from the other; the damage without verification from the unverified run (None: not run)."""
    val_none = unverified and unverified["final_val_loss"]
    messages = verified["trust"]["messages"]["all"]
    unscored = dict.fromkeys(("precision", "recall", "f1", "tp", "fp", "fn", "fpr"))
    detector = observed["trust"]["messages"]["all"] if observed is not None else unscored
    workers = verified["trust"]["workers"]
    return {"attack": label, "params": params, "target": target,
            "precision": detector["precision"], "recall": detector["recall"], "f1": detector["f1"],
            "tp": detector["tp"], "fp": detector["fp"], "fn": detector["fn"], "fpr": detector["fpr"],
            "skipped_attack": observed and observed["trust"]["skipped_messages"]["malicious"],
            "val_observe": observed and observed["final_val_loss"],
            "ban_tp": messages["tp"], "ban_fp": messages["fp"], "ban_precision": messages["precision"],
            "ban_recall": messages["recall"], "ban_f1": messages["f1"],
            "worker_f1": workers["f1"], "steps_to_ban": steps_to_ban(verified),
            "honest_banned": workers["fp"], "rebased": verified["trust"]["rebased_references"],
            "alert": verified["alert"],
            "val_sentinel": verified["final_val_loss"], "val_none": val_none,
            "val_clean": clean["final_val_loss"],
            "gap_sentinel": verified["final_val_loss"] - clean["final_val_loss"],
            "gap_none": None if val_none is None else val_none - clean["final_val_loss"],
            "wire_rejects": verified["wire_rejections"]}


def fmt(value: object, spec: str = ".3f") -> str:
    return "—" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def attack_tables(rows: list[dict]) -> tuple[str, str]:
    """The detector per message (no bans), then the defence end to end (with bans)."""
    counts = ("steps_to_ban", "honest_banned", "tp", "fp", "fn", "skipped_attack", "ban_tp", "ban_fp",
              "rebased", "wire_rejects")
    shown = [{k: fmt(v, "d") if k in counts else fmt(v) for k, v in r.items()} for r in rows]
    for row, raw in zip(shown, rows, strict=True):
        row["alert"] = "yes" if raw["alert"] else "no"
    for row, raw in zip(shown, rows, strict=True):
        row["gap_sentinel"] = fmt(raw["gap_sentinel"], "+.3f")
        row["gap_none"] = fmt(raw["gap_none"], "+.3f")
        row["fpr"] = fmt(None if raw["fpr"] is None else 100 * raw["fpr"], ".2f") + "%"
    detector = markdown_table(shown, [
        ("attack", "attack", ""), ("params", "parameters", ""), ("target", "target", ""),
        ("tp", "attack msgs flagged", ""), ("fn", "attack msgs missed", ""),
        ("skipped_attack", "attack msgs skipped", ""), ("fp", "honest msgs flagged", ""),
        ("precision", "precision", ""), ("recall", "recall", ""), ("f1", "F1", ""), ("fpr", "FPR", ""),
        ("val_observe", "val loss (flag, no ban)", "")])
    wire = [("wire_rejects", "wire rejects", "")] if any(r["wire_rejects"] is not None for r in rows) else []
    defence = markdown_table(shown, [
        ("attack", "attack", ""), ("worker_f1", "worker F1", ""), ("steps_to_ban", "steps to ban", ""),
        ("honest_banned", "honest bans", ""), ("alert", "alert", ""), ("rebased", "rebased refs", ""),
        ("ban_tp", "attack msgs flagged", ""), ("ban_fp", "honest msgs flagged", ""),
        ("ban_precision", "msg precision", ""), ("ban_f1", "msg F1", ""),
        ("val_sentinel", "val loss SENTINEL", ""), ("val_none", "val loss no verification", ""),
        ("val_clean", "val loss clean", ""), ("gap_sentinel", "SENTINEL − clean", ""),
        ("gap_none", "none − clean", ""), *wire])
    return detector, defence


def goals(rows: list[dict], clean_demo: dict | None, replicas: int) -> list[str]:
    """Issue 17's goals per attack. The invariant (SENTINEL never worse than no verification, +0.02)
    and no honest ban hold at any replica count; detection goals apply where the threat model's
    honest majority holds (≥ 3 replicas: one ban allowed per stage); at 2 replicas nobody may be
    banned, so an alert is what must happen instead."""
    lines = []
    for r in rows:
        checks = {"no honest ban": r["honest_banned"] == 0}
        if r["val_none"] is not None:
            checks["SENTINEL ≤ none + 0.02"] = r["val_sentinel"] <= r["val_none"] + 0.02
        if r["wire_rejects"] is None and not r["attack"].startswith("adaptive"):
            if r["f1"] is not None:
                checks["message F1 ≥ 0.95 (no bans)"] = r["f1"] >= 0.95
            if replicas >= 3:
                checks["worker F1 ≥ 0.95"] = r["worker_f1"] is not None and r["worker_f1"] >= 0.95
                checks["ban ≤ 10 steps"] = r["steps_to_ban"] is not None and r["steps_to_ban"] <= 10
                checks["|val − clean| ≤ 0.05"] = abs(r["gap_sentinel"]) <= 0.05
            else:
                checks["alert raised"] = r["alert"]
        missed = [k for k, ok in checks.items() if not ok]
        verdict = "all met (" + ", ".join(checks) + ")" if not missed else "missed " + ", ".join(missed)
        lines.append(f"- {r['attack']} ({r['target']}): {verdict}")
    if clean_demo is not None:
        m = clean_demo["trust"]["messages"]["all"]
        banned = len(clean_demo["banned_workers"])
        fpr = m["fpr"] or 0.0
        lines.append(f"- clean demo run ({clean_demo['steps']} steps): FPR {100 * fpr:.2f}% "
                     f"({'met' if fpr <= 0.01 else 'missed'} ≤ 1%), {banned} honest worker(s) banned "
                     f"({'met' if banned == 0 else 'missed'})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="attack sets (labels for --only):\n" + "\n".join(
            f"  {name}: " + "; ".join(label for label, _, _ in specs) for name, specs in HARNESSES.items()))
    parser.add_argument("--steps", type=int, default=200, help="steps per run; attacks start halfway")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="runs trained in parallel")
    parser.add_argument("--overhead-steps", type=int, default=30)
    parser.add_argument("--demo-steps", type=int, default=300, help="clean FPR run length; 0 skips it")
    parser.add_argument("--harness", default="main",
                        help="comma-separated attack sets: main; extras (stronger/weaker variants and "
                             "gradient-only attacks); grown (issue 17: permute, slow drift "
                             "(attack.ramp_steps), a start inside the warm-up, intermittent "
                             f"(attack.period/duty), colluding attackers {COLLUDERS}, and the wire "
                             f"forgeries {', '.join(FORGERIES)}; forge_ids needs --set codec.name=subspace "
                             "or topk and is skipped otherwise)")
    parser.add_argument("--attacker", default=str(ATTACKER),
                        help="the attacking worker, rRsS (the first and last stages only where "
                             "verify.trusted_ends verifies them: from 3 replicas by default)")
    parser.add_argument("--observe", choices=("all", "none"), default="all",
                        help="also train each attack flag-only (verify.ban=false) to score the detector "
                             "per message; wire forgeries never need it (receivers reject them)")
    parser.add_argument("--verified-only", action="store_true",
                        help="train each attack with SENTINEL only (no flag-only run, no unverified run: "
                             "the invariant against no verification is then not checked); the clean "
                             "runs stay, so damage is still measured against clean")
    parser.add_argument("--only", default="",
                        help="attack labels to run (and no overhead), comma-separated, or semicolon-"
                             "separated when a label has a comma (\"permute, gradients only;zeros\")")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="config override for every run (repeatable), e.g. codec.name=subspace")
    parser.add_argument("--tag", default="", help="suffix of the results files")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs in bench/out/sentinel/TAG/ that finished with the same config "
                             "and source (each run is kept there as it finishes, so an interrupted "
                             "bench resumes)")
    args = parser.parse_args()
    only = [label.strip() for label in args.only.split(";" if ";" in args.only else ",") if label.strip()]
    chosen = [name.strip() for name in args.harness.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in HARNESSES]
    if unknown or not chosen:
        parser.error(f"--harness {args.harness!r}: allowed sets are {', '.join(HARNESSES)}")
    try:
        attacker = WorkerId.parse(args.attacker)
    except ValueError as err:
        parser.error(f"--attacker {args.attacker!r}: {err}")
    began = time.perf_counter()
    start = args.steps // 2
    base = [*base_overrides(args.steps, args.replicas), *args.overrides]
    warmup_half = str(demo_config(*base).verify.warmup_steps // 2)
    specs = []
    for label, overrides, params in (spec for name in chosen for spec in HARNESSES[name]):
        if only and label not in only:
            continue
        overrides = [o.replace(WARMUP_START, warmup_half) for o in overrides]
        try:
            cfg = demo_config(*base, f"attack.workers={attacker}", *overrides)
        except ConfigError as err:  # e.g. forge_ids on a codec without index fields
            print(f"skipped {label}: {err}", flush=True)
            continue
        specs.append((label, overrides, params.replace("{replay_delay}", str(cfg.attack.replay_delay))))
    jobs: dict[str, list[str]] = {"clean/sentinel": [*base, "verify.name=sentinel"],
                                  "clean/none": [*base, "verify.name=none"]}
    for label, overrides, _ in specs:
        attacked = [*base, f"attack.workers={attacker}", f"attack.start_step={start}", *overrides]
        jobs[f"{label}/sentinel"] = [*attacked, "verify.name=sentinel"]
        if args.verified_only:
            continue
        if args.observe == "all" and not _is_forgery(overrides):
            jobs[f"{label}/observe"] = [*attacked, "verify.name=sentinel", "verify.ban=false"]
        jobs[f"{label}/none"] = [*attacked, "verify.name=none"]
    full_main = chosen == ["main"] and not only
    if args.demo_steps and full_main:
        jobs["clean-demo/sentinel"] = [*base_overrides(args.demo_steps, demo_config().mesh.replicas),
                                       *args.overrides, "verify.name=sentinel"]
    overhead = None
    if args.overhead_steps and full_main:
        print("overhead: alternating steps with and without SENTINEL", flush=True)
        overhead = measure_overhead(args.overhead_steps, 3, args.replicas, args.overrides)

    print(f"{len(jobs)} runs of {args.steps} steps on {args.jobs} processes", flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(train_one, name, overrides, attacker,
                                     run_folder(args.tag, name, overrides), args.reuse)
                   for name, overrides in jobs.items()}
        runs = {name: f.result() for name, f in futures.items()}

    clean = runs["clean/none"]
    rows = [attack_row(label, params, _target(overrides), runs[f"{label}/sentinel"],
                       runs.get(f"{label}/observe"), runs.get(f"{label}/none"), clean)
            for label, overrides, params in specs]
    detector, defence = attack_tables(rows)
    fpr_rows = [{"run": f"clean, {args.steps} steps", **_fp(runs["clean/sentinel"])}]
    clean_demo = runs.get("clean-demo/sentinel")
    if clean_demo is not None:
        clean_demo["steps"] = args.demo_steps
        label = f"clean demo ({demo_config().mesh.replicas} replicas, {args.demo_steps} steps)"
        fpr_rows.append({"run": label, **_fp(clean_demo)})
    verify = demo_config(*base, "verify.name=sentinel").verify
    command = f"python bench/sentinel.py --steps {args.steps} --replicas {args.replicas}" + (
        f" --harness {args.harness}" if chosen != ["main"] else "") + (
        f" --attacker {attacker}" if attacker != ATTACKER else "") + (
        " --observe none" if args.observe == "none" else "") + (
        " --verified-only" if args.verified_only else "") + (f" --only {args.only}" if only else "") + (
        f" --tag {args.tag}" if args.tag else "") + "".join(f" --set {o}" for o in args.overrides) + (
        " --reuse" if args.reuse else "")
    observed = any(f"{label}/observe" in runs for label, _, _ in specs)
    parts = [
        f"SENTINEL on the demo mesh (4 stages × {args.replicas} replicas), {args.steps} steps per run; the "
        f"attacker is {attacker} = 1 of {args.replicas} workers of stage {attacker.stage} "
        f"({100 / args.replicas:.0f}%; the colluding row adds a second, see its parameters), "
        f"attacking from step {start}. `{command}`",
        f"**The detector, per message** (`verify.ban=false`: flagged messages are quarantined but nobody "
        f"is banned, so the attacker sends for the whole second half). Every message scored after "
        f"warm-up ({verify.warmup_steps} steps) counts; a positive is a message the attack changed. "
        f"Messages of a microbatch that an earlier flag already quarantined are skipped, not scored."
        if observed else "The detector per message was not scored (" + (
            "`--verified-only`: SENTINEL runs only)." if args.verified_only else "`--observe none`)."),
        *([detector] if observed else []),
        "**The defence, end to end** (SENTINEL defaults, bans on). A ban ends the attack, so the "
        "per-message precision here is the few attacked messages before the ban against every false "
        "flag of the run.",
        defence,
        "False positives on clean runs (SENTINEL defaults):",
        markdown_table(fpr_rows, [("run", "run", ""), ("messages", "scored messages", "d"),
                                  ("fp", "flagged", "d"), ("fpr_pct", "FPR %", ".3f"),
                                  ("banned", "honest workers banned", "d")]),
    ]
    if "adaptive/sentinel" in runs:
        parts.append(_adaptive_line(runs["adaptive/sentinel"], clean))
    if overhead is not None:
        parts.append(_overhead_line(overhead, runs["clean/sentinel"], clean))
    parts += ["Goals:\n" + "\n".join(goals(rows, clean_demo, args.replicas)),
              f"Total bench time {(time.perf_counter() - began) / 60:.1f} min."]
    payload = {"steps": args.steps, "replicas": args.replicas, "overrides": args.overrides,
               "attacker": str(attacker), "harness": chosen,
               "attack_start": start, "verify": dataclasses.asdict(verify),
               "attack_defaults": dataclasses.asdict(DEFAULTS), "rows": rows, "false_positives": fpr_rows,
               "overhead": overhead, "runs": runs}
    name = "sentinel" + "".join(f"_{h}" for h in chosen if h != "main")
    name += f"_{attacker}" if attacker != ATTACKER else ""
    name += f"_r{args.replicas}" if args.replicas != 2 else ""
    name += f"_{args.tag}" if args.tag else ""
    name += "_verified" if args.verified_only else ""
    write_results(name + ("_" + "_".join(only) if only and not args.tag else ""), payload, "\n\n".join(parts))


def _is_forgery(overrides: list[str]) -> bool:
    return any(o.startswith("attack.kind=") and o.split("=", 1)[1] in FORGERIES for o in overrides)


def _target(overrides: list[str]) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("attack.target=")), DEFAULTS.target)


def _adaptive_line(adaptive: dict, clean: dict) -> str:
    a, changed = adaptive["adaptive"], adaptive["trust"]["attackers"][0]["changed_messages"]
    return (f"Adaptive attacker: flagged {adaptive['trust']['messages']['all']['tp']} of its {changed} "
            f"changed messages, steps to ban: {fmt(steps_to_ban(adaptive))}; mean bias α = "
            f"{a['alpha_mean']:.3f}σ (max {a['alpha_max']:.3f}σ; α = 0 on {a['alpha_zero']} of "
            f"{a['messages']} messages); val loss {adaptive['final_val_loss']:.4f} vs clean "
            f"{clean['final_val_loss']:.4f} ({adaptive['final_val_loss'] - clean['final_val_loss']:+.4f}).")


def _overhead_line(overhead: dict, verified: dict, clean: dict) -> str:
    s, n = overhead["sentinel"], overhead["none"]
    runs = verified["step_sim_s"] / clean["step_sim_s"] - 1
    return (f"Overhead ({overhead['steps']} alternating steps in one process, 1 torch thread): wall "
            f"{s['wall_s']:.3f} s/step with SENTINEL vs {n['wall_s']:.3f} s without "
            f"({100 * overhead['wall_overhead']:+.1f}%); virtual clock {s['sim_s']:.4f} vs {n['sim_s']:.4f} "
            f"s/step ({100 * overhead['sim_overhead']:+.1f}%). Whole clean runs, virtual clock: "
            f"{verified['step_sim_s']:.4f} vs {clean['step_sim_s']:.4f} s/step ({100 * runs:+.1f}%).")


def _fp(run: dict) -> dict:
    m = run["trust"]["messages"]["all"]
    return {"messages": m["fp"] + m["tn"], "fp": m["fp"], "fpr_pct": 100 * (m["fpr"] or 0.0),
            "banned": run["trust"]["workers"]["fp"]}


if __name__ == "__main__":
    main()
