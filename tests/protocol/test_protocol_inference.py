"""Inference under morphs: a protocol pipeline that morphs every N tokens during generation draws
every token from the logits of the plain model (fp32 weights cast from fp64 masters)."""

import pytest
import torch

from meshlearn.models.llama import Decoder, DecoderConfig, KVCache, generate_tokens
from meshlearn.protocol.inference import MorphingPipeline

CFG = DecoderConfig(vocab_size=97, n_layer=4, d_model=32, n_head=4, n_kv_head=2, seq_len=24,
                    tie_embeddings=True)
TOL = 1e-5  # relative (max |Δ| / max |logit|): fp32 arithmetic on weights one rounding from fp64


def model() -> Decoder:
    torch.manual_seed(0)
    m = Decoder(CFG).eval()
    with torch.no_grad():  # sharper than the init, so argmax ties are rare and the test sees signal
        for p in m.parameters():
            p.mul_(3.0)
    return m


def logits_of(gen, *args, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    seen = []
    out = gen(*args, on_logits=lambda n, logits: seen.append(logits.clone()), **kwargs)
    return out, seen


@pytest.mark.parametrize("kind", ["orthogonal", "lowcond"])
def test_generation_under_morphs_sees_the_plain_logits(kind):
    plain = model()
    prompt = torch.tensor([[3, 14, 15, 9, 26]])
    tokens = 40  # past the 24-token window: the KV caches restart twice, across morphs
    ref_seen = []
    cache = [KVCache()]

    def forward(ids, restart):
        if restart:
            cache[0] = KVCache()
        return plain(ids, cache[0])

    with torch.no_grad():
        ref = generate_tokens(forward, CFG.seq_len, prompt, tokens, greedy=True,
                              after_token=lambda n, logits: ref_seen.append(logits.clone()))
    assert torch.equal(ref, plain.generate(prompt, tokens, greedy=True))
    pipe = MorphingPipeline(plain, stages=2, kind=kind, every_tokens=3, epsilon=0.1, seed=5)
    out, seen = logits_of(pipe.generate, prompt, tokens, greedy=True)
    assert pipe.counters.morphs == 1 + tokens // 3  # one before serving
    assert torch.equal(out, ref)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(seen, ref_seen, strict=True))
    assert worst <= TOL, worst
    # ... while the stages' weights are in another basis than at the start
    fresh = MorphingPipeline(plain, stages=2, kind="none", every_tokens=3)
    name = "layers.1.mlp.down.weight"
    a, b = pipe.stages[0].state_dict()[name], fresh.stages[0].state_dict()[name]
    assert (a - b).abs().max() > 0.5 * b.abs().max()


def test_sampling_under_morphs_draws_the_same_tokens():
    plain = model()
    prompt = torch.tensor([[1, 2, 3]])
    ref = plain.generate(prompt, 30, temperature=0.9, top_k=20, generator=torch.Generator().manual_seed(1))
    pipe = MorphingPipeline(plain, stages=4, kind="orthogonal", every_tokens=5)
    out = pipe.generate(prompt, 30, temperature=0.9, top_k=20, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, ref)


def test_the_pipeline_without_morphs_never_morphs():
    pipe = MorphingPipeline(model(), stages=2, kind="none", every_tokens=1)
    pipe.generate(torch.tensor([[1]]), 5, greedy=True)
    assert pipe.counters.morphs == 0
