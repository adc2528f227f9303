"""The decoder's pretrained-model features without any checkpoint: grouped-query attention, tied
embeddings, the rotary row permutations, and the one-line checks of the new keys."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_run, tiny_config

from meshlearn.config import load_config
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, DecoderConfig, init_model, merge_stages
from meshlearn.models.formats.rope import halves_to_pairs, pairs_to_halves
from meshlearn.models.llama import apply_rope, rope_tables
from meshlearn.train import Trainer

CFG = DecoderConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, n_kv_head=2, seq_len=12, init_std=0.2)


def test_grouped_query_attention_is_multi_head_attention_with_shared_kv_heads():
    """Query head h reads KV head h // 2: an MHA model whose K/V heads are those copies agrees."""
    gqa = init_model(CFG, 0).eval()
    mha = Decoder(DecoderConfig(**{**CFG.__dict__, "n_kv_head": 0})).eval()
    state = gqa.state_dict()
    hd = CFG.head_dim
    for name, tensor in list(state.items()):
        if name.endswith(("attn.k.weight", "attn.v.weight")):
            heads = tensor.reshape(CFG.kv_heads, hd, CFG.d_model)
            state[name] = heads.repeat_interleave(CFG.n_head // CFG.kv_heads, dim=0).reshape(-1, CFG.d_model)
    mha.load_state_dict(state)
    x = torch.randint(0, 50, (2, 12))
    assert gqa.layers["0"].attn.k.weight.shape == (2 * hd, 32)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-5)


def test_tied_embeddings_are_one_parameter():
    model = init_model(DecoderConfig(**{**CFG.__dict__, "tie_embeddings": True}), 0)
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names
    assert set(model.state_dict()) >= {"tok_emb.weight", "head.weight"}  # both names load
    with pytest.raises(ValueError, match="tie_embeddings needs the embedding and the head"):
        Decoder(model.cfg, layer_ids=range(1), head=False)


def test_rotary_permutations_are_inverse_and_give_the_same_scores():
    """Hugging Face rotates halves, meshlearn adjacent pairs: permuted W_q/W_k give equal q·k."""
    torch.manual_seed(0)
    heads, hd, d, T = 3, 8, 16, 5
    wq, wk, x = torch.randn(heads * hd, d), torch.randn(heads * hd, d), torch.randn(T, d)
    assert torch.equal(pairs_to_halves(halves_to_pairs(wq, heads), heads), wq)
    cos, sin = rope_tables(T, hd, 10000.0)

    def rotate_half_rope(t):  # transformers' apply_rotary_pos_emb for one sequence
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        a, b = t[..., : hd // 2], t[..., hd // 2:]
        return t * c + torch.cat([-b, a], -1) * s

    def scores(q, k, rope):
        q, k = (t.reshape(T, heads, hd).transpose(0, 1) for t in (q, k))
        return rope(q) @ rope(k).transpose(-1, -2)

    theirs = scores(x @ wq.T, x @ wk.T, rotate_half_rope)
    ours = scores(x @ halves_to_pairs(wq, heads).T, x @ halves_to_pairs(wk, heads).T,
                  lambda t: apply_rope(t, cos, sin))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    unpermuted = scores(x @ wq.T, x @ wk.T, lambda t: apply_rope(t, cos, sin))
    assert (unpermuted - theirs).abs().max() > 1e-2  # the permutation matters


@pytest.mark.parametrize("sets,replicas", [(["model.n_kv_head=1", "model.tie_embeddings=true"], 2),
                                           (["model.n_kv_head=1", "mesh.stages=2"], 1)])
def test_mesh_matches_unsplit_model_with_gqa_and_tied_embeddings(tiny_corpus, tmp_path, sets, replicas):
    cfg = tiny_config(tiny_corpus, *sets, f"mesh.replicas={replicas}")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = reference_run(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    stages = trainer.cfg.mesh.stages
    merged = merge_stages(trainer.cfg.model,
                          [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(stages)])
    reference = ref_model.state_dict()
    assert max((merged.state_dict()[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5
    if cfg.model.tie_embeddings:
        module = trainer.workers[WorkerId(1, 0)].module
        assert module.head.weight is module.tok_emb.weight  # still one parameter after training


@pytest.mark.parametrize("sets,needle", [
    (["model.n_kv_head=3"], "model.n_kv_head = 3: 0 (= model.n_head) or a divisor of model.n_head = 4"),
    (["model.n_kv_head=-1"], "model.n_kv_head = -1"),
    (["model.tie_embeddings=true", "mesh.stages=2"], "model.tie_embeddings = True: the embedding (stage 0)"),
    (["model.tie_embeddings=true", "mesh.stages=1", "model.subspace_rank=4"], "subspace-constrained"),
    (["model.rope_theta=1"], "model.rope_theta = 1.0: must be > 1"),
    (["model.norm_eps=0"], "model.norm_eps = 0.0: must be in (0, 1)"),
    (["data.tokenizer=model"], "data.tokenizer = 'model': the tokenizer of a pretrained model needs"),
])
def test_new_model_keys_are_checked_in_one_line(sets, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert needle in str(err.value) and "\n" not in str(err.value)
