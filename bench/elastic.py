"""Elastic membership beside the fixed-membership driver, on the same shaped links.

The demo model on P=2 stages × D=2 replicas, every link 100 Mbit/s with 20 ms one-way latency,
sender-paced (``dist.shaping=sender``), four processes on this machine. Four runs, one after the
other: the fixed-membership DistDriver; elastic with nobody failing; elastic with worker r1s1
SIGKILLed once the writer has logged ``--fail-after`` steps; the same with SIGSTOP instead; r0s1
and r1s0 SIGKILLed together (rows broken at different stages: r0s0 and r1s1 re-paired); and a
join run: r1s1 SIGKILLed (its partner r1s0 stays and spectates), then one ``meshlearn worker
--join`` (it takes r1s1's slot), the run ended by a graceful stop (SIGTERM) a few steps after row 1
trains again.

**Join-to-first-contribution**: from starting the joiner's process to the wall time at which its
row's first step began (``contributes`` in ``workers.json``; r1s0 reports the same step), beside
the time to its heal (``joined``): process start, imports, model, the stage's next quorum and the
transfer of a peer's state.

Reported: the median wall time per step (steps after the first), the quorum's own median time per
step (``quorum_s``: asking the stage's lighthouse until the quorum formed), and for the failure
runs the **failover time**: the wall time of the steps from the first one that did not commit or
ran with fewer replicas through the first committed step of the shrunken quorum, minus one median
step of the clean elastic run — the time the failure cost the survivors (the kill lands somewhere
inside a step, so this bounds detection + recovery from above by less than a step).

    python bench/elastic.py [--steps 16] [--fail-after 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import demo_config, markdown_table, write_results

from meshlearn.config import save_config
from meshlearn.entry.launch import WORKERS_FILE, launch_local
from meshlearn.jsonl import read_records


def overrides(steps: int, elastic: bool, *extra: str) -> list[str]:
    return [*extra, "backend=dist", "mesh.stages=2", "mesh.replicas=2", "link.bandwidth_mbit=100",
            "link.latency_ms=20", f"train.steps={steps}", "train.eval_every=100000",
            "train.checkpoint_every=0", "dist.threads=1", "dist.heartbeat_s=0.2",
            "dist.dead_after_s=2", "dist.timeout_s=10", f"elastic.enabled={str(elastic).lower()}"]


def train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_records(path) if r["kind"] == "train"] if path.exists() else []


def launch_in_thread(cfg, prefix: str) -> tuple[Path, Path, threading.Thread, dict]:
    """Launch ``cfg`` in a fresh temporary folder on a thread of this process: (the folder, its run
    folder, the thread, and the dict whose ``code`` the launcher's exit code lands in)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    run_dir, source = root / "run", root / "run.toml"
    save_config(cfg, source)
    argv = ["--config", str(source), "--out", str(run_dir)]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "code", launch_local(argv, cfg, run_dir, out=io.StringIO())))
    thread.start()
    return root, run_dir, thread, result


def run(steps: int, elastic: bool, fault: signal.Signals | None, fail_after: int,
        extra: tuple[str, ...] = (), victims: tuple[str, ...] = ("r1s1",)) -> list[dict]:
    """One run of ``steps`` (``extra``: more overrides, e.g. a DP strategy; ``fault`` goes to every
    one of ``victims``); its train records."""
    root, run_dir, thread, result = launch_in_thread(demo_config(*overrides(steps, elastic, *extra)),
                                                     "meshlearn-elastic-bench-")
    pids = []
    try:
        if fault is not None:
            while len(train_records(run_dir)) < fail_after:
                assert thread.is_alive(), "the run ended before the failure was injected"
                time.sleep(0.05)
            members = json.loads((run_dir / WORKERS_FILE).read_text())
            pids = [members[name]["pid"] for name in victims]
            for pid in pids:
                os.kill(pid, fault)
        thread.join()
        assert result["code"] == 0, f"run failed: {result}"
        return train_records(run_dir)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def _events(run_dir: Path, name: str, kind: str) -> list[dict]:
    events = json.loads((run_dir / WORKERS_FILE).read_text())[name]["events"]
    return [e for e in events if e["event"] == kind and (kind != "joined" or "generation" in e)]


def _until(predicate, what: str, seconds: float = 300.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, f"{what} did not happen within {seconds:.0f} s"
        time.sleep(0.05)


def join_run(fail_after: int) -> dict:
    """r1s1 dies, its partner stays; one joiner completes row 1; the times of its join."""
    cfg = demo_config(*overrides(100_000, True))
    root, run_dir, thread, result = launch_in_thread(cfg, "meshlearn-elastic-join-")
    joiner = None
    try:
        _until(lambda: len(train_records(run_dir)) >= fail_after, "the first steps")
        os.kill(json.loads((run_dir / WORKERS_FILE).read_text())["r1s1"]["pid"], signal.SIGKILL)
        _until(lambda: _events(run_dir, "r1s1", "left") and _events(run_dir, "r1s0", "spectates"),
               "r1s1's departure and r1s0 spectating")
        address = json.loads((run_dir / "elastic.json").read_text())["store"]
        env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        started = time.time()
        with (root / "join.log").open("w") as log:
            joiner = subprocess.Popen([sys.executable, "-m", "meshlearn.entry.worker",
                                       "--join", address, "--out", str(run_dir)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT)
        _until(lambda: all(_events(run_dir, n, "contributes") for n in ("r1s0", "r1s1")),
               "row 1's first step")
        first = _events(run_dir, "r1s1", "contributes")[0]
        _until(lambda: len(train_records(run_dir)) >= first["step"] + 3, "three steps with row 1")
        os.kill(json.loads((run_dir / WORKERS_FILE).read_text())["r0s0"]["pid"], signal.SIGTERM)
        joiner.wait(timeout=120)
        thread.join()
        assert result["code"] == 0, f"run failed: {result}"
        rows = train_records(run_dir)
        healed = _events(run_dir, "r1s1", "joined")[0]
        spectated = _events(run_dir, "r1s0", "spectates")[0]["step"]
        return {"heal_s": healed["at"] - started, "heal_step": healed["step"] + 1,
                "contribution_s": first["at"] - started, "contribution_step": first["step"] + 1,
                "spectated_from": spectated + 1,
                "after": [r for r in rows if r["step"] > first["step"]]}
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
        shutil.rmtree(root, ignore_errors=True)


def failover_s(rows: list[dict], clean_step_s: float) -> tuple[float, list[int]]:
    """(the failover time, the steps that did not commit), from the first step that did not commit
    or ran with fewer replicas through the first committed step with fewer (one row: a survivor's,
    or a re-paired one)."""
    first = next(i for i, r in enumerate(rows) if not r["committed"] or r["participants"] < 2)
    last = next(i for i in range(first, len(rows)) if rows[i]["committed"] and rows[i]["participants"] < 2)
    lost = [r["step"] for r in rows[first:last + 1] if not r["committed"]]
    return sum(r["step_wall_s"] for r in rows[first:last + 1]) - clean_step_s, lost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--fail-after", type=int, default=5)
    args = parser.parse_args()
    fixed = run(args.steps, False, None, 0)
    clean = run(args.steps, True, None, 0)
    killed = run(args.steps, True, signal.SIGKILL, args.fail_after)
    stopped = run(args.steps, True, signal.SIGSTOP, args.fail_after)
    repaired = run(args.steps, True, signal.SIGKILL, args.fail_after, victims=("r0s1", "r1s0"))
    joined = join_run(args.fail_after)
    step = {name: statistics.median(r["step_wall_s"] for r in rows[1:])
            for name, rows in [("fixed", fixed), ("elastic", clean)]}
    quorum = statistics.median(r["quorum_s"] for r in clean[1:])
    kill_s, kill_lost = failover_s(killed, step["elastic"])
    stop_s, stop_lost = failover_s(stopped, step["elastic"])
    repair_s, repair_lost = failover_s(repaired, step["elastic"])
    table = [
        {"run": "fixed membership (DistDriver)", "step_s": step["fixed"], "quorum_s": "—",
         "failover_s": "—", "lost": "—"},
        {"run": "elastic, nobody fails", "step_s": step["elastic"], "quorum_s": quorum,
         "failover_s": "—", "lost": "—"},
        {"run": f"elastic, r1s1 SIGKILLed after step {args.fail_after}",
         "step_s": statistics.median(r["step_wall_s"] for r in killed[1:]), "quorum_s": "—",
         "failover_s": kill_s, "lost": str(kill_lost)},
        {"run": f"elastic, r1s1 SIGSTOPped after step {args.fail_after}",
         "step_s": statistics.median(r["step_wall_s"] for r in stopped[1:]), "quorum_s": "—",
         "failover_s": stop_s, "lost": str(stop_lost)},
        {"run": f"elastic, r0s1 and r1s0 SIGKILLed after step {args.fail_after} (r0s0 + r1s1 re-paired)",
         "step_s": statistics.median(r["step_wall_s"] for r in repaired[1:]), "quorum_s": "—",
         "failover_s": repair_s, "lost": str(repair_lost)},
    ]
    markdown = markdown_table(table, [("run", "run", ""), ("step_s", "median s/step", ".3f"),
                                      ("quorum_s", "median quorum s/step", ".4f"),
                                      ("failover_s", "failover s", ".2f"), ("lost", "steps lost", "")])
    overhead = step["elastic"] - step["fixed"]
    after = joined["after"]
    markdown += (f"\n\n**Join** (r1s1 killed; r1s0 stays, spectating from step {joined['spectated_from']}; "
                 f"one `--join`): the joiner healed in {joined['heal_s']:.1f} s "
                 f"(step {joined['heal_step']}); "
                 f"**join-to-first-contribution {joined['contribution_s']:.1f} s** (row 1 trains from "
                 f"step {joined['contribution_step']}); the {len(after)} steps after it: rows "
                 f"{sorted({tuple(r['rows']) for r in after})}, all committed: "
                 f"{all(r['committed'] for r in after)}, median "
                 f"{statistics.median(r['step_wall_s'] for r in after):.3f} s/step.")
    markdown += (f"\n\nDemo model, P=2 × D=2, 100 Mbit/s, 20 ms, {args.steps} steps, dist.dead_after_s=2, "
                 f"dist.timeout_s=10, load average {os.getloadavg()[0]:.1f}. Elastic overhead per step: "
                 f"{overhead:+.3f} s ({overhead / step['fixed'] * 100:+.1f}%).")
    write_results("elastic", {"args": vars(args), "median_step_s": step, "median_quorum_s": quorum,
                              "failover_kill_s": kill_s, "lost_kill": kill_lost,
                              "failover_stop_s": stop_s, "lost_stop": stop_lost,
                              "failover_repair_s": repair_s, "lost_repair": repair_lost,
                              "join": {k: v for k, v in joined.items() if k != "after"},
                              "records": {"fixed": fixed, "elastic": clean, "kill": killed,
                                          "stop": stopped, "repair": repaired,
                                          "join_after": joined["after"]}}, markdown)


if __name__ == "__main__":
    main()
