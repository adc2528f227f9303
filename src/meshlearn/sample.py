"""Generate text from a run's checkpoint (its stages merged into the unsplit model), or from any
``model.init`` value (a preset, a .gguf file, a Hugging Face folder); with ``morphs``, served as a
protocol-model pipeline whose stages morph during generation (``protocol/inference.py``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlearn.data.corpus import load_tokenizer
from meshlearn.train.restore import load_run_model


@dataclass(frozen=True)
class Generation:
    """How to generate: ``greedy`` (argmax) or sampling at ``temperature`` with top-k 50; with
    ``morph`` other than ``off``, as ``stages`` protocol-model stages morphing every
    ``morph_every_tokens`` tokens (``none``: the protocol pipeline, never morphed)."""

    temperature: float = 0.8
    seed: int = 0
    greedy: bool = False
    morph: str = "off"
    stages: int = 2
    morph_every_tokens: int = 16
    epsilon: float = 0.01


def sample_from_run(run_dir: Path, prompt: str, tokens: int, how: Generation) -> str:
    model, cfg, step = load_run_model(run_dir)
    print(f"meshlearn: sampling {run_dir} at its checkpoint of step {step} of {cfg.train.steps}",
          file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(cfg, run_dir)
    if tokenizer is None:
        raise FileNotFoundError(f"{run_dir}: no tokenizer to decode this run's tokens with")
    return generate_text(model, tokenizer, prompt, tokens, how)


def sample_from_pretrained(value: str, prompt: str, tokens: int, how: Generation) -> str:
    """``value`` is a model.init value that is not a run folder; raises ValueError on a bad one."""
    from meshlearn.data import BPETokenizer
    from meshlearn.models.pretrained import find_source, load_model

    source = find_source(value)
    raw = source.tokenizer()
    if raw is None:
        raise ValueError(f"{value}: no tokenizer comes with it")
    return generate_text(load_model(source), BPETokenizer(raw), prompt, tokens, how)


def generate_text(model, tokenizer, prompt: str, tokens: int, how: Generation) -> str:
    """The prompt and its continuation. An empty prompt starts from a start-of-text token where the
    tokenizer has one, else from a newline; that seed is not part of the text returned. With
    morphs, one line of their cost goes to stderr."""
    ids = tokenizer.encode(prompt)
    seed_ids = [] if ids else start_ids(tokenizer)
    context = torch.tensor([ids or seed_ids], dtype=torch.long)
    generator = torch.Generator().manual_seed(how.seed)
    if how.morph == "off":
        out = model.generate(context, tokens, temperature=how.temperature, top_k=50, generator=generator,
                             greedy=how.greedy)
    else:
        from meshlearn.errors import ConfigError
        from meshlearn.protocol.inference import MorphingPipeline

        layers = model.cfg.n_layer
        if layers % how.stages:
            divisors = [k for k in range(1, layers + 1) if layers % k == 0]
            raise ConfigError("--stages", how.stages, f"must divide the model's {layers} layers: {divisors}")
        pipe = MorphingPipeline(model, how.stages, how.morph, how.morph_every_tokens, how.epsilon)
        out = pipe.generate(context, tokens, temperature=how.temperature, top_k=50, generator=generator,
                            greedy=how.greedy)
        c = pipe.counters
        per = (f"{c.wall_s / c.morphs:.3f} s and {c.boundary_bytes / c.morphs / 1e3:.0f} kB per morph"
               if c.morphs else "")
        print(f"protocol: {c.morphs} morphs ({how.morph}, every {how.morph_every_tokens} tokens, "
              f"{how.stages} stages) {per}; fp64 masters {pipe.master_bytes() / 1e6:.1f} MB",
              file=sys.stderr)
    return tokenizer.decode(out[0].tolist()[len(seed_ids):])


START_TOKENS = ("<|endoftext|>", "<|begin_of_text|>", "<s>", "<|im_start|>")


def start_ids(tokenizer) -> list[int]:
    """What to start an unprompted sample from: the tokenizer's start-of-text token, or a newline
    (a token id 0 would be a NUL byte for the byte tokenizer and a stray ``!`` for GPT-2-style BPE)."""
    lookup = getattr(tokenizer, "token_id", None)  # BPE vocabularies may have special tokens
    for token in START_TOKENS if lookup is not None else ():
        token_id = lookup(token)
        if token_id is not None:
            return [token_id]
    return tokenizer.encode("\n")
