"""Models: the decoder and its split into pipeline stages. No networking, codecs or clocks here."""

from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.split import (
    build_stage,
    init_model,
    merge_stages,
    split_model,
    stage_layer_ranges,
)

__all__ = [
    "Decoder",
    "DecoderConfig",
    "build_stage",
    "init_model",
    "merge_stages",
    "split_model",
    "stage_layer_ranges",
]
