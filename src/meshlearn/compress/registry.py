"""One name → codec table; the config picks a codec by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from meshlearn.compress.baselines import Int4RowCodec, RandomProjectionCodec, TopKCodec
from meshlearn.compress.codecs import CastCodec, Codec, IdentityCodec, Int8RowCodec
from meshlearn.compress.directional import DirectionalCodec
from meshlearn.compress.mask import MaskCodec, MaskForm, kept_channels
from meshlearn.compress.subspace import SubspaceCodec
from meshlearn.models.llama import DecoderConfig
from meshlearn.models.subspace import fixed_token_table, subspace_basis

WireDtype = Literal["bf16", "fp16", "fp32"]
"""Values of ``codec.wire_dtype``; ``WIRE_DTYPES`` gives each its torch dtype."""
WIRE_DTYPES: dict[WireDtype, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}


SAME = "same"
"""``codec.backward.name``: the gradients use ``codec.name`` too."""


@dataclass(frozen=True)
class BackwardCodecConfig:
    """The gradients' own codec (``codec.backward.*``); by default the activations' (``same``).

    Its wire dtype, top-k, rank and seed are ``codec.*``'s; the mask options are its own, so a
    forward mask and a backward mask may differ."""

    name: str = SAME
    """``same`` (gradients through codec.name) or a registry name for the gradients only (any but
    subspace), e.g. ``mask`` with rescale: an unbiased sparsifier of the gradient."""
    keep: float = 0.05
    """Backward mask: fraction of each token's gradient channels sent, in (0, 1]."""
    mask: MaskForm = "fixed"
    """Backward mask form: ``fixed`` or ``bernoulli`` (as codec.mask)."""
    rescale: bool = True
    """Backward mask: multiply what arrives by d/K (fixed) or 1/keep (Bernoulli). On by default:
    then the decoded gradient's mean over masks is the gradient (unbiased)."""


@dataclass(frozen=True)
class CodecConfig:
    """The pipeline-boundary codec: activations (forward) and, unless ``backward`` names another,
    their gradients (backward)."""

    name: str = "identity"
    """Registry name: identity (fp32), bf16, fp16, int8, int4, topk, lowrank, subspace, mask."""
    wire_dtype: WireDtype = "bf16"
    """Float type of the values sent by subspace, topk, lowrank and mask: fp32, bf16 or fp16."""
    topk: int = 8
    """Values kept per token by the topk codec."""
    lowrank: int = 8
    """Rank of the fixed random projection of the lowrank codec."""
    seed: int = 0
    """Seed of the lowrank codec's projection and of the mask codec's PRF key."""
    keep: float = 0.1
    """Mask codec: fraction of each token's channels that cross a boundary, 1 − p, in (0, 1].
    0.1 is the paper's M90, 0.05 its M95 (20× fewer bytes than a bf16 boundary in each direction)."""
    mask: MaskForm = "fixed"
    """Mask codec form: ``fixed`` (exactly round(keep·d) channels per token: an exact byte budget)
    or ``bernoulli`` (each channel kept independently with probability keep; the size varies)."""
    rescale: bool = False
    """Mask codec: multiply what arrives by 1/keep (d/K in the fixed form), in both directions
    (the activations only where codec.backward.name gives the gradients their own codec).
    Off by default: the paper found it destabilized bf16 training at keep = 0.05."""
    backward: BackwardCodecConfig = field(default_factory=BackwardCodecConfig)
    """The gradients' own codec (default: the same as the activations')."""


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
    "mask": lambda cfg, model: MaskCodec(model.d_model, cfg.keep, cfg.mask, cfg.seed,
                                         WIRE_DTYPES[cfg.wire_dtype], cfg.rescale),
}
BACKWARD_NAMES = [SAME, *sorted(name for name in CODECS if name != "subspace")]
"""What ``codec.backward.name`` may be: subspace codes activations against its token table."""


def validate_codec(cfg: CodecConfig, model: DecoderConfig,
                   require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``codec.*`` run by ``config.validate``; ``require(ok, key, value, allowed)`` raises
    the ConfigError naming the field, the value and what is allowed."""
    d = model.d_model
    require(cfg.name in CODECS, "codec.name", cfg.name, f"allowed: {sorted(CODECS)}")
    require(1 <= cfg.topk <= d, "codec.topk", cfg.topk, f"in [1, {d}]")
    require(1 <= cfg.lowrank <= d, "codec.lowrank", cfg.lowrank, f"in [1, {d}]")
    _validate_mask(cfg.name, cfg.keep, cfg.mask, "codec.", d, require)
    back = cfg.backward
    require(back.name in BACKWARD_NAMES, "codec.backward.name", back.name, f"allowed: {BACKWARD_NAMES}")
    require(back.name == SAME or cfg.name != "subspace", "codec.backward.name", back.name,
            "'same' under codec.name = 'subspace' (its basis updates code both directions)")
    _validate_mask(back.name, back.keep, back.mask, "codec.backward.", d, require)


def _validate_mask(name: str, keep: float, form: str, prefix: str, d: int,
                   require: Callable[[bool, str, Any, str], None]) -> None:
    """The mask options under ``prefix`` (codec. or codec.backward.); ``name`` is that codec's."""
    require(0 < keep <= 1, f"{prefix}keep", keep, "a fraction of the channels in (0, 1]")
    if name == "mask" and form == "fixed":
        require(kept_channels(keep, d) >= 1, f"{prefix}keep", keep,
                f"keeps round({keep} * model.d_model = {d}) = 0 channels per token; "
                "keep * model.d_model must exceed 0.5")


def build_codec(cfg: CodecConfig, model: DecoderConfig) -> Codec:
    """The boundary codec of ``cfg``: one codec, or a ``DirectionalCodec`` when ``codec.backward``
    names the gradients' own."""
    if cfg.name not in CODECS:
        raise ValueError(f"codec.name = {cfg.name!r} is unknown; registered codecs: {sorted(CODECS)}")
    forward = CODECS[cfg.name](cfg, model)
    back = cfg.backward
    if back.name == SAME:
        return forward
    if back.name not in BACKWARD_NAMES:
        raise ValueError(f"codec.backward.name = {back.name!r} is unknown; allowed: {BACKWARD_NAMES}")
    gradients = replace(cfg, name=back.name, keep=back.keep, mask=back.mask, rescale=back.rescale)
    return DirectionalCodec(forward, CODECS[back.name](gradients, model))
