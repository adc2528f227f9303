"""Fake run folders for the report tests, shaped like what `meshlearn train` writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

RunFactory = Callable[..., Path]


def fake_records(n_train: int = 20, evals: tuple[int, ...] = (5, 10, 20), base_loss: float = 4.0):
    """~20 train + 3 eval records with cumulative counters, like metrics.jsonl holds."""
    records = []
    for step in range(1, n_train + 1):
        tokens = 4096 * step
        records.append(
            {
                "kind": "train",
                "step": step,
                "train_loss": base_loss - 0.1 * step,
                "lr": 3e-4,
                "tokens": tokens,
                "sim_time_s": 0.5 * step,
                "wall_time_s": 0.25 * step,
                "bytes_pp": 2048 * tokens,
                "bytes_dp": 512 * tokens,
                "step_sim_s": 0.5,
                "step_wall_s": 0.25,
            }
        )
        if step in evals:
            records.append(
                {
                    "kind": "eval",
                    "step": step,
                    "val_loss": base_loss - 0.09 * step,
                    "tokens": tokens,
                    "sim_time_s": 0.5 * step,
                    "wall_time_s": 0.25 * step,
                }
            )
    records.insert(3, {"kind": "event", "what": "worker_joined", "worker": "r1s0"})
    return records


def fake_summary(final_val_loss: float, banned: list | None = None) -> dict:
    summary = {
        "final_val_loss": final_val_loss,
        "final_train_loss": 2.0,
        "steps": 20,
        "tokens": 81920,
        "sim_time_s": 10.0,
        "wall_time_s": 5.0,
        "sim_tokens_per_s": 8192.0,
        "wall_tokens_per_s": 16384.0,
        "bytes_per_token_pp": 2048.0,
        "bytes_per_token_dp": 512.0,
        "idle_fraction": 0.125,
        "compute_model": "device:rtx4090",
        "links": [
            {
                "src": "r0s0",
                "dst": "r0s1",
                "axis": "pp",
                "bytes": 10**8,
                "busy_s": 4.0,
                "utilization": 0.4,
            },
            {
                "src": "r0s0",
                "dst": "r1s0",
                "axis": "dp",
                "bytes": 10**7,
                "busy_s": 1.0,
                "utilization": 0.1,
            },
        ],
    }
    if banned is not None:
        summary["banned_workers"] = banned
    return summary


@pytest.fixture
def make_run(tmp_path: Path) -> RunFactory:
    """Factory: make_run("a", name="alpha", val=2.2, summary=True, banned=None, config="[mesh]...",
    events=[ban records]) -> folder (``config`` is appended to config.toml after [train])."""

    def make(
        folder: str = "run-a",
        *,
        name: str | None = "alpha",
        val: float = 2.2,
        summary: bool = True,
        banned: list | None = None,
        base_loss: float = 4.0,
        config: str = "",
        events: list[dict] = (),
    ) -> Path:
        run = tmp_path / folder
        run.mkdir(parents=True)
        head = f'name = "{name}"\n' if name is not None else ""
        (run / "config.toml").write_text(head + "[train]\nsteps = 20\n" + config)
        lines = [json.dumps(r) for r in [*fake_records(base_loss=base_loss), *events]]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        if summary:
            (run / "summary.json").write_text(json.dumps(fake_summary(val, banned)))
        return run

    return make
