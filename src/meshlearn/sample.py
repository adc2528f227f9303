"""Generate text from a run's checkpoint: assemble the unsplit model from its stages."""

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
    ids = torch.tensor([tokenizer.encode(prompt) or [0]], dtype=torch.long)
    out = model.generate(ids, tokens, temperature=temperature, top_k=50,
                         generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0].tolist())
