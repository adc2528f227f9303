"""Generation with a KV cache gives the uncached model's tokens; an empty prompt starts cleanly."""

from __future__ import annotations

import pytest
import torch

from meshlearn.data import ByteTokenizer
from meshlearn.models.llama import Decoder, DecoderConfig, KVCache
from meshlearn.sample import Generation, generate_text, start_ids


def tiny(**overrides) -> Decoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, n_layer=2, d_model=32, n_head=4, seq_len=24, **overrides)
    return Decoder(cfg).eval()


def uncached(model: Decoder, idx: torch.Tensor, steps: int, generator: torch.Generator) -> torch.Tensor:
    """The reference, without a cache: each token's context is what the cached path keeps — the
    whole text while it fits the window, then from the last restart (every seq_len // 2 tokens past
    the first full window) on."""
    window, keep = model.cfg.seq_len, model.cfg.seq_len // 2
    start = max(0, idx.shape[1] - window)
    for _ in range(steps):
        if idx.shape[1] - start > window:
            start = idx.shape[1] - keep
        logits = model(idx[:, start:])[:, -1, :]
        kth = torch.topk(logits, 5).values[:, -1:]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return idx


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 2}, {"attn_softcap": 5.0, "qk_norm": True}],
                         ids=["mha", "gqa", "softcap-qknorm"])
def test_cached_logits_equal_the_full_forward(overrides):
    model = tiny(**overrides)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = KVCache()
    first = model(ids[:, :12], cache)
    steps = [model(ids[:, t:t + 1], cache) for t in range(12, 20)]
    cached = torch.cat([first, *steps], dim=1)
    assert (cached - full).abs().max().item() <= 1e-5 and cache.length == 20


def test_generate_with_the_cache_samples_the_same_tokens_past_the_window():
    model = tiny()
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.generate(prompt, 40, top_k=5, generator=torch.Generator().manual_seed(3))
        reference = uncached(model, prompt, 40, torch.Generator().manual_seed(3))
    assert torch.equal(ours, reference)  # 45 tokens: the window (24) fills and restarts twice


def test_an_empty_prompt_starts_from_a_newline_and_leaves_it_out():
    tokenizer = ByteTokenizer()
    assert start_ids(tokenizer) == [10]
    model = _byte_model()
    text = generate_text(model, tokenizer, "", 20, Generation(temperature=1.0, seed=0))
    out = model.generate(torch.tensor([[10]]), 20, top_k=50, generator=torch.Generator().manual_seed(0))
    assert text == tokenizer.decode(out[0, 1:].tolist())  # the 20 sampled tokens, without the seed


def _byte_model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=256, n_layer=1, d_model=16, n_head=2, seq_len=16)).eval()
