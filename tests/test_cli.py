"""The command line end to end: train → report → sample, and clean errors for bad input."""

import json
import subprocess
import sys

from meshlearn.entry.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "meshlearn", *args], capture_output=True,
                          text=True, timeout=120)


def tiny_args(corpus):
    return ["--set", f"data.corpus={corpus}", "--set", "model.n_layer=2", "--set",
            "model.d_model=32", "--set", "model.n_head=2", "--set", "model.seq_len=16",
            "--set", "mesh.stages=2", "--set", "mesh.replicas=1", "--set", "mesh.microbatches=2",
            "--set", "train.batch_size=4", "--set", "train.steps=4", "--set",
            "train.eval_every=2", "--set", "train.eval_batches=1"]


def test_train_report_sample(tiny_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *tiny_args(tiny_corpus), "--out", str(run)]) == 0
    opening = capsys.readouterr().out.splitlines()[0]  # said before the first step
    assert opening.startswith("meshlearn: 2 stages × 1 replicas (1f1b), 0.") and opening.endswith(f"→ {run}")
    assert "steps 1–4 of 4 × 4 × 16" in opening
    summary = json.loads((run / "summary.json").read_text())
    for key in ("final_val_loss", "sim_time_s", "wall_time_s", "sim_tokens_per_s",
                "wall_tokens_per_s", "bytes_per_token_pp", "bytes_per_token_dp",
                "idle_fraction"):
        assert summary[key] is not None, key
    assert summary["bytes_per_token_pp"] > 0 and summary["bytes_per_token_dp"] == 0
    assert (run / "config.toml").is_file() and (run / "checkpoint.pt").is_file()

    assert main(["report", str(run)]) == 0
    assert (run / "report" / "index.html").is_file()
    assert (run / "report" / "loss_vs_step.png").stat().st_size > 0

    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "the king", "--tokens", "20"]) == 0
    said = capsys.readouterr()
    assert said.out.strip().splitlines()[-1].startswith("the king")
    assert f"sampling {run} at its checkpoint of step 4 of 4" in said.err


def test_bad_set_key_exits_with_a_clear_message():
    result = run_cli("train", "--set", "mesh.stagez=2")
    assert result.returncode == 2
    assert "mesh.stagez" in result.stderr and "mesh.stages" in result.stderr


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("meshlearn ")


def test_version_and_help_answer_without_importing_torch():
    """``--version`` and every ``--help`` import only the argument parser, not the library."""
    probe = ("import sys, contextlib, io\n"
             "from meshlearn.entry.cli import main\n"
             "for argv in (['--version'], ['--help'], ['train', '--help'], ['plan', '--help']):\n"
             "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "        main(argv)\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    seen = "import sys, meshlearn.config; print('torch' in sys.modules)"
    negative = subprocess.run([sys.executable, "-c", seen], capture_output=True, text=True, timeout=120)
    assert negative.stdout.strip() == "True"  # the probe can see torch when it is imported
