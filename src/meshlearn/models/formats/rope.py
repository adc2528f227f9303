"""Q/K row orders of the two rotary conventions, and the permutations between them.

meshlearn (and GGUF, and Meta's original Llama) rotate a head's channels in adjacent pairs
(x[2i], x[2i+1]); Hugging Face's Llama rotates halves (x[i], x[i + hd/2]) ("rotate_half"). Both use
frequency θ^(-2i/hd) for pair i, so permuting the rows of W_q and W_k within each head turns one
model into the other exactly. llama.cpp's ``convert_hf_to_gguf.py`` applies ``halves_to_pairs`` when
it writes a GGUF; transformers applies ``pairs_to_halves`` when it reads one (``_reverse_permute``).
"""

from __future__ import annotations

import torch


def halves_to_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Hugging Face W_q / W_k (heads·hd, d) in meshlearn's adjacent-pair order."""
    rows, cols = weight.shape
    hd = rows // heads
    return weight.reshape(heads, 2, hd // 2, cols).transpose(1, 2).reshape(rows, cols)


def pairs_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a meshlearn (or GGUF) W_q / W_k in Hugging Face's rotate-half order."""
    rows, cols = weight.shape
    hd = rows // heads
    return weight.reshape(heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
