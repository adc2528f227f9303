"""One name → codec table; the config picks a codec by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlearn.compress.baselines import Int4RowCodec, RandomProjectionCodec, TopKCodec
from meshlearn.compress.codecs import CastCodec, Codec, IdentityCodec, Int8RowCodec
from meshlearn.compress.subspace import SubspaceCodec
from meshlearn.models.llama import DecoderConfig
from meshlearn.models.subspace import fixed_token_table, subspace_basis

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CodecConfig:
    """The pipeline-boundary codec, used for activations (forward) and gradients (backward)."""

    name: str = "identity"
    """Registry name: identity (fp32), bf16, fp16, int8, int4, topk, lowrank, subspace."""
    wire_dtype: str = "bf16"
    """Float type of the values sent by subspace, topk and lowrank: fp32, bf16 or fp16."""
    topk: int = 8
    """Values kept per token by the topk codec."""
    lowrank: int = 8
    """Rank of the fixed random projection of the lowrank codec."""
    seed: int = 0
    """Seed of the lowrank codec's projection."""


def _subspace(cfg: CodecConfig, model: DecoderConfig) -> Codec:
    if model.subspace_rank <= 0:
        raise ValueError("codec.name = 'subspace' needs a constrained model: set model.subspace_rank")
    basis = subspace_basis(model.d_model, model.subspace_rank, model.subspace_seed)
    table = fixed_token_table(model.vocab_size, model.d_model, model.init_std, model.subspace_seed)
    return SubspaceCodec(basis, table, WIRE_DTYPES[cfg.wire_dtype])


CODECS: dict[str, Callable[[CodecConfig, DecoderConfig], Codec]] = {
    "identity": lambda cfg, model: IdentityCodec(),
    "bf16": lambda cfg, model: CastCodec(torch.bfloat16),
    "fp16": lambda cfg, model: CastCodec(torch.float16),
    "int8": lambda cfg, model: Int8RowCodec(),
    "int4": lambda cfg, model: Int4RowCodec(),
    "topk": lambda cfg, model: TopKCodec(cfg.topk, WIRE_DTYPES[cfg.wire_dtype]),
    "lowrank": lambda cfg, model: RandomProjectionCodec(model.d_model, cfg.lowrank, cfg.seed,
                                                        WIRE_DTYPES[cfg.wire_dtype]),
    "subspace": _subspace,
}


def build_codec(cfg: CodecConfig, model: DecoderConfig) -> Codec:
    if cfg.name not in CODECS:
        raise ValueError(f"codec.name = {cfg.name!r} is unknown; registered codecs: {sorted(CODECS)}")
    return CODECS[cfg.name](cfg, model)
