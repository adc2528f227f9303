"""Every way a run ends prints one closing line with what the run has, and its exit code."""

import json
from pathlib import Path

import pytest
from test_cli import tiny_args

from meshlearn.entry.cli import main
from meshlearn.train.closing import closing

RUN = Path("runs/x")


def summary(steps: int, val: float | None) -> dict:
    return {"steps": steps, "final_val_loss": val}


def test_a_finished_run_says_done_with_its_validation_loss():
    end = closing(summary(10, 2.5), 10, 0, None, 0, RUN, "9 tok/s wall")
    assert (end.line, end.code) == ("done: 10 steps, val loss 2.5000, 9 tok/s wall → runs/x", 0)


def test_a_run_stopped_by_stop_at_step_before_any_evaluation_says_so_and_how_to_go_on():
    end = closing(summary(4, None), 10, 4, None, 0, RUN, "9 tok/s wall")
    assert end.code == 0
    assert end.line == ("stopped at step 4 of 10 (train.stop_at_step = 4) with a checkpoint, no validation "
                        "yet, 9 tok/s wall → runs/x; continue with: meshlearn train --resume runs/x")


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_exits_128_plus_n_even_when_it_came_as_the_run_finished(name, code):
    stopped = closing(summary(4, None), 10, 0, name, code, RUN, "9 tok/s wall")
    assert stopped.code == code
    assert stopped.line == (f"meshlearn: stopped by {name} after step 4 of 10 with a checkpoint "
                            "(no validation yet); continue with: meshlearn train --resume runs/x")
    late = closing(summary(10, 2.5), 10, 0, name, code, RUN, "9 tok/s wall")
    assert late.code == code and late.line.startswith("done: 10 steps, val loss 2.5000")
    assert f"({name} came as the run finished: nothing was left to stop)" in late.line


def train_losses(run: Path) -> list[float]:
    return [r["train_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def test_a_sim_run_stopped_before_its_first_evaluation_resumes_to_the_end(capsys, tiny_corpus, tmp_path):
    """Issue 33 in the simulator: the closing line had no validation loss to format."""
    args = [*tiny_args(tiny_corpus), "--set", "train.steps=6", "--set", "train.eval_every=5"]
    run = tmp_path / "run"
    assert main(["train", *args, "--set", "train.stop_at_step=3", "--out", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("stopped at step 3 of 6 (train.stop_at_step = 3) with a checkpoint, "
                          "no validation yet")
    assert out.endswith(f"continue with: meshlearn train --resume {run}")
    assert main(["train", "--resume", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("done: 6 steps, val loss ")
    straight = tmp_path / "straight"
    assert main(["train", *args, "--out", str(straight)]) == 0
    assert train_losses(run) == pytest.approx(train_losses(straight), abs=1e-6)
    assert (json.loads((run / "summary.json").read_text())["final_val_loss"]
            == pytest.approx(json.loads((straight / "summary.json").read_text())["final_val_loss"], abs=1e-6))


def test_a_cluster_run_says_to_resume_on_every_machine_with_its_own_host():
    """A [cluster] run resumes with one command per machine, each naming itself (docs/cluster.md)."""
    end = closing(summary(4, None), 10, 4, None, 0, RUN, "9 tok/s wall", cluster=True)
    assert end.line.endswith(
        "continue on every machine with: meshlearn train --resume runs/x --host NAME --key FILE")
    signalled = closing(summary(4, None), 10, 0, "SIGTERM", 143, RUN, "9 tok/s wall", cluster=True)
    assert signalled.line.endswith("--resume runs/x --host NAME --key FILE")

