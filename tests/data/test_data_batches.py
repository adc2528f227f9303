import numpy as np
import pytest
import torch

from meshlearn.data import (
    ByteTokenizer,
    check_split_length,
    encode_corpus,
    global_batch,
    shard_batch,
    split_tokens,
    validation_batches,
)
from meshlearn.data.tokenizer import text_chunks

# Token i has value i (mod 2**16), so a window's contents reveal its offset.
TOKENS = (np.arange(10_000) % 65536).astype(np.uint16)


def test_text_chunks_cut_after_newlines_and_lose_nothing():
    text = "".join(f"line {i} é\n" for i in range(200)) + "tail without newline"
    chunks = list(text_chunks(text, chunk_chars=100))
    assert "".join(chunks) == text
    assert all(c.endswith("\n") for c in chunks[:-1])
    assert list(text_chunks("x" * 250, chunk_chars=100)) == ["x" * 100, "x" * 100, "x" * 50]


def test_encode_corpus_bytes_equals_whole_text():
    text = "Ça, naïve — 🎭 line\n" * 60_000  # > 1 MB: spans several chunks
    ids = encode_corpus(text, ByteTokenizer())
    assert ids.dtype == np.uint16
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), dtype=np.uint8))
    assert len(encode_corpus("", ByteTokenizer())) == 0


def test_encode_corpus_uses_int32_for_big_vocab():
    class Big(ByteTokenizer):
        vocab_size = 70_000

        def encode(self, text):
            return [69_999] * len(text)

    ids = encode_corpus("abc", Big())
    assert ids.dtype == np.int32 and ids.tolist() == [69_999] * 3


def test_split_is_deterministic_disjoint_contiguous():
    s = split_tokens(TOKENS, 0.1)
    assert len(s.val) == 1000 and len(s.train) == 9000
    np.testing.assert_array_equal(np.concatenate([s.train, s.val]), TOKENS)  # tail is val
    s2 = split_tokens(TOKENS, 0.1)
    np.testing.assert_array_equal(s.train, s2.train)
    np.testing.assert_array_equal(s.val, s2.val)
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(TOKENS, 1.0)


def test_check_split_length():
    s = split_tokens(TOKENS, 0.1)
    check_split_length(s, 999)
    with pytest.raises(ValueError, match=r"model\.seq_len = 1000.*9000.*1000"):
        check_split_length(s, 1000)


def test_global_batch_depends_only_on_seed_and_step():
    x, y = global_batch(TOKENS, step=7, batch_size=8, seq_len=16, seed=3)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    global_batch(TOKENS, step=8, batch_size=8, seq_len=16, seed=3)  # no hidden state
    x2, y2 = global_batch(TOKENS, step=7, batch_size=8, seq_len=16, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, global_batch(TOKENS, 8, 8, 16, 3)[0])
    assert not torch.equal(x, global_batch(TOKENS, 7, 8, 16, 4)[0])


def test_global_batch_windows_are_contiguous_and_y_is_shifted():
    x, y = global_batch(TOKENS, step=0, batch_size=32, seq_len=16, seed=0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = x[:, :1]
    assert torch.equal(x, starts + torch.arange(16))  # each row is a real window
    assert torch.equal(y, x + 1)
    assert int((y[:, -1]).max()) < len(TOKENS)


def test_global_batch_works_on_memmap(tmp_path):
    TOKENS.tofile(tmp_path / "t.bin")
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    a = global_batch(mm, 5, 4, 8, 1)
    b = global_batch(TOKENS, 5, 4, 8, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_global_batch_too_short():
    with pytest.raises(ValueError, match=r"model\.seq_len"):
        global_batch(TOKENS[:16], 0, 2, 16, 0)


@pytest.mark.parametrize("replicas,microbatches", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_shard_batch_reassembles_exactly(replicas, microbatches):
    x, y = global_batch(TOKENS, step=1, batch_size=16, seq_len=8, seed=0)
    shards = shard_batch(x, y, replicas, microbatches)
    assert len(shards) == replicas and all(len(r) == microbatches for r in shards)
    per = 16 // (replicas * microbatches)
    assert all(mx.shape == my.shape == (per, 8) for r in shards for mx, my in r)
    assert torch.equal(torch.cat([mx for r in shards for mx, _ in r]), x)
    assert torch.equal(torch.cat([my for r in shards for _, my in r]), y)
    # replica r owns the contiguous rows r*B/D : (r+1)*B/D
    for r, row in enumerate(shards):
        lo, hi = r * 16 // replicas, (r + 1) * 16 // replicas
        assert torch.equal(torch.cat([mx for mx, _ in row]), x[lo:hi])


def test_shard_batch_bad_divisibility():
    x, y = global_batch(TOKENS, step=1, batch_size=12, seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"train\.batch_size = 12.*\(8\).*\(1\)"):
        shard_batch(x, y, 8, 1)
    with pytest.raises(ValueError, match=r"train\.batch_size = 12.*\(2\).*\(4\)"):
        shard_batch(x, y, 2, 4)


def test_validation_batches_are_fixed_and_span_the_split():
    val = split_tokens(TOKENS, 0.2).val
    a = validation_batches(val, n_batches=3, batch_size=4, seq_len=16)
    b = validation_batches(val, n_batches=3, batch_size=4, seq_len=16)
    assert len(a) == 3
    for (ax, ay), (bx, by) in zip(a, b, strict=True):
        assert ax.shape == ay.shape == (4, 16)
        assert torch.equal(ax, bx) and torch.equal(ay, by)
        assert torch.equal(ax[:, 1:], ay[:, :-1])
    assert int(a[0][0][0, 0]) == int(val[0])  # first window starts at the split's start
    assert int(a[-1][1][-1, -1]) == int(val[-1])  # last window ends at the split's end
