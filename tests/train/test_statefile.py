"""meshlearn/statefile.py: every kind of state a run writes comes back identical, and nothing that
is not the format (a pickle above all) is ever parsed beyond its first bytes."""

from __future__ import annotations

import copy
import pickle
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_config

from meshlearn.checkpoint_layout import CHECKPOINT
from meshlearn.distributed.verdict_board import blob_state, state_blob
from meshlearn.elastic.heal_transport import StateTransport
from meshlearn.entry.cli import main
from meshlearn.protocol.snapshots import load_snapshot
from meshlearn.statefile import (
    MAX_HEADER,
    CheckpointError,
    decode_state,
    encode_state,
    load_state,
    save_state,
)
from meshlearn.train import Trainer
from meshlearn.train.checkpoint import load_run_state


def same(a, b, where: str = "state") -> None:
    """``b`` is ``a``: the same types (a numpy scalar comes back as the number it equals), the same
    keys in the same order, bit-identical tensors and arrays with the same memory layout."""
    if isinstance(a, np.generic):
        assert b == a.item() and type(b) is type(a.item()), where
        return
    kind = dict if isinstance(a, dict) else type(a)  # an OrderedDict (a state_dict) as a dict: in order
    assert kind is type(b), f"{where}: {type(a).__name__} came back as {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert a.stride() == b.stride() or not a.is_contiguous() and b.is_contiguous(), where  # layout
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} came back as {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


def every_kind() -> dict:
    """One of each kind of value the writers hand over (the types found in real checkpoints and
    a few more: a view that shares memory, a zero-size tensor, a non-finite float)."""
    param = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3, 4)
    optimizer.step()
    rng = random.Random(1)
    return {
        "optimizer": optimizer.state_dict(),  # a dict keyed by int, a tuple of betas
        "torch_rng": torch.random.get_rng_state(),
        "python_rng": rng.getstate(),  # (3, a tuple of 625 ints, None): setstate needs the tuple
        "array": np.arange(6, dtype=np.float32).reshape(2, 3), "scalar": np.float64(0.5),
        "count": np.int64(7), "keys": {(0, 1): "a", 3: [1, 2]}, "set": {4, 5}, "blob": b"\x00\xff",
        "no_bytes": b"",
        "row": param.data[1], "whole": param.data, "empty": torch.empty(0, 5), "nan": float("nan"),
        "column_major": torch.linalg.qr(torch.randn(5, 3, generator=torch.Generator().manual_seed(2)))[0],
        "gaps": torch.arange(10.0)[::2],
        "inf": -float("inf"), "dtypes": [torch.ones(2, dtype=d) for d in
                                         (torch.bfloat16, torch.float16, torch.int8, torch.bool)],
        "tag": {"__t": "tuple", "v": [1]},  # a plain dict that looks like a tagged node
        "nested": [None, True, 1, 2.5, "s", ()],
        "payload_dtypes": (torch.float32, torch.bfloat16),  # a forgery keeps its messages' dtypes
    }


def test_every_kind_of_value_round_trips(tmp_path):
    state = every_kind()
    same(state, decode_state(encode_state(state), "bytes", 1 << 30))
    same(state, load_state(save_state(tmp_path / "s.pt", state)))
    back = load_state(tmp_path / "s.pt")
    random.Random().setstate(back["python_rng"])
    torch.random.set_rng_state(back["torch_rng"])
    param = torch.nn.Parameter(torch.zeros(3, 4))
    torch.optim.AdamW([param]).load_state_dict(back["optimizer"])


def test_a_value_of_another_kind_is_refused_when_written_naming_where():
    with pytest.raises(TypeError, match=r"state\.a\[0\]: a pathlib.*PosixPath cannot be stored"):
        encode_state({"a": [Path("x")]})


def test_loaded_tensors_are_their_own_memory(tmp_path):
    path = save_state(tmp_path / "s.pt", {"w": torch.ones(4)})
    w = load_state(path)["w"]
    w.add_(1)  # the optimizer trains on them in place
    path.write_bytes(b"\0" * path.stat().st_size)  # not a memory map of the file either
    assert torch.equal(w, torch.full((4,), 2.0))


# --- a real run's checkpoint ---------------------------------------------------------------------

RUNS = {
    "pipeline": ["mesh.stages=2", "mesh.replicas=2", "mesh.schedule=async", "optim.name=muon"],
    "diloco": ["mesh.stages=2", "mesh.replicas=2", "dp.name=diloco", "dp.inner_steps=2",
               "dp.compress=powersgd", "dp.rank=2"],
    "sparse": ["mesh.stages=2", "mesh.replicas=2", "dp.name=sparse", "optim.name=nadamw"],
    "sentinel": ["mesh.stages=2", "mesh.replicas=2", "verify.name=sentinel"],
    "protocol": ["mesh.stages=2", "protocol.morph=orthogonal", "protocol.every_steps=2", "optim.name=muon"],
    "anchor": ["mesh.stages=2", "mesh.replicas=2", "codec.name=mask", "codec.keep=0.25",
               "optim.spectral.enabled=true", "anchor.z=1", "anchor.delay=3", "anchor.send=factors",
               "anchor.weights=outer", "anchor.rank=3"],
    "warmup": ["mesh.stages=2", "warmup.enabled=true", "curvature.every=1", "curvature.iters=2",
               "curvature.batch_size=2"],
}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_a_real_runs_checkpoint_comes_back_equal(tiny_corpus, tmp_path, kind):
    trainer = Trainer(tiny_config(tiny_corpus, *RUNS[kind], "train.steps=4", "train.checkpoint_every=2"),
                      tmp_path / "run", progress=False)
    written = []
    save = trainer.checkpoints.save

    def keep(step, common, shard):
        written.append(copy.deepcopy(common | shard))  # as handed over, before training goes on
        return save(step, common, shard)

    trainer.checkpoints.save = keep
    trainer.train()
    assert written and written[-1]["totals"]["step"] == 4
    same(written[-1], load_run_state(tmp_path / "run"))


# --- nothing else is parsed ---------------------------------------------------------------------


class WritesMarker:
    """A pickle that would create ``path`` when loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "executed"))


@pytest.fixture
def trained(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_corpus, "mesh.stages=2", "train.steps=2", "train.checkpoint_every=1"),
            run, progress=False).train()
    return run


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_pickle_where_a_checkpoint_should_be_is_refused_unexecuted(capsys, trained, tmp_path, how):
    marker = tmp_path / "marker"
    for name in (CHECKPOINT, "checkpoint.prev.pt"):
        payload = {"config": {}, "totals": {}, "workers": WritesMarker(marker)}
        if how == "torch.save":
            torch.save(payload, trained / name)
        else:
            (trained / name).write_bytes(pickle.dumps(payload))
    (trained / "checkpoint.json").unlink()
    for command in (["train", "--resume", str(trained)], ["sample", str(trained)]):
        assert main(command) != 0
        err = capsys.readouterr().err.strip()
        assert "pickle" in err and "never loaded" in err and len(err.splitlines()) == 1, err
    with pytest.raises(CheckpointError, match="pickle"):
        load_snapshot(trained / CHECKPOINT)
    with pytest.raises(CheckpointError, match="pickle"):
        blob_state(torch.frombuffer(bytearray(pickle.dumps(WritesMarker(marker))), dtype=torch.uint8),
                   "a peer", 1 << 20)
    assert not marker.exists()


@pytest.mark.parametrize("data, why", [
    (struct.pack("<Q", MAX_HEADER + 1) + b"{" + b" " * 64, "header of at most"),
    (struct.pack("<Q", 1 << 62) + b"{}", "header of at most"),
    (struct.pack("<Q", 40) + b"{}", "truncated"),
    (struct.pack("<Q", 4) + b"{!!}", "truncated or damaged"),
    (b"\x01\x00", "too short"),
    (b"hello, this is text", "not a safetensors file"),
])
def test_an_oversized_or_garbage_header_is_refused_in_one_line(tmp_path, data, why):
    path = tmp_path / "bad.pt"
    path.write_bytes(data)
    for read in (lambda: load_state(path), lambda: decode_state(data, str(path), 1 << 20)):
        with pytest.raises(CheckpointError, match=why) as err:
            read()
        assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_safetensors_of_something_else_and_a_bad_tree_are_refused():
    import safetensors.torch

    with pytest.raises(CheckpointError, match="not a meshlearn state"):
        decode_state(safetensors.torch.save({"w": torch.ones(1)}), "foreign", 1 << 20)
    forged = safetensors.torch.save({"t0": torch.ones(1)}, metadata={
        "meshlearn.format": "meshlearn-state/1", "meshlearn.tree": '{"a": {"__t": "tensor", "k": "t9"}}'})
    with pytest.raises(CheckpointError, match="does not hold"):
        decode_state(forged, "forged", 1 << 20)
    unknown = safetensors.torch.save({}, metadata={
        "meshlearn.format": "meshlearn-state/1", "meshlearn.tree": '{"__t": "object", "v": "os.system"}'})
    with pytest.raises(CheckpointError, match="tagged 'object'"):
        decode_state(unknown, "forged", 1 << 20)
    for name in ("os.system", "Tensor", "manual_seed"):  # a dtype node names a dtype, nothing else
        not_a_dtype = safetensors.torch.save({}, metadata={
            "meshlearn.format": "meshlearn-state/1", "meshlearn.tree": f'{{"__t": "dtype", "v": "{name}"}}'})
        with pytest.raises(CheckpointError, match="which torch does not have"):
            decode_state(not_a_dtype, "forged", 1 << 20)
    deep = safetensors.torch.save({}, metadata={
        "meshlearn.format": "meshlearn-state/1", "meshlearn.tree": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(CheckpointError, match="does not decode"):
        decode_state(deep, "forged", 1 << 20)


def test_a_peers_blob_beyond_its_bound_is_refused():
    blob = state_blob({"w": torch.ones(100)})
    same({"w": torch.ones(100)}, blob_state(blob, "r0s1's state", blob.numel()))
    with pytest.raises(CheckpointError, match=r"r0s1's state: \d+ bytes, more than the 100 expected"):
        blob_state(blob, "r0s1's state", 100)


# --- the joiner's healing state (torchft's checkpoint transport) -------------------------------


class Loopback:
    """A process group of two ranks in one process: what rank 0 sends, rank 1 receives."""

    class Done:
        def wait(self, _timeout=None) -> bool:
            return True

    def __init__(self):
        self.sent: dict[int, list[torch.Tensor]] = {}

    def send(self, tensors, dst, tag):
        self.sent.setdefault(tag, []).append(tensors[0].clone())
        return self.Done()

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.sent[tag].pop(0))
        return self.Done()


def test_the_healing_state_crosses_without_pickle_and_within_its_bound():
    state = {"user": {"default": every_kind()}, "torchft": {"step": 3, "batches_committed": 6}}
    pg = Loopback()
    StateTransport(pg, None, lambda: 1 << 20).send_checkpoint([1], 3, state)
    same(state, StateTransport(pg, None, lambda: 1 << 20).recv_checkpoint(0, "meshlearn-state", 3))
    StateTransport(pg, None, lambda: 1 << 20).send_checkpoint([1], 3, state)
    with pytest.raises(CheckpointError, match=r"bytes announced, at most 100 accepted"):
        StateTransport(pg, None, lambda: 100).recv_checkpoint(0, "meshlearn-state", 3)
    pg.sent = {1: [torch.tensor([30])], 2: [torch.frombuffer(bytearray(pickle.dumps(0)[:30].ljust(30)),
                                                             dtype=torch.uint8)]}
    with pytest.raises(CheckpointError, match="healing state from replica rank 0"):
        StateTransport(pg, None, lambda: 1 << 20).recv_checkpoint(0, "meshlearn-state", 3)
