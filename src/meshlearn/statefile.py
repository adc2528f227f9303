"""Nested training state as one safetensors file: tensors as tensors, everything else as JSON.

Checkpoints, protocol snapshots, a banned worker's donor state and a joiner's healing state used
to travel as ``torch.save`` pickles, and a pickle executes code when it is loaded: a run folder
from someone else, or a peer's bytes, could run anything. Here a state (dicts, lists, tuples,
sets of tensors, numpy arrays, ints, floats, bools, strings, bytes, None) becomes a safetensors
file: every tensor under a flat key (``t0``, ``t1``, ...), the tree around them as JSON in the
file's metadata (``meshlearn.tree``), where each tensor is a reference to its key. Reading parses
only the safetensors header (JSON, its length checked against ``max_header`` before it is read)
and the tensors' raw bytes; nothing in the file can name a Python type to construct.

What JSON cannot say directly is tagged: ``{"__t": "tuple", "v": [...]}`` (``random.getstate()``
must come back a tuple), ``"set"``, ``"map"`` (a dict with keys that are not all strings, like an
optimizer's ``state`` keyed by parameter index), ``"tensor"`` (key, device), ``"ndarray"`` and
``"bytes"`` (both a uint8 tensor underneath). A numpy scalar is stored as the Python number it
equals. Anything else is refused when written (a ``TypeError`` naming its place in the tree): a
new kind of state is added here, on purpose, never pickled by default.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from meshlearn.atomic import atomic_write_bytes
from meshlearn.errors import ConfigError

FORMAT = "meshlearn-state/1"
FORMAT_KEY = "meshlearn.format"
TREE_KEY = "meshlearn.tree"
TAG = "__t"
MAX_HEADER = 64 << 20  # bytes of safetensors header (tensor table + the JSON tree) read at most
LENGTH = struct.Struct("<Q")  # a safetensors file starts with its header's length


class CheckpointError(ConfigError):
    """A state file (or a peer's state bytes) that cannot be used: names the source and why."""

    def __init__(self, path: Path | str, why: str):
        ValueError.__init__(self, f"{path}: {why}")
        self.key = str(path)


# --- writing ---------------------------------------------------------------------------------


class _Encoder:
    """Walks a state once: the JSON tree, and the tensors it refers to by key."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.storages: set[tuple[str, int]] = set()

    def tensor(self, t: torch.Tensor) -> dict:
        key = f"t{len(self.tensors)}"
        device = str(t.device)
        # The memory layout too (a QR's column-major Q): a resumed run multiplies the same strides,
        # or it rounds differently. A dense layout is stored as the permutation that makes it
        # contiguous; a view with gaps becomes contiguous.
        order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
        flat = t.detach().to("cpu").permute(order)
        if not flat.is_contiguous():
            order, flat = list(range(t.dim())), t.detach().to("cpu").contiguous()
        storage = (str(flat.device), flat.untyped_storage().data_ptr())
        if storage in self.storages or flat.data_ptr() != storage[1] or \
                flat.nbytes != flat.untyped_storage().nbytes():
            flat = flat.clone()  # safetensors refuses tensors that share memory with another
        self.storages.add((str(flat.device), flat.untyped_storage().data_ptr()))
        self.tensors[key] = flat
        node = {TAG: "tensor", "k": key, "device": device}
        return node if order == sorted(order) else node | {"order": order}

    def node(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)):  # an IntEnum or a numpy float64 as the number it is
            return int(value) if isinstance(value, int) else float(value)
        if isinstance(value, np.generic):
            return self.node(value.item(), where)
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, torch.dtype):  # a payload's dtype (a forgery's kept messages)
            return {TAG: "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, np.ndarray):
            return {TAG: "ndarray", "v": self.tensor(torch.from_numpy(np.ascontiguousarray(value)))}
        if isinstance(value, bytes):  # a blob (the verifier's state in rank 0's shard): raw, not JSON
            raw = torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else \
                torch.empty(0, dtype=torch.uint8)  # frombuffer refuses an empty buffer
            return {TAG: "bytes", "v": self.tensor(raw)}
        if isinstance(value, list):
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {TAG: "tuple", "v": [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, (set, frozenset)):
            return {TAG: "set", "v": [self.node(v, f"{where}{{}}") for v in value]}
        if isinstance(value, dict):
            if all(type(k) is str for k in value) and TAG not in value:
                return {k: self.node(v, f"{where}.{k}") for k, v in value.items()}
            return {TAG: "map", "v": [[self.node(k, f"{where} key"), self.node(v, f"{where}[{k!r}]")]
                                      for k, v in value.items()]}
        raise TypeError(f"state{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
                        "stored (meshlearn.statefile stores tensors, arrays, dtypes, numbers, strings, "
                        "bytes, None and lists/tuples/sets/dicts of them)")


def encode_state(state: Any) -> bytes:
    """``state`` as the bytes of one safetensors file (``decode_state`` reads it back)."""
    encoder = _Encoder()
    tree = encoder.node(state, "")
    metadata = {FORMAT_KEY: FORMAT, TREE_KEY: json.dumps(tree, separators=(",", ":"))}
    return safetensors.torch.save(encoder.tensors, metadata=metadata)


def save_state(path: Path, state: Any) -> Path:
    """Write ``state`` to ``path`` atomically (a temporary file, fsynced, renamed over it)."""
    return atomic_write_bytes(path, encode_state(state))


# --- reading ---------------------------------------------------------------------------------


def _what_it_is(head: bytes) -> str:
    """A guess at a refused file's format, for the one line that refuses it."""
    if head.startswith(b"PK\x03\x04"):
        return "a torch.save zip (a pickle: checkpoints of older meshlearn versions; the format changed " \
               "and pickles are never loaded)"
    if head[:1] == b"\x80":
        return "a pickle (never loaded)"
    return "not a safetensors file"


def check_header(head: bytes, size: int, source: Path | str, max_header: int) -> None:
    """Refuse ``head`` (a file's first bytes, at least 9 of them) unless it starts a safetensors
    file whose header fits in ``size`` bytes and in ``max_header``; before anything is parsed."""
    if len(head) < LENGTH.size + 1:
        raise CheckpointError(source, f"{size} bytes: too short for a meshlearn state file ({FORMAT})")
    (length,) = LENGTH.unpack_from(head)
    if length > max_header or head[LENGTH.size:LENGTH.size + 1] != b"{":
        raise CheckpointError(source, f"not a meshlearn state file ({FORMAT}, safetensors with a header "
                                      f"of at most {max_header} bytes): {_what_it_is(head)}")
    if LENGTH.size + length > size:
        raise CheckpointError(source, f"truncated: its header alone is {length} bytes, the whole is {size}")


def _decode(tree: Any, tensors: dict[str, torch.Tensor], used: set[str], device, source) -> Any:
    if isinstance(tree, list):
        return [_decode(v, tensors, used, device, source) for v in tree]
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag is None:
        return {k: _decode(v, tensors, used, device, source) for k, v in tree.items()}
    if tag == "tensor":
        key = tree.get("k")
        if key not in tensors or key in used:
            raise CheckpointError(source, f"the tree refers to tensor {key!r}, which the file "
                                          f"{'refers to twice' if key in used else 'does not hold'}")
        used.add(key)
        read = _laid_out(tensors[key], tree.get("order"), source)
        moved = read.to(device if device is not None else _device(tree.get("device"), source))
        # safetensors' tensors view its immutable input buffers: a state is trained on, so own it.
        return moved.clone() if moved.numel() and moved.data_ptr() == read.data_ptr() else moved
    v = tree.get("v")
    if tag == "ndarray":
        return _decode(v, tensors, used, "cpu", source).numpy()
    if tag == "bytes":
        return _decode(v, tensors, used, "cpu", source).numpy().tobytes()
    if tag == "dtype":
        dtype = getattr(torch, v, None) if isinstance(v, str) and v.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(source, f"a dtype named {str(v)[:40]!r}, which torch does not have")
        return dtype
    if tag in ("tuple", "set", "map") and isinstance(v, list):
        items = [_decode(x, tensors, used, device, source) for x in v]
        if tag == "tuple":
            return tuple(items)
        if tag == "set":
            return set(items)
        if all(isinstance(kv, list) and len(kv) == 2 for kv in items):
            return {_key(k): value for k, value in items}
    raise CheckpointError(source, f"a node tagged {str(tag)[:40]!r} that this version does not read")


def _laid_out(t: torch.Tensor, order: Any, source) -> torch.Tensor:
    """``t`` (stored contiguous in ``order``) with the strides it was saved with."""
    if order is None:
        return t
    if not isinstance(order, list) or sorted(order) != list(range(t.dim())):
        raise CheckpointError(source, f"a tensor of {t.dim()} dimensions laid out as {str(order)[:40]}")
    return t.permute([order.index(i) for i in range(t.dim())])


def _key(k: Any) -> Any:
    """A dict key as it was: a decoded list can only have been a tuple (a list is not hashable)."""
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


def _device(name: Any, source) -> torch.device:
    try:
        return torch.device(str(name))
    except RuntimeError:
        raise CheckpointError(source, f"a tensor on device {str(name)[:40]!r}") from None


def _from_parts(metadata: dict[str, str] | None, tensors: dict[str, torch.Tensor], source, device) -> Any:
    metadata = metadata or {}
    if metadata.get(FORMAT_KEY) != FORMAT or TREE_KEY not in metadata:
        raise CheckpointError(source, f"a safetensors file, but not a meshlearn state ({FORMAT}): its "
                                      f"metadata has {sorted(metadata)[:5]}")
    try:
        tree = json.loads(metadata[TREE_KEY])
        used: set[str] = set()
        state = _decode(tree, tensors, used, device, source)
    except (ValueError, TypeError, RuntimeError, RecursionError) as err:  # RecursionError: nesting
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(source, f"its state tree does not decode ({type(err).__name__}: "
                                      f"{str(err)[:120]})") from None
    return state


def decode_state(data: bytes, source: str, max_bytes: int, device=None, max_header: int = MAX_HEADER) -> Any:
    """The state ``encode_state`` wrote, from bytes another process sent. ``max_bytes`` bounds the
    whole message (the caller knows what size to expect); ``device``: where every tensor goes
    (None: where it was)."""
    if len(data) > max_bytes:
        raise CheckpointError(source, f"{len(data)} bytes, more than the {max_bytes} expected")
    check_header(data[:LENGTH.size + 1], len(data), source, max_header)
    try:
        tensors = safetensors.torch.load(data)  # checks the header's tensor table against the bytes
    except Exception as err:  # noqa: BLE001 — safetensors raises its own SafetensorError
        raise CheckpointError(source, f"truncated or damaged: not a valid safetensors file "
                                      f"({str(err).strip()[:120]})") from None
    (length,) = LENGTH.unpack_from(data)
    header = json.loads(data[LENGTH.size:LENGTH.size + length])  # valid: safetensors just parsed it
    return _from_parts(header.get("__metadata__"), tensors, source, device)


def load_state(path: Path, device=None, max_header: int = MAX_HEADER) -> Any:
    """The state ``save_state`` wrote to ``path``; ``CheckpointError`` (one line) for anything else:
    a pickle, a truncated file, another safetensors file. ``device`` as in ``decode_state``. The
    file is read whole (not memory-mapped): a tensor never changes, or faults, when the file does."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            check_header(f.read(LENGTH.size + 1), size, path, max_header)
            f.seek(0)
            data = f.read()
    except OSError as err:
        raise CheckpointError(path, f"cannot be read ({err.strerror})") from None
    return decode_state(data, str(path), len(data), device, max_header)
