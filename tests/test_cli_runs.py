"""`meshlearn train` and run folders: refuse, overwrite, lock, default --out, resume history."""

import json
import os

from test_cli import tiny_args

from meshlearn.cli import main
from meshlearn.train.rundir import RunLock


def test_a_fresh_train_refuses_an_existing_run_until_overwrite(capsys, tiny_corpus, tmp_path):
    run = tmp_path / "run"
    assert main(["train", *tiny_args(tiny_corpus), "--out", str(run)]) == 0
    before = (run / "summary.json").read_text()
    assert main(["train", *tiny_args(tiny_corpus), "--set", "seed=7", "--out", str(run)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run / "summary.json").read_text() == before  # untouched
    (run / "stray.txt").write_text("from the old run")
    assert main(["train", *tiny_args(tiny_corpus), "--set", "seed=7", "--out", str(run),
                 "--overwrite"]) == 0
    assert not (run / "stray.txt").exists()  # cleared first: nothing of the old run mixes in
    assert json.loads((run / "run.json").read_text())["kind"] == "start"


def test_a_second_training_on_a_locked_run_is_refused(capsys, tiny_corpus, tmp_path):
    run = tmp_path / "run"
    with RunLock(run, command="meshlearn train (the first)"):
        assert main(["train", *tiny_args(tiny_corpus), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"is in use by pid {os.getpid()}" in err and "the first" in err
    assert not (run / "config.toml").exists()


def test_the_default_out_is_a_new_folder_per_run(capsys, tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *tiny_args(tiny_corpus), "--set", "name=tiny"]) == 0
    assert main(["train", *tiny_args(tiny_corpus), "--set", "name=tiny"]) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("tiny-") for r in runs)
    assert all((r / "summary.json").is_file() for r in runs)


def test_resume_says_where_it_resumes_and_keeps_the_history(capsys, tiny_corpus, tmp_path):
    run = tmp_path / "run"
    assert main(["train", *tiny_args(tiny_corpus), "--set", "train.stop_at_step=2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "codec.name=bf16"]) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} from step 2 (to step 4); changed: codec.name 'identity' → 'bf16'" in out
    history = json.loads((run / "run.json").read_text())["history"]
    assert [(h["kind"], h["step"], h["changed"]) for h in history] == [
        ("start", 0, {}), ("resume", 2, {"codec.name": ["identity", "bf16"]})]
    assert history[0]["argv"] and history[0]["commit"] == history[1]["commit"]  # the first start kept
    assert main(["train", "--resume", str(run)]) == 0
    assert "nothing to train" in capsys.readouterr().out
