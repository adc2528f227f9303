"""Tokenizers: raw utf-8 bytes, or a byte-level BPE trained on the corpus in about a second.

Both are byte-level, so any text, in any language, encodes without unknown tokens.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

TOKENIZERS = ("byte", "bpe", "model")
CHUNK_CHARS = 1 << 20  # ~1 MB of text per chunk


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of meshlearn needs from a tokenizer; nothing more."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def text_chunks(text: str, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Split text into ~chunk_chars pieces, cutting just after a newline when there is one.

    HF BPE is much faster on many ~1 MB strings than on one 5 MB string (and can then use
    several threads). Cutting at a newline keeps BPE pre-tokens (which never span a newline
    followed by text) intact, so the result matches whole-text encoding in practice; a chunk
    with no newline at all is cut at chunk_chars, which is still exact for bytes.
    """
    start, n = 0, len(text)
    while start < n:
        end = min(start + chunk_chars, n)
        if end < n:
            cut = text.rfind("\n", start, end)
            if cut > start:
                end = cut + 1
        yield text[start:end]
        start = end


class ByteTokenizer:
    """One token per utf-8 byte: no training, no files, vocab of 256. The baseline."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A window can start or end inside a multi-byte character: replace, never raise.
        return bytes(ids).decode("utf-8", errors="replace")

    @staticmethod
    def as_hf() -> HFTokenizer:
        """The same tokenizer as a Hugging Face ``tokenizers`` one (id = UTF-8 byte, no BOS/EOS),
        so an exported byte-level model loads in ``transformers.AutoTokenizer``: a BPE with no
        merges over the 256 byte-level symbols, in byte order, and byte-level pre-tokenizer and
        decoder without regex splitting or a prefix space."""
        alphabet = _byte_symbols()
        tok = HFTokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok


def _byte_symbols() -> list[str]:
    """The printable symbol that byte-level (GPT-2 style) tokenizers write for each byte value:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255 in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    symbols, shift = [], 0
    for b in range(256):
        symbols.append(chr(b) if b in printable else chr(256 + shift))
        shift += b not in printable
    return symbols


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) backed by HF `tokenizers`."""

    name = "bpe"

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer

    def token_id(self, token: str) -> int | None:
        """The id of a special token such as ``<|endoftext|>``, or None if the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        # BPE stops early when the text runs out of pairs to merge, so this can be
        # smaller than the vocab_size asked for; the model must use the real number.
        return self._tok.get_vocab_size()

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Train on `text`. Deterministic: the same text and vocab_size give the same merges."""
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no <unk>
            show_progress=False,
        )
        # Chunks train twice as fast as one big string, with identical merges.
        tok.train_from_iterator(text_chunks(text), trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + os.replace): a crash never leaves a half-written file
        that a resumed run would then try to load."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            self._tok.save(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def build_tokenizer(
    name: str, text: str | None, cache_path: Path | None, vocab_size: int
) -> Tokenizer:
    """Make the tokenizer named by config field `data.tokenizer`.

    For "bpe", a cached tokenizer.json wins over training, so a resumed run (or another
    replica) gets exactly the vocabulary the checkpoint was trained with. "model" (a pretrained
    model's tokenizer) is only ever the cached file: the run saves it there when it starts.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "model":
        if cache_path is None or not Path(cache_path).is_file():
            raise FileNotFoundError(f"data.tokenizer = 'model': no tokenizer.json at {cache_path}")
        return BPETokenizer.load(cache_path)
    if name == "bpe":
        if cache_path is not None and Path(cache_path).is_file():
            return BPETokenizer.load(cache_path)
        if text is None:
            raise ValueError(
                "data.tokenizer = 'bpe' needs corpus text to train on (no cached tokenizer at "
                f"{cache_path})"
            )
        tok = BPETokenizer.train(text, vocab_size)
        if cache_path is not None:
            tok.save(cache_path)
        return tok
    raise ValueError(f"data.tokenizer = {name!r} is not supported; choose one of {TOKENIZERS}")
