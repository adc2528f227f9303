"""What the coordinator decides once for every machine of a cluster run, sent over the rendezvous.

- The config: every host's must be the coordinator's, except ``data.corpus`` (the corpus may sit
  at a different path on each machine). A difference stops that host with the first differing key.
- The BPE tokenizer (``data.tokenizer = "bpe"``): trained once, by the coordinator's launcher, in
  its folder; sent with its SHA-256, checked, and written into each host's folder before any worker
  starts (a resumed host checks the one it holds against the coordinator's).
- Each host other than the coordinator gets ``coordinator.json`` in its folder: where the run's
  records are (the coordinator's host and address).
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

from meshlearn.atomic import atomic_path, atomic_write_json
from meshlearn.cluster.placement import Placement
from meshlearn.config import ConfigError, RunConfig, to_dict
from meshlearn.config_diff import changed_keys

KEYS = "meshlearn-cluster"  # on the rendezvous store, beside the workers' own prefix
TOKENIZER = "tokenizer.json"
POINTER = "coordinator.json"
LOCAL_KEYS = ("data.corpus",)  # may differ between machines


def _shared_config(cfg: RunConfig) -> dict:
    tree = to_dict(cfg)
    tree["data"] = {k: v for k, v in tree["data"].items() if f"data.{k}" not in LOCAL_KEYS}
    return json.loads(json.dumps(tree))  # tuples as lists, as they come back from the store


def share_run(cfg: RunConfig, run_dir: Path, placement: Placement, store, resume: bool) -> None:
    """The coordinator publishes the config and the tokenizer; every other host checks its config
    against it, and installs (or checks) the tokenizer. Call before any worker starts."""
    run_dir = Path(run_dir)
    if placement.is_coordinator:
        store.set(f"{KEYS}/config", json.dumps(_shared_config(cfg)))
        if cfg.data.tokenizer == "bpe" and not resume:
            from meshlearn.data.corpus import load_corpus

            load_corpus(cfg, run_dir)  # trains the tokenizer into run_dir/tokenizer.json
        blob = (run_dir / TOKENIZER).read_bytes() if cfg.data.tokenizer == "bpe" else b""
        store.set(f"{KEYS}/tokenizer", blob)
        store.set(f"{KEYS}/tokenizer_sha256", hashlib.sha256(blob).hexdigest())
        return
    # the others wait (dist.init_timeout_s) for the coordinator to be up and to have decided
    store.set_timeout(timedelta(seconds=cfg.dist.init_timeout_s))
    theirs = json.loads(store.get(f"{KEYS}/config"))
    differ = changed_keys(theirs, _shared_config(cfg))
    if differ:
        key, (was, now) = next(iter(differ.items()))
        raise ConfigError(key, now, f"differs from the coordinator's ({placement.coordinator}: {was!r}); "
                                    "every machine must run the same config (only data.corpus may differ)")
    blob, digest = received_tokenizer(store)
    if blob:
        install_tokenizer(run_dir / TOKENIZER, blob, digest, resume)
    atomic_write_json(run_dir / POINTER, {
        "coordinator": placement.coordinator,
        "address": f"{placement.store_address}:{placement.store_port}",
        "what": "the run's metrics.jsonl, summary.json, workers.json and report are in the coordinator's "
                "run folder; this folder holds this machine's config, provenance, shards and logs"})


def received_tokenizer(store) -> tuple[bytes, str]:
    """The coordinator's tokenizer (empty: none) and its SHA-256, checked."""
    blob, digest = store.get(f"{KEYS}/tokenizer"), store.get(f"{KEYS}/tokenizer_sha256").decode()
    if hashlib.sha256(blob).hexdigest() != digest:
        raise ConnectionError(f"the coordinator's tokenizer arrived damaged (sha256 differs from {digest})")
    return blob, digest


def install_tokenizer(path: Path, blob: bytes, digest: str, resume: bool) -> None:
    """Write the coordinator's tokenizer (a fresh run) or check ours against it (a resume)."""
    if resume:
        ours = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        if ours != digest:
            raise ConfigError("data.tokenizer", "bpe", f"{path} (sha256 {ours}) is not the coordinator's "
                                                       f"tokenizer (sha256 {digest}): resume from this "
                                                       "machine's own folder of the same run")
        return
    with atomic_path(path) as tmp:
        tmp.write_bytes(blob)
