"""Mask codec cost: wire bytes per token and encode+decode time of one boundary tensor, beside bf16.

The tensor is (4, 256, 576): four sequences of 256 tokens at SmolLM2-135M's width. "derived" builds
a fresh codec each time (the PRF and the ranking run), "cached" reuses one codec whose mask for the
message is already derived (what a stage pays for the second use of a message's mask: its
backward's gradient over the boundary its forward crossed). Bytes are the payload's exact size.

    python bench/mask_codec.py [--repeats 11]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from common import markdown_table, write_results

from meshlearn.compress import CastCodec, MaskCodec, MessageContext

SHAPE = (4, 256, 576)
CTX = MessageContext(step=3, microbatch=1, boundary=2, replica=0)


def median_ms(f: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        f()
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2] * 1e3


def mask_row(x: torch.Tensor, keep: float, form: str, repeats: int) -> dict:
    def derived() -> None:
        codec = MaskCodec(SHAPE[-1], keep, form)
        codec.decode(codec.encode(x, "act", ctx=CTX), "act", ctx=CTX)

    codec = MaskCodec(SHAPE[-1], keep, form)
    message = codec.encode(x, "act", ctx=CTX)
    tokens = SHAPE[0] * SHAPE[1]
    return {"codec": f"mask keep={keep} {form}", "bytes_per_token": message.wire_bytes / tokens,
            "derived_ms": median_ms(derived, repeats),
            "cached_ms": median_ms(lambda: codec.decode(codec.encode(x, "act", ctx=CTX), "act", ctx=CTX),
                                   repeats)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    rows = [mask_row(x, keep, form, args.repeats) for keep in (0.1, 0.05) for form in ("fixed", "bernoulli")]
    cast = CastCodec(torch.bfloat16)
    bf16_ms = median_ms(lambda: cast.decode(cast.encode(x)), args.repeats)
    rows.append({"codec": "bf16", "bytes_per_token": cast.encode(x).wire_bytes / (SHAPE[0] * SHAPE[1]),
                 "derived_ms": bf16_ms, "cached_ms": bf16_ms})
    table = markdown_table(rows, [("codec", "codec", ""), ("bytes_per_token", "bytes/token", ".1f"),
                                  ("derived_ms", "encode+decode, mask derived (ms)", ".1f"),
                                  ("cached_ms", "encode+decode, mask cached (ms)", ".1f")])
    markdown = (f"Boundary tensor {SHAPE} fp32, median of {args.repeats}, torch threads = "
                f"{torch.get_num_threads()}.\n\n{table}")
    write_results("mask_codec", {"shape": SHAPE, "repeats": args.repeats,
                                 "threads": torch.get_num_threads(), "rows": rows}, markdown)


if __name__ == "__main__":
    main()
