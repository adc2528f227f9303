"""Cut the unsplit decoder into pipeline stages whose parameter names match the full model."""

from __future__ import annotations

import torch

from meshlearn.models.llama import Decoder, DecoderConfig


def stage_layer_ranges(n_layer: int, stages: int) -> list[range]:
    """Contiguous, equal blocks of layers per stage (the config validator guarantees divisibility)."""
    if stages < 1 or n_layer % stages:
        raise ValueError(f"cannot split {n_layer} layers into {stages} equal stages")
    per_stage = n_layer // stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(stages)]


def build_stage(cfg: DecoderConfig, stage: int, stages: int) -> Decoder:
    """An empty stage module; its weights are loaded from the full model (or a checkpoint).

    Built under a forked RNG so that making stages never shifts the global random stream.
    """
    layers = stage_layer_ranges(cfg.n_layer, stages)[stage]
    with torch.random.fork_rng(devices=[]):
        return Decoder(cfg, layer_ids=layers, embed=stage == 0, head=stage == stages - 1)


def split_model(full: Decoder, stages: int) -> list[Decoder]:
    """Stages carrying exact copies of ``full``'s weights (so every replica starts identical)."""
    state = full.state_dict()
    parts = []
    for s in range(stages):
        stage = build_stage(full.cfg, s, stages)
        stage.load_state_dict({k: state[k].clone() for k in stage.state_dict()}, strict=True)
        parts.append(stage)
    return parts


def merge_stages(cfg: DecoderConfig, stage_states: list[dict[str, torch.Tensor]]) -> Decoder:
    """Assemble the unsplit model from every stage's state dict (the oracle check, and sampling)."""
    with torch.random.fork_rng(devices=[]):
        full = Decoder(cfg)
    merged: dict[str, torch.Tensor] = {}
    for state in stage_states:
        merged.update(state)
    full.load_state_dict(merged, strict=True)
    return full


def init_model(cfg: DecoderConfig, seed: int) -> Decoder:
    """The reference model: initialisation depends only on the seed, never on the mesh shape; with
    ``cfg.init`` (a resolved config: its architecture already the checkpoint's) the weights are the
    pretrained ones."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(cfg)
    if cfg.init:
        from meshlearn.models.pretrained import find_source, load_into

        load_into(model, find_source(cfg.init))
    return model
