"""The method note's invariants for the statistics, distances and fences (no mesh needed)."""

from __future__ import annotations

import pytest
import torch

from meshlearn.verify.distances import (
    DISTANCES,
    Summary,
    ema,
    l1,
    normalized_l2,
    quantile_levels,
    quantile_table,
    sign_flip_ratio,
    sliced_wasserstein,
    summarize,
    swd_directions,
)
from meshlearn.verify.fence import TukeyFence, calibrated_k, tukey_threshold


def message(seed: int = 0, shape: tuple[int, int, int] = (4, 16, 8)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) + 0.5


def summary_of(x: torch.Tensor, statistic: str = "position_mean") -> Summary:
    return summarize(x, statistic, swd_directions(x.shape[-1], 16, 0), quantile_levels(16))


@pytest.mark.parametrize("statistic", ["position_mean", "global_mean"])
def test_every_distance_of_a_message_to_itself_is_zero(statistic):
    s = summary_of(message(), statistic)
    assert all(DISTANCES[m](s, s) == 0.0 for m in DISTANCES)


def test_sign_flip_ratio_of_a_negated_message_is_one():
    phi = message().mean(0)
    assert (phi != 0).all()
    assert sign_flip_ratio(-phi, phi) == 1.0
    assert sign_flip_ratio(torch.zeros_like(phi), phi) == 1.0  # zeros differ in sign from r ≠ 0


@pytest.mark.parametrize("c", [-1.0, 0.0, 0.1, 3.0])
def test_normalized_l2_of_a_scaled_message_is_c_minus_one(c):
    phi = message().mean(0)
    assert normalized_l2(c * phi, phi) == pytest.approx(abs(c - 1), rel=1e-5)


def test_l1_is_the_mean_absolute_difference():
    a, b = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.0, 0.0, 0.0])
    assert l1(a, b) == pytest.approx(2.0)


def test_sliced_wasserstein_ignores_the_order_of_tokens_but_not_their_spread():
    x = message()
    tokens = x.reshape(-1, x.shape[-1])
    shuffled = tokens[torch.randperm(tokens.shape[0], generator=torch.Generator().manual_seed(1))]
    directions, levels = swd_directions(x.shape[-1], 16, 0), quantile_levels(16)
    table = quantile_table(x, directions, levels)
    assert sliced_wasserstein(quantile_table(shuffled.reshape(x.shape), directions, levels), table) < 1e-6
    # Scaling the spread around the (unchanged) mean moves the quantiles.
    spread = x.mean((0, 1)) + 2 * (x - x.mean((0, 1)))
    assert sliced_wasserstein(quantile_table(spread, directions, levels), table) > 0.1


def test_quantile_table_matches_torch_quantile():
    x = message()
    directions, levels = swd_directions(x.shape[-1], 16, 0), quantile_levels(16)
    reference = torch.quantile(x.reshape(-1, x.shape[-1]) @ directions, levels, dim=0).t()
    assert torch.allclose(quantile_table(x, directions, levels), reference, atol=1e-5)


def test_ema_converges_to_a_constant_stream():
    start, target = summary_of(message(0)), summary_of(message(1))
    reference, beta = start, 0.8
    for _ in range(20):
        reference = ema(reference, target, beta)
    gap = (reference.mean - target.mean).abs().max().item()
    initial = (start.mean - target.mean).abs().max().item()
    assert gap == pytest.approx(beta**20 * initial, rel=1e-3)  # geometric: |r − c| shrinks by β
    for _ in range(100):
        reference = ema(reference, target, beta)
    assert torch.allclose(reference.mean, target.mean, atol=1e-5)
    assert torch.allclose(reference.table, target.table, atol=1e-5)


def test_tukey_threshold_is_q3_plus_k_iqr_and_open_without_data():
    assert tukey_threshold([1.0, 2.0], 3.0) == float("inf")
    values = [float(v) for v in range(1, 10)]  # Q1 = 3, Q3 = 7
    assert tukey_threshold(values, 1.5) == pytest.approx(7 + 1.5 * 4)


def test_fence_window_slides():
    fence = TukeyFence(k=3.0, window=10)
    for _ in range(10):
        fence.add(100.0)
    for v in range(10):
        fence.add(float(v))
    assert list(fence.values) == [float(v) for v in range(10)]
    assert fence.threshold() == pytest.approx(tukey_threshold([float(v) for v in range(10)], 3.0))


def test_calibration_raises_k_until_no_window_value_lies_above_the_fence():
    values = [float(v) for v in range(1, 10)] + [40.0]  # Q1 = 3.25, Q3 = 7.75 (numpy's linear rule)
    k = calibrated_k(values, 3.0, exceedance=0.0)
    assert tukey_threshold(values, k) == pytest.approx(40.0)
    assert calibrated_k(values, 3.0, exceedance=0.1) == 3.0  # one value of ten may stay above
    assert calibrated_k([float(v) for v in range(10)], 3.0, exceedance=0.0) == 3.0  # never lowered


def test_a_calibrated_fence_keeps_its_k_through_a_checkpoint():
    fence = TukeyFence(k=3.0, window=16)
    for v in [*range(15), 100]:
        fence.add(float(v))
    fence.calibrate(0.0)
    restored = TukeyFence(k=3.0, window=16)
    restored.load_state_dict(fence.state_dict())
    assert restored.k == fence.k > 3.0 and restored.threshold() == fence.threshold()
