"""The spike definition: a run of steps above the running EMA by more than δ, counted once."""

from meshlearn.warmup import find_spikes


def test_a_falling_curve_has_no_spikes_however_fast_it_falls():
    spikes = find_spikes([5.5 - 0.5 * t for t in range(10)])
    assert spikes.count == 0 and spikes.max_excursion < 0


def test_consecutive_steps_above_the_margin_are_one_spike():
    losses = [3.0] * 10 + [3.5, 3.6] + [3.0] * 20 + [3.5] + [3.0] * 5
    spikes = find_spikes(losses, delta=0.3)
    assert spikes.onsets == [11, 33]
    assert spikes.above_steps == 3
    assert abs(spikes.max_excursion - 0.55) < 1e-9  # 3.6 over the EMA 3.05 that 3.5 left


def test_noise_below_the_margin_is_not_a_spike():
    losses = [3.0] * 20 + [3.0 + (0.25 if t % 2 else -0.25) for t in range(40)]
    assert find_spikes(losses, delta=0.3).count == 0
    assert find_spikes(losses, delta=0.2).count > 0  # the margin is what decides
