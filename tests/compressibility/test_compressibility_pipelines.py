"""Whole-model compression: exactness at full rank, exact parameter accounting, skipped layers."""

from __future__ import annotations

import pytest
import torch

from meshlearn.compressibility import (
    PIPELINES,
    LowRankLinear,
    calibration_windows,
    collect_input_stats,
    compress_model,
    count_parameters,
    factorizable,
    model_spectra,
    uniform_ranks,
)
from meshlearn.models import DecoderConfig, init_model

TINY = DecoderConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, seq_len=16)
IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


def calibration_stats(model):
    tokens = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(1)).numpy()
    windows = calibration_windows(tokens, 16, TINY.seq_len, seed=0)
    return collect_input_stats(model, {m.name: m.module for m in factorizable(model)[0]}, windows)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_full_rank_reproduces_the_model(pipeline):
    model = init_model(TINY, 0)
    ranks = {m.name: min(m.weight.shape) for m in factorizable(model)[0]}
    compressed, _ = compress_model(model, pipeline, ranks, calibration_stats(model))
    assert sum(isinstance(m, LowRankLinear) for m in compressed.modules()) == 14
    with torch.no_grad():
        torch.testing.assert_close(compressed(IDS), model(IDS), atol=1e-5, rtol=1e-5)


def test_parameter_accounting_is_exact_on_a_tiny_model():
    # Per layer: q, k, v, o are 32×32 (1024 each), gate and up 96×32, down 32×96 (3072 each):
    # 13312 per layer, 26624 in two. The rest: embedding 64·32 + head 32·64 + norms 5·32 = 4256.
    model = init_model(TINY, 0)
    _, account = compress_model(model, "svd", uniform_ranks(model, 0.5))
    assert account.total_before == 30880 == count_parameters(model)
    assert account.dense_params == 26624
    # keep 0.5: r = ⌊0.5·1024/64⌋ = 8 for squares (8·64 = 512), ⌊0.5·3072/128⌋ = 12 otherwise (1536)
    assert account.factor_params == 2 * (4 * 512 + 3 * 1536) == 13312
    assert account.kept_in_compressed == 0.5
    assert account.total_after == 4256 + 13312
    assert len(account.ranks) == 14 and account.ranks["layers.0.mlp.down"] == 12
    # keep 0.3 is not reachable exactly: r = ⌊4.8⌋ = 4 and ⌊7.2⌋ = 7 → 2·(4·256 + 3·896) = 7424
    _, account = compress_model(model, "svd", uniform_ranks(model, 0.3))
    assert account.factor_params == 7424
    assert account.kept_in_compressed == pytest.approx(7424 / 26624)
    assert account.to_dict()["kept_total"] == pytest.approx((4256 + 7424) / 30880)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_compressed_model_has_the_reported_parameters(pipeline):
    model = init_model(TINY, 0)
    stats = calibration_stats(model)
    compressed, account = compress_model(model, pipeline, uniform_ranks(model, 0.25), stats)
    assert count_parameters(compressed) == account.total_after < account.total_before
    low_rank = [m for m in compressed.modules() if isinstance(m, LowRankLinear)]
    assert sum(count_parameters(m) for m in low_rank) == account.factor_params
    assert count_parameters(model) == account.total_before  # the input model is untouched


def test_calibrated_pipeline_without_stats_and_unknown_names_fail_clearly():
    model = init_model(TINY, 0)
    with pytest.raises(ValueError, match="calibration"):
        compress_model(model, "svdllm", uniform_ranks(model, 0.5))
    with pytest.raises(ValueError, match="registered"):
        compress_model(model, "fwsvd", uniform_ranks(model, 0.5))


def test_subspace_writers_are_skipped_with_a_reason():
    cfg = DecoderConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, seq_len=16, subspace_rank=8)
    model = init_model(cfg, 0)
    compressed, account = compress_model(model, "svd", uniform_ranks(model, 0.5))
    assert sorted(account.skipped) == [f"layers.{i}.{b}" for i in (0, 1) for b in ("attn.o", "mlp.down")]
    assert all("SubspaceLinear" in why for why in account.skipped.values())
    assert len(account.ranks) == 10
    assert count_parameters(compressed) == account.total_after
    assert len(model_spectra(model)) == 14  # spectra still cover the U·Z writers


def test_an_already_compressed_model_is_left_alone():
    once, _ = compress_model(init_model(TINY, 0), "svd", uniform_ranks(init_model(TINY, 0), 0.5))
    twice, account = compress_model(once, "svd", uniform_ranks(once, 0.5))
    assert account.ranks == {} and len(account.skipped) == 14
    assert all("LowRankLinear is not a dense nn.Linear" in why for why in account.skipped.values())
    assert count_parameters(twice) == count_parameters(once)
