"""A DP strategy is a plug-in: ``every_other_dp.py`` ("average every other step"), declared under the
entry point group ``meshlearn.dp_strategies`` by a package metadata folder the test writes (as
``pip install`` of a third party's package would), runs under the simulator, dist and elastic with
no edit to meshlearn. Its oracle: the built-in sparse averaging set to average whole weights every
second update, waited for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_config

from meshlearn.dp import strategies
from meshlearn.dp.registry import BUILDERS, builder_of
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_helpers import deadline, kill_leftovers, launch, launch_fixed_and_elastic, records  # noqa: E402

HERE = Path(__file__).resolve().parent
PLUGIN = ["dp.name=every_other"]
ORACLE = ["dp.name=sparse", "dp.fraction=1", "dp.every=2", "dp.delay=0", "dp.rule=avg"]
MESH = ["mesh.stages=2", "mesh.replicas=2", "train.steps=6"]


@pytest.fixture
def installed(tmp_path_factory, monkeypatch):
    """``every_other`` installed: a package's metadata with the entry point on sys.path (worker
    processes inherit the parent's sys.path), and the module importable."""
    site = tmp_path_factory.mktemp("site")
    info = site / "every_other_dp-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: every-other-dp\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{strategies.GROUP}]\nevery_other = every_other_dp:build\n")
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.syspath_prepend(str(site))
    return site


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def test_without_the_entry_point_the_name_is_refused_in_one_line(tiny_corpus):
    assert "every_other" not in strategies.names()
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *PLUGIN)
    assert err.value.key == "dp.name" and strategies.GROUP in str(err.value)


def test_a_plugin_that_does_not_load_is_named_in_one_line(tiny_corpus, installed):
    (installed / "every_other_dp-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{strategies.GROUP}]\nevery_other = no_such_module_here:build\n")
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *PLUGIN)
    assert "no_such_module_here:build does not load: ModuleNotFoundError" in str(err.value)


def test_a_plugin_cannot_take_a_built_in_name(installed):
    (installed / "every_other_dp-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{strategies.GROUP}]\nevery_other = every_other_dp:build\nsparse = every_other_dp:build\n")
    assert strategies.names() == (*strategies.BUILT_IN, "every_other")
    assert builder_of("sparse") is BUILDERS["sparse"] and builder_of("every_other").__name__ == "build"


def test_the_plugin_under_sim_equals_its_oracle_and_averages_every_other_step(tiny_corpus, tmp_path,
                                                                              installed):
    assert "every_other" in strategies.names()
    runs = {}
    for name, sets in [("plugin", PLUGIN), ("oracle", ORACLE), ("allreduce", [])]:
        trainer = Trainer(tiny_config(tiny_corpus, *MESH, *sets), tmp_path / name, progress=False)
        runs[name] = (trainer, trainer.train())
    (plugin, summary), (oracle, _) = runs["plugin"], runs["oracle"]
    assert type(plugin.workers[WorkerId(0, 0)].dp).__name__ == "EveryOther"
    losses = {name: [r["train_loss"] for r in records(tmp_path / name)] for name in runs}
    assert losses["plugin"] == losses["oracle"]  # bit for bit: the same means of the same weights
    assert losses["plugin"] != losses["allreduce"]  # and it is not the all-reduce
    assert summary["dp_rounds"] == 4 * 3 and summary["dp_dropped_rounds"] == 0  # 4 workers × u = 1, 3, 5
    for s in range(2):  # 6 updates: the last one (u = 5) averaged, so the replicas agree
        a, b = (_flat(plugin.workers[WorkerId(r, s)].module) for r in range(2))
        assert torch.equal(a, b) and torch.equal(a, _flat(oracle.workers[WorkerId(0, s)].module))


@pytest.mark.slow
def test_the_plugin_under_dist_equals_the_simulator(tiny_corpus, tmp_path, installed):
    cfg = tiny_config(tiny_corpus, *MESH, *PLUGIN)
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    try:
        with deadline(90, "the every_other dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, list((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    sa = json.loads((tmp_path / "sim" / "summary.json").read_text())
    sb = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert sa["dp_rounds"] == sb["dp_rounds"] == 12 and sb["dp_dropped_rounds"] == 0


@pytest.mark.slow
def test_the_plugin_under_elastic_equals_the_fixed_dist_driver(tiny_corpus, tmp_path, installed):
    """Fixed membership; one stage (the elastic driver clips per stage, the fixed one per row)."""
    cfg = tiny_config(tiny_corpus, "backend=dist", "mesh.replicas=2", "train.steps=6", "dist.timeout_s=5",
                      "dist.dead_after_s=2", *PLUGIN)
    runs = launch_fixed_and_elastic(cfg, tmp_path, 120, "the every_other runs")
    a, b = records(runs["fixed"]), records(runs["elastic"])
    assert [r["step"] for r in b] == list(range(1, 7)) and all(r["committed"] for r in b)
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    summary = json.loads((runs["elastic"] / "summary.json").read_text())
    assert summary["dp_rounds"] == 3 and summary["dp_dropped_rounds"] == 0  # u = 1, 3, 5 on one worker
