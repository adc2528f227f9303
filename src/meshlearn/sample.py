"""Generate text from a run's checkpoint: assemble the unsplit model from its stages."""

from __future__ import annotations

from pathlib import Path

import torch

from meshlearn.config import load_config
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.grassmann import set_basis
from meshlearn.models.llama import DecoderConfig
from meshlearn.models.split import merge_stages
from meshlearn.train.assemble import load_tokenizer
from meshlearn.train.trainer import CHECKPOINT


def sample_from_run(run_dir: Path, prompt: str, tokens: int, temperature: float, seed: int) -> str:
    path = run_dir / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no {CHECKPOINT}; train (or resume) the run first")
    state = torch.load(path, weights_only=False)
    cfg = load_config(run_dir / "config.toml")
    tokenizer = load_tokenizer(cfg, run_dir)
    if tokenizer is None:
        raise FileNotFoundError(f"{run_dir}: no tokenizer to decode this run's tokens with")
    replica0 = [state["workers"][str(WorkerId(0, s))]["module"] for s in range(cfg.mesh.stages)]
    model = merge_stages(DecoderConfig(**state["config"]["model"]), replica0).eval()
    if state.get("subspace_update"):  # U moved during training: use the basis the weights are in
        set_basis(model, state["subspace_update"]["basis"])
    ids = torch.tensor([tokenizer.encode(prompt) or [0]], dtype=torch.long)
    out = model.generate(ids, tokens, temperature=temperature, top_k=50,
                         generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0].tolist())
