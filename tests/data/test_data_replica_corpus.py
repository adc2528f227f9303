"""``data.replica_corpus``: a replica's rows come from its own corpus, the others' are unchanged."""

from __future__ import annotations

import torch

from meshlearn.data import encode_corpus, global_batch, shard_batch, split_tokens
from meshlearn.data.replica_corpus import load_replica_tokens, own_rows
from meshlearn.data.replica_spec import parse_replica_corpus
from meshlearn.data.tokenizer import ByteTokenizer


def test_parse_names_each_replica_once():
    assert parse_replica_corpus(" 1:a.txt, 3:b.bin ") == {1: "a.txt", 3: "b.bin"}


def test_a_replica_with_its_own_corpus_reads_only_that_text(tmp_path):
    shared, own = "a" * 4000, "z" * 4000
    (tmp_path / "own.txt").write_text(own)
    tokenizer = ByteTokenizer()
    tokens = split_tokens(encode_corpus(shared, tokenizer), 0.05).train
    mine = load_replica_tokens(f"1:{tmp_path / 'own.txt'}", tokenizer, 0.05)
    x, y = global_batch(tokens, 3, 8, 16, 0)
    rows = ((0, 0), (1, 1))
    shards = own_rows(mine, shard_batch(x, y, 2, 2), rows, 3, 8, 16, 0, 2)
    assert all(torch.all(mx == ord("a")) for mx, _ in shards[0])
    assert all(torch.all(mx == ord("z")) and torch.all(my == ord("z")) for mx, my in shards[1])
