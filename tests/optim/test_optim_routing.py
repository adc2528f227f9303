"""Parameter routing: hidden matrices to Muon, embeddings / head / non-2-D to AdamW."""

from __future__ import annotations

from meshlearn.optim.routing import is_embedding_or_head, split_params


def names(pairs):
    return [n for n, _ in pairs]


def test_module_split_by_shape_and_name(make_lm):
    split = split_params(make_lm())
    assert names(split.matrix) == ["up.weight", "down.weight"]
    assert names(split.adamw) == [
        "tok_emb.weight",
        "up.bias",
        "norm.weight",
        "norm.bias",
        "lm_head.weight",
    ]


def test_named_parameters_give_the_same_split_as_the_module(make_lm):
    model = make_lm()
    a, b = split_params(model), split_params(model.named_parameters())
    assert names(a.matrix) == names(b.matrix) and names(a.adamw) == names(b.adamw)


def test_plain_tensors_are_routed_by_shape_only(make_lm):
    model = make_lm()
    split = split_params(model.parameters())
    assert all(name is None for name, _ in split.matrix + split.adamw)
    # Without names the 2-D embedding and head cannot be told apart from hidden matrices.
    assert len(split.matrix) == 4 and all(p.ndim == 2 for _, p in split.matrix)
    assert all(p.ndim != 2 for _, p in split.adamw)


def test_default_predicate_and_a_custom_one(make_lm):
    assert is_embedding_or_head("model.embed_tokens.weight")
    assert is_embedding_or_head("head.weight") and is_embedding_or_head("lm_head.weight")
    assert not is_embedding_or_head("blocks.0.attn.q.weight")
    assert not is_embedding_or_head("lm_head.bias")  # 1-D anyway
    split = split_params(make_lm(), is_adamw_name=lambda name: name.startswith("down"))
    assert names(split.matrix) == ["tok_emb.weight", "up.weight", "lm_head.weight"]
