"""Non-identical data: ``data.replica_corpus`` gives a replica a corpus of its own.

Participants of a run among strangers train on their own text, so honest replicas' statistics
differ. ``data.replica_corpus = "R:PATH,R:PATH"`` makes replica R's rows of every global batch
come from PATH instead of ``data.corpus`` (same tokenizer, same offsets rule: the batch stays a pure
function of the tokens, the seed and the step), while validation stays on ``data.corpus``. What it
exists to test is SENTINEL's tolerance of honest replicas that differ (docs/sentinel.md).
"""

from __future__ import annotations

import numpy as np

from meshlearn.data.batches import encode_corpus, global_batch, shard_batch, split_tokens
from meshlearn.data.corpus import is_token_file, load_text, load_tokens_bin
from meshlearn.data.replica_spec import parse_replica_corpus
from meshlearn.data.tokenizer import Tokenizer


def load_replica_tokens(spec: str, tokenizer: Tokenizer | None, val_fraction: float) -> dict[int, np.ndarray]:
    """Each replica's own train tokens (its corpus less the validation tail, as for data.corpus)."""
    out = {}
    for replica, path in parse_replica_corpus(spec).items():
        if is_token_file(path):
            tokens = load_tokens_bin(path)
        elif tokenizer is None:
            raise ValueError(f"data.replica_corpus = {spec!r}: a text corpus needs a tokenizer, and "
                             "data.corpus is a .bin token file without one")
        else:
            tokens = encode_corpus(load_text(path), tokenizer)
        out[replica] = split_tokens(tokens, val_fraction).train
    return out


def own_rows(own: dict[int, np.ndarray], shards: list, rows: tuple[tuple[int, ...], ...], index: int,
             batch_size: int, seq_len: int, seed: int, microbatches: int) -> list:
    """``shards`` (``shard_batch``'s, one per row) with each row whose stage-0 replica has its own
    corpus cut from that corpus's global batch ``index`` instead."""
    out = list(shards)
    for k, row in enumerate(rows):
        tokens = own.get(row[0])
        if tokens is not None:
            x, y = global_batch(tokens, index, batch_size, seq_len, seed)
            out[k] = shard_batch(x, y, len(rows), microbatches)[k]
    return out


__all__ = ["load_replica_tokens", "own_rows"]
