import pytest

from meshlearn.data import BPETokenizer, ByteTokenizer, Tokenizer, build_tokenizer

TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
) * 20
UNSEEN = "Ça va? naïve café — 日本語 🎭\n\n\ttabs  and  spaces\n"


def test_byte_roundtrip_non_ascii():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode(UNSEEN)
    assert ids == list(UNSEEN.encode("utf-8"))
    assert max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == UNSEEN
    assert tok.decode(ids[:-2] + [0xE6]).endswith("\ufffd")  # cut mid-character: no crash


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(TEXT, vocab_size=320)


def test_bpe_trains_and_roundtrips(bpe):
    assert isinstance(bpe, Tokenizer)
    assert 256 < bpe.vocab_size <= 320
    ids = bpe.encode(TEXT)
    assert len(ids) < len(TEXT.encode("utf-8"))  # it actually merged something
    assert max(ids) < bpe.vocab_size
    assert bpe.decode(ids) == TEXT
    assert bpe.decode(bpe.encode(UNSEEN)) == UNSEEN  # byte-level: no <unk>, ever


def test_bpe_training_is_deterministic(bpe):
    again = BPETokenizer.train(TEXT, vocab_size=320)
    assert again.encode(TEXT + UNSEEN) == bpe.encode(TEXT + UNSEEN)


def test_bpe_vocab_can_be_smaller_than_requested():
    tok = BPETokenizer.train("ab ab ab\n", vocab_size=1000)
    assert tok.vocab_size < 1000


def test_bpe_save_load_identical(bpe, tmp_path):
    path = tmp_path / "run" / "tokenizer.json"
    bpe.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left
    loaded = BPETokenizer.load(path)
    assert loaded.vocab_size == bpe.vocab_size
    assert loaded.encode(TEXT + UNSEEN) == bpe.encode(TEXT + UNSEEN)


def test_build_tokenizer_caches_bpe(tmp_path):
    assert isinstance(build_tokenizer("byte", None, None, 0), ByteTokenizer)
    cache = tmp_path / "tokenizer.json"
    first = build_tokenizer("bpe", TEXT, cache, 300)
    assert cache.is_file()
    mtime = cache.stat().st_mtime_ns
    second = build_tokenizer("bpe", None, cache, 300)  # no text needed: loads the cache
    assert cache.stat().st_mtime_ns == mtime
    assert second.encode(TEXT) == first.encode(TEXT)


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data\.tokenizer.*'wordpiece'.*bpe"):
        build_tokenizer("wordpiece", TEXT, None, 300)
    with pytest.raises(ValueError, match="needs corpus text"):
        build_tokenizer("bpe", None, tmp_path / "absent.json", 300)
