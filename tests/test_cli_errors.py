"""Common mistakes end in one line naming the file, field or value and what is allowed, exit code
2, and no run folder left behind — never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import tiny_args

from meshlearn.entry.cli import main

SRC = Path(__file__).parents[1] / "src"


def one_line_error(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("meshlearn: error: ")]
    assert code == 2 and len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.toml").write_text("[train\nsteps = 3\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("just a few words")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 20)
    return tmp_path


@pytest.mark.parametrize("sets,needles", [
    (["train.lr=inf"], ["train.lr = inf", "finite"]),
    (["train.lr=nan"], ["train.lr = nan", "finite"]),
    (["mesh.stagez=2"], ["mesh.stagez", "did you mean mesh.stages?"]),
    (["optim.lr=1e-3"], ["optim.lr", "did you mean train.lr or "]),  # the same name in another section
    (["data.corpus={d}/empty.txt"], ["data.corpus", "empty.txt", "empty"]),
    (["data.corpus={d}/short.txt"], ["model.seq_len = 16", "needs at least 17 tokens"]),
    (["data.corpus={d}/odd.bin"], ["data.corpus", "odd.bin", "3 bytes", "must be even"]),
    (["data.corpus={d}/binary.txt"], ["data.corpus", "binary.txt", "looks binary", "% of its first"]),
    (["verify.name=sentinel", "verify.warmup_steps=4"], ["verify.warmup_steps = 4",
                                                         "must be < train.steps = 4"]),
])
def test_bad_input_is_one_line_and_leaves_no_run_folder(capsys, tiny_corpus, files, sets, needles):
    run = files / "run"
    argv = ["train", *tiny_args(tiny_corpus), *(x for s in sets for x in ("--set", s.format(d=files))),
            "--out", str(run)]
    one_line_error(capsys, argv, *needles)
    assert not run.exists()


def test_unlimited_bandwidth_is_still_allowed():
    from meshlearn.config import load_config

    assert load_config(None, ["link.bandwidth_mbit=inf"]).link.bandwidth_mbit == float("inf")


def test_unknown_keys_get_a_suggestion_not_every_key(capsys):
    line = one_line_error(capsys, ["train", "--set", "train.stpes=1"], "did you mean train.steps")
    assert len(line) < 200
    line = one_line_error(capsys, ["train", "--set", "mesh.zzz=1"], "keys of mesh: mesh.stages")
    assert "train.steps" not in line and "meshlearn config" in line


def test_malformed_toml_names_the_file_line_and_column(files):
    # a subprocess: the message a user sees is the point
    result = subprocess.run([sys.executable, "-m", "meshlearn", "train", "--config",
                             str(files / "bad.toml"), "--out", str(files / "run")],
                            capture_output=True, text=True, timeout=60, cwd=files,
                            env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"meshlearn: error: --config = '{files / 'bad.toml'}': not valid "
                                     "TOML: Expected ']' at the end of a table declaration (at line 1, "
                                     "column 7)")
    assert not (files / "run").exists() and not (files / "runs").exists()


@pytest.fixture(scope="module")
def trained(tiny_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", *tiny_args(tiny_corpus), "--set", "train.checkpoint_every=2",
                 "--out", str(run)]) == 0  # checkpoints of steps 2 and 4
    return run


@pytest.mark.parametrize("args,needles", [
    (["--tokens", "-5"], ["--tokens = -5", ">= 1"]),
    (["--temperature", "-1"], ["--temperature = -1.0", "> 0"]),
])
def test_bad_sample_options(capsys, trained, args, needles):
    one_line_error(capsys, ["sample", str(trained), *args], *needles)


def test_a_changed_model_shape_on_resume_is_refused_naming_the_key(capsys, trained):
    one_line_error(capsys, ["train", "--resume", str(trained), "--set", "model.d_model=64"],
                   "model.d_model = 64", "cannot change on --resume", "model.d_model = 32")


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_checkpoint_in_resume_and_sample(capsys, trained, tmp_path, damage):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(trained, run)
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        if damage == "truncated":
            (run / name).write_bytes((run / name).read_bytes()[:1000])
        else:
            (run / name).unlink(missing_ok=True)
            torch.save({"state_dict": {}}, run / name)
    (run / "checkpoint.json").unlink()  # foreign: no manifest either
    needle = "truncated" if damage == "truncated" else "a torch.save zip (a pickle"
    one_line_error(capsys, ["train", "--resume", str(run)], str(run), needle)
    one_line_error(capsys, ["sample", str(run)], needle)


def test_a_truncated_newest_checkpoint_resumes_from_the_previous(capsys, trained, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(trained, run)
    (run / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes()[:1000])
    assert main(["train", "--resume", str(run), "--set", "train.steps=5"]) == 0
    captured = capsys.readouterr()
    assert "falling back" in captured.err or "resuming from the previous checkpoint" in captured.err
    assert "resuming" in captured.out and "from step 2" in captured.out


def test_a_changed_key_that_breaks_another_check_on_resume_is_refused_as_a_resume_change(capsys, trained):
    """model.n_layer = 3 would fail 'mesh.stages must divide model.n_layer' first: the resume rule
    is what the user needs to hear."""
    one_line_error(capsys, ["train", "--resume", str(trained), "--set", "model.n_layer=3"],
                   "model.n_layer = 3", "cannot change on --resume", "model.n_layer = ")
