"""The unsplit model of a finished (or interrupted) run: replica 0's stages merged into one.

Importing ``meshlearn.train`` registers it as ``models.pretrained``'s reader of run folders.
"""

from __future__ import annotations

from pathlib import Path

from meshlearn.config import RunConfig, load_config
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.grassmann import set_basis
from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.pretrained import register_run_reader
from meshlearn.models.split import merge_stages
from meshlearn.train.checkpoint import load_run_state


def load_run_model(run_dir: Path) -> tuple[Decoder, RunConfig, int]:
    """The model of a run's latest checkpoint, its config, and the step it was saved at."""
    state = load_run_state(run_dir)  # checkpoint.pt, or a dist run's newest complete shards
    cfg = load_config(run_dir / "config.toml")
    replica0 = [state["workers"][str(WorkerId(0, s))]["module"] for s in range(cfg.mesh.stages)]
    model = merge_stages(DecoderConfig(**state["config"]["model"]), replica0).eval()
    if state.get("subspace_update"):  # U moved during training: use the basis the weights are in
        set_basis(model, state["subspace_update"]["basis"])
    return model, cfg, state["totals"]["step"]


register_run_reader(lambda run_dir: load_run_model(run_dir)[0])  # model.init = a run folder
