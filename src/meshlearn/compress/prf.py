"""A counter-based pseudo-random function on integer tensors, identical on every device.

The mask codec needs the same pseudo-random value for (key, row, position, channel) on the sender
and on the receiver, which may be different processes on different devices, and it must never touch
a global RNG (whose state depends on what else ran). A counter-based PRF does that: the value is a
pure function of its inputs. This one is the murmur3 32-bit finalizer (``mix32``, a bijection of
[0, 2³²) with full avalanche) applied sponge-style: ``absorb(h, x) = mix32(h + mix32(x·γ))`` (mod
2³², γ the golden-ratio constant), once per field.

Why 32-bit arithmetic on int64 tensors, with the multiply split into 16-bit halves: every
intermediate stays below 2⁴⁹, so nothing overflows and nothing depends on how a backend wraps
signed integers. The same expressions work on Python ints (scalar fields) and on int64 tensors of
any device, with identical results.
"""

from __future__ import annotations

from typing import TypeVar

import torch

M32 = 0xFFFFFFFF
GAMMA = 0x9E3779B9  # 2³² / φ, odd: x·γ mod 2³² is a bijection
CHANNEL_SALT = 0x5BD1E995  # murmur2's constant: channel hashes differ from row/position hashes
T = TypeVar("T", int, torch.Tensor)


def mul32(a: T, c: int) -> T:
    """``a · c mod 2³²`` for ``a`` in [0, 2³²) and a constant ``c`` in [0, 2³²), without overflow."""
    return ((a & 0xFFFF) * c + (((a >> 16) * (c & 0xFFFF)) << 16)) & M32


def mix32(h: T) -> T:
    """murmur3's fmix32: a bijection of [0, 2³²) in which every input bit flips each output bit
    with probability about 1/2."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def absorb(h: T, x: T) -> T:
    """Fold one 32-bit field ``x`` into the running hash ``h``."""
    return mix32((h + mix32(mul32(x & M32, GAMMA))) & M32)


def key32(*fields: int) -> int:
    """One 32-bit key from integer fields of any size (each absorbed as its 32-bit words, low word
    first, then a word count, so (1, 0) and (1,) differ). Negative fields are folded in two's
    complement."""
    h = 0x243F6A88  # π's first fraction bits: a fixed, arbitrary start
    for value in fields:
        value &= (1 << 64) - 1
        h = absorb(h, value & M32)
        h = absorb(h, value >> 32)
    return absorb(h, len(fields))


def grid32(key: int, shape: tuple[int, int, int], device: torch.device | None = None) -> torch.Tensor:
    """PRF values in [0, 2³²) for every (row, position, channel) of ``shape``: int64 (B, T, d).

    The rows and positions are hashed once each (B and B·T values); only the last fold touches
    B·T·d elements. Within one (row, position) the d values are distinct (``mix32`` and the
    channel fold are bijections), so ranking them never ties.
    """
    rows, positions, channels = shape

    def arange(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=device)

    h = absorb(torch.full((rows, 1, 1), key, dtype=torch.int64, device=device), arange(rows)[:, None, None])
    h = absorb(h, arange(positions)[None, :, None])  # (B, T, 1)
    channel = mix32(mul32(arange(channels), GAMMA) ^ CHANNEL_SALT)  # (d,), distinct values
    return mix32(h ^ channel[None, None, :])  # (B, T, d)
