"""What ``meshlearn train`` checks before it makes a run folder, beyond config validation: input
files that cannot work (refused with the path, what is wrong and what is allowed), and settings
that are valid for the library but certainly a mistake in a user's run."""

from __future__ import annotations

import sys
from pathlib import Path

from meshlearn.config import RunConfig
from meshlearn.data import is_token_file
from meshlearn.errors import ConfigError

SNIFF_BYTES = 1 << 20  # the first MiB says whether a file is text
BINARY_SHARE = 0.05  # refuse above this share of undecodable (or NUL) bytes; warn above 0


def undecodable_share(data: bytes) -> float:
    """The share of ``data``'s bytes that are not UTF-8 text (invalid sequences or NUL)."""
    if not data:
        return 0.0
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") + text.count("\x00")
    if len(data) == SNIFF_BYTES:  # a cut multi-byte character at the end is not damage
        bad = max(0, bad - 3)
    return min(1.0, bad / len(data))


def check_corpus(cfg: RunConfig, warn=None) -> None:
    """Refuse an empty corpus file, a ``.bin`` of odd length, or a binary file as a text corpus."""
    warn = warn or (lambda text: print(f"meshlearn: warning: {text}", file=sys.stderr))
    corpus = cfg.data.corpus
    if corpus == "shakespeare":
        return
    path = Path(corpus).expanduser()
    if not path.is_file():
        return  # a folder (or missing: config validation names it)
    size = path.stat().st_size
    need = cfg.model.seq_len + 1
    if size == 0:
        raise ConfigError("data.corpus", corpus, f"the file is empty; a corpus needs at least "
                                                 f"model.seq_len + 1 = {need} tokens in each split")
    if is_token_file(corpus):
        if size % 2:
            raise ConfigError("data.corpus", corpus, f"{size} bytes: a .bin token file holds uint16 "
                                                     "token ids (2 bytes each), so its size must be even")
        return
    with path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    share = undecodable_share(head)
    if share > BINARY_SHARE:
        raise ConfigError("data.corpus", corpus,
                          f"looks binary: {share:.1%} of its first {len(head):,} bytes are not UTF-8 "
                          "text; give a text file, a folder of .txt/.md files, or a uint16 .bin "
                          "token file")
    if share > 0:
        warn(f"data.corpus = {corpus!r}: {share:.2%} of its first {len(head):,} bytes are not UTF-8 "
             "text; they are read as U+FFFD")


def check_run(cfg: RunConfig) -> None:
    """Settings a library caller may want (a test of the warm-up alone) but a run never does."""
    if cfg.verify.name != "none" and cfg.verify.warmup_steps >= cfg.train.steps:
        raise ConfigError("verify.warmup_steps", cfg.verify.warmup_steps,
                          f"must be < train.steps = {cfg.train.steps}: {cfg.verify.name} only observes "
                          "during its warm-up, so it would never act; lower it or train longer")
