"""The planner is the simulator: cost-only runs equal real SimDriver runs on the virtual clock, and
its long-run extrapolation equals simulating the whole run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.mask import MaskCodec
from meshlearn.config import load_config
from meshlearn.entry.cli import main
from meshlearn.plan.cost import simulate
from meshlearn.plan.mask import mask_wire_values
from meshlearn.plan.methods import given_label, replace
from meshlearn.plan.steady import horizon, predict, segment_lengths
from meshlearn.train import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the shipped configs, from any cwd
DEMO = str(CONFIGS / "demo.toml")

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
    ["dp.name=diloco", "dp.inner_steps=2", "dp.compress=powersgd"],
    ["mesh.schedule=gpipe", "codec.name=int8"],
    ["links.access=uplink"],
    ["mesh.schedule=async", "dp.name=powersgd", "links.access=uplink"],
    ["codec.backward.name=mask"],  # the gradients' own codec: the cost stand-in needs no context
    ["codec.name=int8", "codec.backward.name=mask", "codec.backward.keep=0.05"],
], ids=lambda e: "+".join(e) or "demo")
def test_cost_only_equals_real_simulator(tmp_path, extra):
    cfg = load_config(DEMO, [*SHORT, *extra])
    trainer, summary = _real(cfg, tmp_path)
    _, window = simulate(trainer.cfg, trainer.cfg.train.steps)
    assert window.tokens_per_s == pytest.approx(summary["sim_tokens_per_s"], rel=1e-6)
    assert window.bytes_pp / window.tokens == pytest.approx(summary["bytes_per_token_pp"], rel=1e-9)
    assert window.bytes_dp / window.tokens == pytest.approx(summary["bytes_per_token_dp"], rel=1e-9)
    assert window.idle_fraction == pytest.approx(summary["idle_fraction"], rel=1e-6)


def test_subspace_codec_bytes_equal(tmp_path):
    cfg = load_config(str(CONFIGS / "subspace.toml"), [*SHORT, "mesh.schedule=async"])
    trainer, summary = _real(cfg, tmp_path)
    run, window = simulate(trainer.cfg, trainer.cfg.train.steps)
    assert window.tokens_per_s == pytest.approx(summary["sim_tokens_per_s"], rel=1e-6)
    assert window.bytes_pp / window.tokens == summary["bytes_per_token_pp"]
    assert max(w.stash_bytes for w in run.workers.values()) == summary["stash_bytes_peak"]


@pytest.mark.parametrize("extra", [
    ["mesh.schedule=1f1b"],
    ["mesh.schedule=async", "link.bandwidth_mbit=20"],
    ["mesh.schedule=async", "dp.name=sparse", "dp.delay=2"],
    ["mesh.schedule=gpipe", "dp.name=diloco", "dp.inner_steps=3"],
], ids=lambda e: "+".join(e))
def test_extrapolation_equals_the_whole_run(extra):
    """predict() simulates a few steps; simulating all 36 (drain points every 12) agrees to 1%."""
    cfg = load_config(DEMO, ["model.vocab_size=256", "train.steps=36", "train.eval_every=12",
                                            "train.checkpoint_every=0", *extra])
    assert horizon(cfg).steps < 36
    prediction = predict(cfg)
    _, whole = simulate(cfg, 36)
    assert not prediction.whole_run and prediction.steps_simulated < 36
    assert prediction.tokens_per_s == pytest.approx(whole.tokens_per_s, rel=0.01)


def test_the_given_row_names_the_gradients_own_codec():
    plain = load_config(DEMO, ["codec.name=int8"])
    masked = load_config(DEMO, ["codec.name=int8", "codec.backward.name=mask", "codec.backward.keep=0.05"])
    assert given_label(plain) == "as given: dense int8 · 1f1b · allreduce"
    assert given_label(masked) == "as given: dense int8 / backward mask keep=0.05 · 1f1b · allreduce"


def test_segments_and_horizon():
    cfg = load_config(DEMO, ["train.steps=250", "train.eval_every=50",
                                            "train.checkpoint_every=100"])
    assert segment_lengths(cfg) == {50: 5}
    sparse = replace(cfg, dp={"name": "sparse", "delay": 10, "every": 1}, mesh={"schedule": "async"})
    h = horizon(sparse)
    assert h.warm > 10 // 4 and h.window >= 2 and h.tail >= 1  # 4 updates per async step
    diloco = replace(cfg, dp={"name": "diloco", "inner_steps": 10})
    assert horizon(diloco).window == 10  # a whole DiLoCo period under a flushing schedule


def test_mask_wire_values():
    assert mask_wire_values(0.05, 2048) == 102 and mask_wire_values(1.0, 7) == 7
    # the planner's count is the real codec's: its payload holds exactly that many values per token
    codec = MaskCodec(d_model=576, keep=0.05)
    x = torch.randn(2, 8, 576)
    payload = codec.encode(x, "act", None, MessageContext(step=3, microbatch=1, boundary=0))
    assert payload.tensors["values"].numel() == 2 * 8 * mask_wire_values(0.05, 576)
    with pytest.raises(ValueError, match="keep"):
        mask_wire_values(0.0, 64)


def test_cli_json_tokens_per_s_is_the_demo_run(tmp_path, capsys, monkeypatch):
    cfg = load_config(DEMO, SHORT)
    _, summary = _real(cfg, tmp_path / "run")
    sets = [x for s in SHORT for x in ("--set", s)]
    code = main(["plan", "--config", DEMO, *sets, "--json", "--sweep", "100",
                 "--plot", str(tmp_path / "plan.png")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_s"] == pytest.approx(summary["sim_tokens_per_s"], rel=1e-6)
    assert out["given"]["tokens_per_s"] == out["tokens_per_s"]
    labels = [r["method"] for r in out["methods"]]
    assert any("subspace" in x for x in labels) and any("async" in x for x in labels)
    mask = next(r for r in out["methods"] if r["method"].startswith("mask keep=0.05"))
    # round(0.05 · 128) = 6 bf16 values per token, both directions, 3 boundaries
    assert mask["bytes_per_token_pp"] == pytest.approx(6 * 2 * 2 * 3)
    parts = {"compute", "PP link", "DP link", "latency", "update", "other"}
    assert set(out["given"]["critical_path"]) == parts
    assert out["binds_from"] == "path" and out["given"]["gain_if_doubled"] == {}
    assert (tmp_path / "plan.png").stat().st_size > 0
    # the reference way: every resource doubled in a simulation of its own, the same binds
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["plan", "--config", DEMO, *sets, "--json", "--binds", "doubling"]) == 0
    doubled = json.loads(capsys.readouterr().out)
    assert doubled["sweep"]["bandwidth_mbit"] == []  # no plot unless asked: no sweep simulated
    assert list((tmp_path / "cwd").iterdir()) == []  # and no file written where it ran
    assert set(doubled["given"]["gain_if_doubled"]) == {"compute", "PP link", "DP link", "latency"}
    assert [r["binds"] for r in doubled["methods"]] == [r["binds"] for r in out["methods"]]
    assert [r["tokens_per_s"] for r in doubled["methods"]] == [r["tokens_per_s"] for r in out["methods"]]


def test_presets_fit_check_and_table(capsys):
    code = main(["plan", "--model", "smollm2-135m", "--set", "mesh.stages=2", "--set", "mesh.replicas=1",
                 "--sweep", "100", "--plot", "none"])
    assert code == 0
    text = capsys.readouterr().out
    assert "30 layers, d 576, heads 9/3, ffn 1536, vocab 49152" in text and "tokens/s" in text
    assert "ties its embeddings" in text


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-70b"], "--model = 'llama-70b'"),
    (["--set", "mesh.stages=3"], "mesh.stages = 3"),
    (["--mask-keep", "0"], "--mask-keep = '0'"),
    (["--sweep", "x"], "--sweep = 'x'"),
    (["--set", "sim.compute=measured"], "device model"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    assert main(["plan", "--plot", "none", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err


@pytest.mark.parametrize("steps, extra", [
    (10, []),
    (16, ["mesh.schedule=async", "dp.name=sparse", "dp.delay=2"]),
], ids=["1f1b", "async+sparse"])
def test_planner_predicts_a_real_simulated_run(tmp_path, steps, extra):
    """The planner's extrapolation from a few cost-only steps against a real simulated run (real
    forward/backward, the trainer's drain points) longer than what the planner simulates."""
    cfg = load_config(DEMO, [f"train.steps={steps}", f"train.eval_every={steps // 2}",
                                            "train.eval_batches=1", "train.checkpoint_every=0", *extra])
    trainer, summary = _real(cfg, tmp_path)
    prediction = predict(trainer.cfg)
    assert prediction.steps_simulated < steps
    assert prediction.tokens_per_s == pytest.approx(summary["sim_tokens_per_s"], rel=0.05)
