"""The peer vote's speculation in a real elastic run (``elastic/peer_vote.py``): P = 2 × D = 2
under ``elastic.membership = "control"``, r1s1's first vote round of step 4 lost (injected:
``vote_fault_site``). Lost after its verdict went out, the other three apply step 4 at once, find
"no commit" on the store during step 5 and roll it back; lost before, nobody applies it. Both runs
must be the same run: step 4 (and step 5, which keeps the rows and commits nowhere) not
committed, every committed loss and the final checkpoint identical bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import FAST, kill_leftovers, records  # noqa: E402

from meshlearn.config import save_config  # noqa: E402
from meshlearn.statefile import load_state  # noqa: E402

SITE = Path(__file__).parent / "vote_fault_site"
SRC = Path(__file__).resolve().parents[2] / "src"
STEPS = 8


def _run(cfg, tmp_path: Path, when: str) -> Path:
    run = tmp_path / when
    config = tmp_path / f"{when}.toml"
    save_config(cfg, config)
    sets = [x for o in [*FAST, "backend=dist"] for x in ("--set", o)]
    try:
        done = subprocess.run([sys.executable, "-m", "meshlearn", "train", "--config", str(config),
                               "--out", str(run), *sets], capture_output=True, text=True, timeout=240,
                              env=os.environ | {"PYTHONPATH": f"{SITE}:{SRC}", "OMP_NUM_THREADS": "1",
                                                "VOTE_FAULT": f"r1s1:3:{when}"})
    finally:
        kill_leftovers(run)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run


def _rolled_back(run: Path) -> list[str]:
    return sorted(w for w in ("r0s0", "r0s1", "r1s0", "r1s1")
                  if "rolled back a step's update" in (run / "logs" / f"{w}.log").read_text())


@pytest.mark.slow
def test_a_step_applied_at_its_first_round_is_rolled_back_everywhere_when_the_store_says_no(tiny_corpus,
                                                                                            tmp_path):
    cfg = tiny_config(tiny_corpus, "backend=dist", "mesh.stages=2", "mesh.replicas=2", f"train.steps={STEPS}",
                      "elastic.enabled=true", "elastic.membership=control", "dist.timeout_s=5",
                      "dist.dead_after_s=2", f"train.eval_every={STEPS}")
    speculated, never = _run(cfg, tmp_path, "after"), _run(cfg, tmp_path, "before")
    assert _rolled_back(speculated) == ["r0s0", "r0s1", "r1s0"] and _rolled_back(never) == []
    a, b = records(speculated), records(never)
    for rows in (a, b):
        assert [r["committed"] for r in rows] == [True] * 3 + [False, False] + [True] * (STEPS - 5)
        assert [r["batch"] for r in rows if r["committed"]] == list(range(STEPS - 2))
        assert [r["vote_rows_requests"] for r in rows[1:3]] == [0, 0]  # steady: speculative, no store
    assert [r["train_loss"] for r in a if r["committed"]] == [r["train_loss"] for r in b if r["committed"]]
    evals = [[r["val_loss"] for r in records(run, "eval")] for run in (speculated, never)]
    assert evals[0] == evals[1]
    final = f"checkpoints/step-{STEPS:06d}"
    for w in ("r0s0", "r0s1", "r1s0", "r1s1"):
        x, y = (load_state(run / final / f"{w}.pt")["workers"][w] for run in (speculated, never))
        for key, tensor in x["module"].items():
            assert torch.equal(tensor, y["module"][key]), (w, key)
        for (pa, sa), (pb, sb) in zip(x["optimizer"]["state"].items(), y["optimizer"]["state"].items(),
                                      strict=True):
            assert pa == pb and all(torch.equal(sa[k], sb[k]) for k in sa), (w, pa)
