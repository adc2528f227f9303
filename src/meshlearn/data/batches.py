"""Token stream -> deterministic batches.

The batch for optimizer step t is a pure function of (tokens, seed, t). That makes a run
reproducible whatever the number of replicas or microbatches, and across resumes: a replica
that joins or restarts at step t computes the very same global batch and takes its slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshlearn.data.tokenizer import Tokenizer, text_chunks

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TokenSplits:
    train: np.ndarray
    val: np.ndarray


def encode_corpus(text: str, tokenizer: Tokenizer) -> np.ndarray:
    """Encode the whole corpus into one flat array of token ids.

    Stored as uint16 when every id fits (half the memory, and nanoGPT's .bin format), else int32.
    Text is encoded in ~1 MB chunks cut at newlines: much faster for BPE. For ByteTokenizer the
    result is exactly the whole-text encoding; for BPE a merge can never cross a chunk boundary,
    which is acceptable (and identical in practice, since BPE pre-tokens end at a newline anyway).
    """
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    parts = [np.asarray(tokenizer.encode(chunk), dtype=dtype) for chunk in text_chunks(text)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> TokenSplits:
    """Last `val_fraction` of the stream is validation, the rest is training.

    A contiguous tail (no shuffling) means no training window can overlap a validation window,
    except across the single boundary.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = int(round(len(tokens) * val_fraction))
    cut = len(tokens) - n_val
    return TokenSplits(train=tokens[:cut], val=tokens[cut:])


def check_split_length(splits: TokenSplits, seq_len: int) -> None:
    """Each split needs at least seq_len + 1 tokens to make one (x, y) window."""
    need = seq_len + 1
    if len(splits.train) < need or len(splits.val) < need:
        raise ValueError(
            f"model.seq_len = {seq_len} needs at least {need} tokens in each split, but train has "
            f"{len(splits.train)} and val has {len(splits.val)}; use a bigger corpus, a smaller "
            "seq_len or a different val_fraction"
        )


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> Batch:
    """Gather windows tokens[o : o + seq_len + 1] and split them into inputs and targets."""
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def _n_offsets(tokens: np.ndarray, seq_len: int) -> int:
    n = len(tokens) - seq_len  # valid starts: 0 .. len - seq_len - 1
    if n < 1:
        raise ValueError(
            f"model.seq_len = {seq_len} needs at least {seq_len + 1} tokens, got {len(tokens)}"
        )
    return n


def global_batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> Batch:
    """The global batch for optimizer step `step`: x, y int64 of shape (batch_size, seq_len).

    Offsets come from a generator seeded from (seed, step) alone (no state carried between
    steps), so every replica, any microbatch split, and a resumed run all see the same batch.
    y is x shifted left by one token.
    """
    return windows(tokens, batch_offsets(tokens, step, batch_size, seq_len, seed), seq_len)


def batch_offsets(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """The start offsets of ``global_batch``'s sequences: its ids (what an anchor is handed instead
    of the tokens, 8 bytes per sequence)."""
    n = _n_offsets(tokens, seq_len)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.randint(0, n, (batch_size,), generator=gen).numpy()


def shard_batch(
    x: torch.Tensor, y: torch.Tensor, replicas: int, microbatches: int
) -> list[list[Batch]]:
    """Split a global batch: result[r][m] is microbatch m of replica r.

    Replica r takes the contiguous rows r*B/D : (r+1)*B/D, cut into `microbatches` equal
    contiguous pieces; concatenating everything in (r, m) order gives back exactly (x, y).
    """
    b = x.shape[0]
    if replicas < 1 or microbatches < 1 or b % (replicas * microbatches):
        raise ValueError(
            f"train.batch_size = {b} must be divisible by replicas ({replicas}) x microbatches "
            f"({microbatches}) = {replicas * microbatches}"
        )
    per_replica = b // replicas
    per_micro = per_replica // microbatches
    out: list[list[Batch]] = []
    for r in range(replicas):
        row: list[Batch] = []
        for m in range(microbatches):
            lo = r * per_replica + m * per_micro
            row.append((x[lo : lo + per_micro], y[lo : lo + per_micro]))
        out.append(row)
    return out


def validation_batches(
    tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int
) -> list[Batch]:
    """A fixed set of validation batches: evenly spaced windows spanning the whole val split.

    No randomness, so every evaluation (on every replica, before and after a resume) measures
    the same tokens and val losses are comparable across steps and runs.
    """
    n = _n_offsets(tokens, seq_len)
    offsets = np.linspace(0, n - 1, n_batches * batch_size).round().astype(np.int64)
    x, y = windows(tokens, offsets, seq_len)
    return [
        (x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size])
        for i in range(n_batches)
    ]
