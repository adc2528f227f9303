"""No-WS per-stage hyperparameters: β1,s = 0.9 + τ_s(0.99 − 0.9)/P and
lr_s = lr / max(τ_s, 1)^(1 − min(progress/E, 1)), with τ_s = P−1−s."""

from __future__ import annotations

import pytest

from meshlearn.optim import no_ws_stage_hparams, stage_delay

E = 0.12


def test_delay_is_stages_after_this_one():
    assert [stage_delay(s, 4) for s in range(4)] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match=r"stage must be in \[0, 4\)"):
        stage_delay(4, 4)


def test_last_stage_is_never_stale_and_keeps_base_values():
    """τ = 0: the max(τ, 1) guard keeps lr_scale at 1 (no division by zero) at every progress."""
    for stages in (1, 2, 8):
        for progress in (0.0, 0.01, E, 1.0):
            assert no_ws_stage_hparams(stages - 1, stages, progress, E) == (0.9, 1.0)


def test_first_stage_values_of_the_formula():
    beta1, lr_scale = no_ws_stage_hparams(0, 8, 0.0, E)
    assert beta1 == pytest.approx(0.9 + 7 * 0.09 / 8) and lr_scale == pytest.approx(1 / 7)
    assert no_ws_stage_hparams(0, 8, E / 2, E).lr_scale == pytest.approx(7**-0.5)
    assert no_ws_stage_hparams(0, 8, 0.75 * E, E).lr_scale == pytest.approx(7**-0.25)
    assert no_ws_stage_hparams(0, 4, 0.0, E).beta1 == pytest.approx(0.9675)


def test_the_reduction_is_gone_at_and_after_E_and_off_with_E_zero():
    for s in range(8):
        for progress in (E, 2 * E, 1.0):
            assert no_ws_stage_hparams(s, 8, progress, E).lr_scale == 1.0
        assert no_ws_stage_hparams(s, 8, 0.0, 0.0).lr_scale == 1.0
    assert no_ws_stage_hparams(6, 8, 0.0, E).lr_scale == 1.0  # τ = 1: nothing to divide by


def test_monotone_in_stage_and_progress_and_bounded():
    for stages in (2, 4, 8, 24):
        for progress in (0.0, 0.03, 0.06, 0.1):
            rows = [no_ws_stage_hparams(s, stages, progress, E) for s in range(stages)]
            betas = [r.beta1 for r in rows]
            scales = [r.lr_scale for r in rows]
            assert betas == sorted(betas, reverse=True) and betas[-1] == 0.9 and betas[0] < 0.99
            assert scales == sorted(scales) and all(0 < x <= 1 for x in scales)
        first = [no_ws_stage_hparams(0, stages, p, E).lr_scale for p in (0.0, 0.03, 0.06, 0.1, E)]
        assert first == sorted(first)
    # deep pipelines: the first stage's β1 approaches 0.99, the look-ahead value
    assert no_ws_stage_hparams(0, 1000, 0.0, E).beta1 == pytest.approx(0.99, abs=1e-4)


def test_custom_beta_range_and_bad_arguments():
    assert no_ws_stage_hparams(0, 2, 1.0, E, beta1_min=0.8, beta1_max=1.0).beta1 == pytest.approx(0.9)
    with pytest.raises(ValueError, match="progress and anneal must be >= 0"):
        no_ws_stage_hparams(0, 4, -0.1, E)
    with pytest.raises(ValueError, match="progress and anneal must be >= 0"):
        no_ws_stage_hparams(0, 4, 0.0, -1.0)


def test_a_deeper_window_uses_its_own_delay_and_beta1_stays_capped():
    default = no_ws_stage_hparams(0, 4, 0.0, 0.12)
    deep = no_ws_stage_hparams(0, 4, 0.0, 0.12, delay=15)
    assert deep.beta1 == 0.99 > default.beta1  # capped at beta1_max
    assert deep.lr_scale == 15.0**-1.0 < default.lr_scale
    with pytest.raises(ValueError, match="delay"):
        no_ws_stage_hparams(0, 4, 0.0, 0.12, delay=-1)
