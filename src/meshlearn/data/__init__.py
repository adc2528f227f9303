"""Data pipeline: corpus -> tokenizer -> deterministic batches."""

from meshlearn.data.batches import (
    TokenSplits,
    batch_offsets,
    check_split_length,
    encode_corpus,
    global_batch,
    shard_batch,
    split_tokens,
    validation_batches,
    windows,
)
from meshlearn.data.corpus import is_token_file, load_text, load_tokens_bin, shakespeare_dir
from meshlearn.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "TokenSplits",
    "Tokenizer",
    "batch_offsets",
    "build_tokenizer",
    "check_split_length",
    "encode_corpus",
    "global_batch",
    "is_token_file",
    "load_text",
    "load_tokens_bin",
    "shakespeare_dir",
    "shard_batch",
    "split_tokens",
    "validation_batches",
    "windows",
]
