"""Generate text from a run's checkpoint (its stages merged into the unsplit model), or from any
``model.init`` value (a preset, a .gguf file, a Hugging Face folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from meshlearn.train.assemble import load_tokenizer
from meshlearn.train.restore import load_run_model


def sample_from_run(run_dir: Path, prompt: str, tokens: int, temperature: float, seed: int) -> str:
    model, cfg, _ = load_run_model(run_dir)
    tokenizer = load_tokenizer(cfg, run_dir)
    if tokenizer is None:
        raise FileNotFoundError(f"{run_dir}: no tokenizer to decode this run's tokens with")
    return _generate(model, tokenizer, prompt, tokens, temperature, seed)


def sample_from_pretrained(value: str, prompt: str, tokens: int, temperature: float, seed: int) -> str:
    """``value`` is a model.init value that is not a run folder; raises ValueError on a bad one."""
    from meshlearn.data import BPETokenizer
    from meshlearn.models.pretrained import find_source, load_model

    source = find_source(value)
    raw = source.tokenizer()
    if raw is None:
        raise ValueError(f"{value}: no tokenizer comes with it")
    return _generate(load_model(source), BPETokenizer(raw), prompt, tokens, temperature, seed)


def _generate(model, tokenizer, prompt: str, tokens: int, temperature: float, seed: int) -> str:
    """The prompt and its continuation. An empty prompt starts from a start-of-text token where the
    tokenizer has one, else from a newline; that seed is not part of the text returned."""
    ids = tokenizer.encode(prompt)
    seed_ids = [] if ids else start_ids(tokenizer)
    context = torch.tensor([ids or seed_ids], dtype=torch.long)
    out = model.generate(context, tokens, temperature=temperature, top_k=50,
                         generator=torch.Generator().manual_seed(seed))
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
