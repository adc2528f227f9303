"""``meshlearn export``: any model.init value (or a run's latest checkpoint) as a Hugging Face folder.

The folder holds config.json, model.safetensors (fp32 unless asked otherwise) and, when the source
has one, tokenizer.json (a byte-level run's too: id = UTF-8 byte);
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it as the same
function (``tests/models/test_pretrained_oracle.py``).
"""

from __future__ import annotations

from pathlib import Path

from meshlearn.data.tokenizer import ByteTokenizer
from meshlearn.models.formats import hf_folder
from meshlearn.models.pretrained import find_source, load_model

FORMATS = ("hf",)


def export(value: str, out: Path, fmt: str = "hf", dtype: str = "fp32") -> Path:
    """Write ``value``'s model to ``out`` in ``fmt``; a ValueError names what cannot be written."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: allowed {list(FORMATS)}")
    if dtype not in hf_folder.DTYPES:
        raise ValueError(f"--dtype {dtype!r}: allowed {sorted(hf_folder.DTYPES)}")
    source = find_source(value)
    arch = source.architecture()
    if arch.get("subspace_rank", 0):
        raise ValueError("a subspace-constrained model has no Hugging Face equivalent (U·Z writers)")
    if source.kind == "run":
        from meshlearn.train.restore import load_run_model  # the run's own (latest) checkpoint

        model = load_run_model(source.path)[0]
    else:
        model = load_model(source)
    cfg = model.cfg
    arch = arch | {"vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer, "d_model": cfg.d_model,
                   "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "ffn_hidden": cfg.ffn_width,
                   "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps,
                   "tie_embeddings": cfg.tie_embeddings}
    tokenizer = source.tokenizer() if arch["has_tokenizer"] else None
    if tokenizer is None and source.kind == "run":  # a byte-level run: token id = UTF-8 byte
        tokenizer = ByteTokenizer.as_hf()
    return hf_folder.write_hf(model.state_dict(), arch, Path(out), dtype, tokenizer)
