"""Cluster checkpoints on one machine: two hosts' folders, four workers in threads meeting on a real
TCPStore (as they do on the rendezvous). Complete only by agreement, pruned only by agreement,
resumed from the newest agreed checkpoint every worker holds intact."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from in_threads import in_threads

from meshlearn.cluster.checkpoints import AGREED, HOST_MANIFEST, ClusterCheckpoint, StoreWaits
from meshlearn.statefile import CheckpointError

PLACED = {"alice": ["r0s0", "r1s1"], "bob": ["r0s1", "r1s0"]}
HOST_OF = {w: h for h, ws in PLACED.items() for w in ws}


class Healthy:
    def check(self) -> None:
        pass


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    yield server


def _stores(tmp_path: Path, store, keep: int, prefix: str) -> dict[str, ClusterCheckpoint]:
    waits = StoreWaits(dist.PrefixStore(prefix, store), Healthy())
    return {w: ClusterCheckpoint(tmp_path / h, w, h, PLACED[h], PLACED, "alice", waits, 10.0, 10.0, keep)
            for w, h in HOST_OF.items()}


def _save(stores: dict[str, ClusterCheckpoint], steps: list[int]) -> None:
    for step in steps:
        in_threads(lambda w, step=step: stores[w].save(step, {"totals": {"step": step}},
                                                       {"workers": {w: {"step": step, "who": w}}}), stores)


def _resume(stores: dict[str, ClusterCheckpoint]) -> dict[str, int]:
    loaded = in_threads(lambda w: stores[w].load(), stores)
    return {w: common["totals"]["step"] for w, (common, _) in loaded.items()}


def test_each_host_keeps_its_own_shards_and_prunes_only_by_agreement(tmp_path, store):
    _save(_stores(tmp_path, store, keep=2, prefix="run1/"), [1, 2, 3])
    for host, workers in PLACED.items():
        root = tmp_path / host / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
        assert sorted(p.name for p in (root / "step-000003").iterdir()) == sorted(
            [f"{w}.pt" for w in workers] + [AGREED, HOST_MANIFEST])
    assert _resume(_stores(tmp_path, store, keep=2, prefix="resume1/")) == dict.fromkeys(HOST_OF, 3)


def test_resume_takes_the_newest_checkpoint_every_worker_holds(tmp_path, store):
    _save(_stores(tmp_path, store, keep=2, prefix="run2/"), [1, 2])
    # bob died after the coordinator agreed on step 2 but before it recorded the agreement: its
    # shards are intact and the coordinator's record stands
    (tmp_path / "bob" / "checkpoints" / "step-000002" / AGREED).unlink()
    assert _resume(_stores(tmp_path, store, keep=2, prefix="resume2/")) == dict.fromkeys(HOST_OF, 2)
    # a shard of step 2 cut short on bob: step 1 is the newest that every worker holds
    shard = tmp_path / "bob" / "checkpoints" / "step-000002" / "r1s0.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert _resume(_stores(tmp_path, store, keep=2, prefix="resume3/")) == dict.fromkeys(HOST_OF, 1)


def test_a_changed_shard_of_the_chosen_checkpoint_is_refused(tmp_path, store):
    _save(_stores(tmp_path, store, keep=1, prefix="run4/"), [1])
    shard = tmp_path / "alice" / "checkpoints" / "step-000001" / "r1s1.pt"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    stores = _stores(tmp_path, store, keep=1, prefix="resume4/")
    errors = in_threads(lambda w: _error(lambda: stores[w].load()), stores)
    assert errors["r1s1"] is not None and "checksum differs" in errors["r1s1"]
    assert all(errors[w] is None for w in ("r0s0", "r0s1", "r1s0"))


def _error(call) -> str | None:
    try:
        call()
    except CheckpointError as err:
        return str(err)
    return None
