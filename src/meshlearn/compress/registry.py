"""One name → codec table; the config picks a codec by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlearn.compress.codecs import CastCodec, Codec, IdentityCodec, Int8RowCodec


@dataclass(frozen=True)
class CodecConfig:
    """The pipeline-boundary codec, used for activations (forward) and gradients (backward)."""

    name: str = "identity"
    """Registry name: identity (fp32), bf16, fp16 or int8 (per-row scale)."""


CODECS: dict[str, Callable[[CodecConfig], Codec]] = {
    "identity": lambda cfg: IdentityCodec(),
    "bf16": lambda cfg: CastCodec(torch.bfloat16),
    "fp16": lambda cfg: CastCodec(torch.float16),
    "int8": lambda cfg: Int8RowCodec(),
}


def build_codec(cfg: CodecConfig) -> Codec:
    if cfg.name not in CODECS:
        raise ValueError(f"codec.name = {cfg.name!r} is unknown; registered codecs: {sorted(CODECS)}")
    return CODECS[cfg.name](cfg)
