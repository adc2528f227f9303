"""The async learning-rate rule: f_s = 1/√(n·(1 + τ_s)), its config key and its wiring."""

from __future__ import annotations

import math

import pytest
from tiny import tiny_config

from meshlearn.config import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.optim.async_lr import ASYNC_LR_RULES, async_lr_scale
from meshlearn.optim.no_ws import no_ws_stage_hparams
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.train import Trainer


def test_the_default_rule_at_p4_m4_is_one_over_root_n_times_one_plus_tau():
    # 1F1B depths P − s = 4, 3, 2, 1 (staleness 3, 2, 1, 0), n = 4 updates a step.
    got = [async_lr_scale("microbatch_staleness", 4, 1, depth) for depth in (4, 3, 2, 1)]
    assert got == pytest.approx([1 / 4, 1 / math.sqrt(12), 1 / math.sqrt(8), 1 / 2], rel=1e-12)


def test_the_last_stage_gets_only_the_microbatch_term_and_deeper_stages_less():
    for n in (1, 2, 4, 8):
        assert async_lr_scale("microbatch_staleness", n, 1, 1) == pytest.approx(1 / math.sqrt(n))
        assert async_lr_scale("microbatch", n, 1, 9) == pytest.approx(1 / math.sqrt(n))
    by_depth = [async_lr_scale("microbatch_staleness", 4, 1, d) for d in range(1, 17)]
    assert all(a > b for a, b in zip(by_depth, by_depth[1:], strict=False))


def test_whole_batch_updates_without_staleness_keep_train_lr():
    """One update a step on the whole batch with no delay is the flushing schedule's update."""
    for rule in ASYNC_LR_RULES:
        assert async_lr_scale(rule, 4, 4, 1) == 1.0


def test_update_groups_count_staleness_in_updates():
    # update_every = 2 of M = 4: n = 2 updates a step; depth 4 is (4 − 1)/2 = 1.5 updates stale.
    assert async_lr_scale("microbatch_staleness", 4, 2, 4) == pytest.approx(1 / math.sqrt(2 * 2.5))


def test_off_is_one_everywhere():
    assert {async_lr_scale("off", m, 1, d) for m in (1, 4, 8) for d in (1, 5)} == {1.0}


@pytest.mark.parametrize(("args", "match"), [
    (("sqrt", 4, 1, 1), "rule must be one of"),
    (("microbatch", 4, 3, 1), "divisible by update_every"),
    (("microbatch", 4, 1, 0), "depth >= 1"),
])
def test_bad_arguments_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        async_lr_scale(*args)


def test_the_config_key_is_validated_and_async_only(tiny_corpus):
    with pytest.raises(ConfigError, match=r"mesh.async_lr_rule = 'sqrt': allowed: \['microbatch_staleness'"):
        tiny_config(tiny_corpus, "mesh.schedule=async", "mesh.async_lr_rule=sqrt")
    with pytest.raises(ConfigError, match="mesh.async_lr_rule = 'off': only the async schedule uses it"):
        tiny_config(tiny_corpus, "mesh.async_lr_rule=off")


def applied_lrs(trainer: Trainer) -> list[float]:
    return [trainer.workers[WorkerId(0, s)].optimizer.param_groups[0]["lr"]
            for s in range(trainer.mesh.stages)]


@pytest.mark.parametrize("rule", ["microbatch_staleness", "microbatch", "off"])
def test_every_stage_steps_at_the_scheduled_lr_times_its_factor(tiny_corpus, tmp_path, rule):
    cfg = tiny_config(tiny_corpus, "mesh.schedule=async", "mesh.stages=4", "mesh.microbatches=4",
                      "train.steps=3", f"mesh.async_lr_rule={rule}")
    trainer = Trainer(cfg, tmp_path, progress=False)
    for _ in range(3):
        trainer.step()
    # The last update of every stage belongs to step 2 (the run drains at its end).
    factor = lr_factor(2, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
    expected = [cfg.train.lr * factor * async_lr_scale(rule, 4, 1, 4 - s) for s in range(4)]
    assert applied_lrs(trainer) == pytest.approx(expected, rel=1e-12)


def test_no_ws_takes_the_microbatch_term_on_top_of_its_own_stage_rule(tiny_corpus, tmp_path):
    # 3 of 100 steps, drained by an evaluation: No-WS's own scale is still well below 1 on stage 0.
    cfg = tiny_config(tiny_corpus, "mesh.schedule=async", "mesh.stages=4", "mesh.microbatches=4",
                      "train.steps=100", "train.eval_every=3", "mesh.weight_stashing=false")
    trainer = Trainer(cfg, tmp_path, progress=False)
    for _ in range(3):
        trainer.step()
    factor = lr_factor(2, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
    no_ws = [no_ws_stage_hparams(s, 4, 3 / 100, cfg.optim.no_ws_lr_anneal).lr_scale for s in range(4)]
    assert no_ws[0] < 0.5
    expected = [cfg.train.lr * factor * no_ws[s] / 2 for s in range(4)]
    assert applied_lrs(trainer) == pytest.approx(expected, rel=1e-12)
