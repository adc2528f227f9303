"""The planner is the simulator: cost-only runs equal real SimDriver runs on the virtual clock."""

from __future__ import annotations

import json

import pytest

from meshlearn.cli import main
from meshlearn.config import load_config
from meshlearn.plan.cost import simulate
from meshlearn.train import Trainer

SHORT = ["train.steps=4", "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=0"]


def _real(cfg, tmp_path):
    trainer = Trainer(cfg, tmp_path, progress=False)
    return trainer, trainer.train()


@pytest.mark.parametrize("extra", [
    [],
    ["mesh.schedule=async"],
    ["mesh.schedule=async", "dp.name=sparse"],
    ["dp.name=powersgd"],
    ["dp.name=diloco", "dp.inner_steps=2"],
    ["mesh.schedule=gpipe", "codec.name=int8"],
], ids=lambda e: "+".join(e) or "demo")
def test_cost_only_equals_real_simulator(tmp_path, extra):
    cfg = load_config("configs/demo.toml", [*SHORT, *extra])
    trainer, summary = _real(cfg, tmp_path)
    result = simulate(trainer.cfg, trainer.cfg.train.steps)
    assert result.tokens_per_s == pytest.approx(summary["sim_tokens_per_s"], rel=1e-6)
    assert result.bytes_per_token_pp == pytest.approx(summary["bytes_per_token_pp"], rel=1e-9)
    assert result.bytes_per_token_dp == pytest.approx(summary["bytes_per_token_dp"], rel=1e-9)
    assert result.bubble_fraction == pytest.approx(summary["bubble_fraction"], rel=1e-6)


def test_subspace_codec_bytes_equal(tmp_path):
    cfg = load_config("configs/subspace.toml", [*SHORT, "mesh.schedule=async"])
    trainer, summary = _real(cfg, tmp_path)
    result = simulate(trainer.cfg, trainer.cfg.train.steps)
    assert result.tokens_per_s == pytest.approx(summary["sim_tokens_per_s"], rel=1e-6)
    assert result.bytes_per_token_pp == summary["bytes_per_token_pp"]
    assert result.memory.stash <= summary["stash_bytes_peak"]


def test_cli_json_tokens_per_s_is_the_demo_run(tmp_path, capsys):
    cfg = load_config("configs/demo.toml", SHORT)
    _, summary = _real(cfg, tmp_path / "run")
    sets = [x for s in SHORT for x in ("--set", s)]
    code = main(["plan", "--config", "configs/demo.toml", *sets, "--json", "--sweep-steps", "1",
                 "--plot", str(tmp_path / "plan.png")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_s"] == pytest.approx(summary["sim_tokens_per_s"], rel=1e-6)
    assert out["given"]["tokens_per_s"] == out["tokens_per_s"]
    labels = [r["method"] for r in out["methods"]]
    assert any("subspace" in x for x in labels) and any("async" in x for x in labels)
    assert any("mask" in n for n in out["notes"])
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_presets_fit_check_and_table(tmp_path, capsys):
    code = main(["plan", "--model", "smollm2-135m", "--set", "mesh.stages=2", "--set", "mesh.replicas=1",
                 "--steps", "2", "--sweep-steps", "1", "--plot", "none"])
    assert code == 0
    text = capsys.readouterr().out
    assert "30 layers, d 576, heads 9/3, vocab 49152" in text and "tokens/s" in text


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-70b"], "--model = 'llama-70b'"),
    (["--set", "mesh.stages=3"], "mesh.stages = 3"),
    (["--steps", "0"], "--steps = 0"),
    (["--set", "sim.compute=measured"], "device model"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    assert main(["plan", "--plot", "none", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err
