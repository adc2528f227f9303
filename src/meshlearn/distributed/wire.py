"""A Message on the wire: one byte buffer — a 16-byte prefix, a JSON header, then the raw tensors.

One point-to-point send per message. gloo accepts a send into a larger receive buffer, so a
receiver can post its receives before it knows the exact sizes (posted early, its "ready to
receive" is already at the sender when the message leaves, so a message costs one trip over a
real WAN, not three); the prefix says how many bytes are real. Both ends derive the receive
capacity from the config; a message larger than that goes as a 16-byte notice on the message tag
followed by the buffer on ``OVERSIZE_TAG`` (see transport.py).

The header is JSON, never pickle: a peer may be faulty or lying, and decoding its bytes must not
execute anything. A malformed header raises an error naming the peer it came from.
"""

from __future__ import annotations

import json

import torch

from meshlearn.compress.codecs import Encoded
from meshlearn.mesh.messages import ANCHOR_KINDS, Message
from meshlearn.mesh.topology import WorkerId

_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool)}


class WireError(RuntimeError):
    """Bytes from a peer that do not decode into a valid message."""


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WireError(f"dtype {dtype} cannot travel; allowed: {sorted(_DTYPES)}")
    return name


KINDS = ("act", "grad", "dp", "morph", *ANCHOR_KINDS)
PREFIX_BYTES = 16  # int64 header length, int64 body length
HEADER_ROOM = 64 * 1024  # bytes for a message's JSON header in the receive buffers


def buffer_capacities(cfg) -> tuple[int, int]:
    """Receive buffers (training, evaluation), derived from the config on both ends of a link: an
    fp32 activation plus int64 token ids per position (codecs only shrink the former) and room for
    the header; a training message holds one microbatch, an evaluation message a whole batch."""
    micro = cfg.train.batch_size // cfg.mesh.replicas // cfg.mesh.microbatches
    per_sequence = cfg.model.seq_len * (4 * cfg.model.d_model + 8)
    return (PREFIX_BYTES + HEADER_ROOM + micro * per_sequence,
            PREFIX_BYTES + HEADER_ROOM + cfg.train.batch_size * per_sequence)


def message_bound(cfg, stage_params: int) -> int:
    """The most bytes an honest message of this run can take, with room to spare: a whole batch of
    fp32 activations and int64 token ids (evaluation), a stage's parameters at 8 bytes each (a DP
    share or an anchor snapshot or gradient sends them at 4 at most), or a d × d fp64 boundary
    transform (twice). ``stage_params``: the largest stage's count among the peers this process
    hears from (0 for the verifier, whose links carry activations and gradients only). A notice
    announcing more is a lie the receiver refuses before allocating (``transport.py``)."""
    evaluation = buffer_capacities(cfg)[1]
    return max(evaluation, PREFIX_BYTES + HEADER_ROOM + max(8 * stage_params, 16 * cfg.model.d_model ** 2))


def prefix(header_len: int, body_len: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([header_len, body_len], dtype=torch.int64).view(torch.uint8).to(device)


def read_prefix(buffer: torch.Tensor) -> tuple[int, int]:
    header_len, body_len = buffer[:PREFIX_BYTES].cpu().clone().view(torch.int64).tolist()
    return header_len, body_len


def pack(message: Message, device: torch.device) -> torch.Tensor:
    """The message as one uint8 buffer on ``device``: prefix, header, tensors."""
    payload = message.payload
    tensors = []
    specs = []
    for name, t in payload.tensors.items():
        flat = t.detach().contiguous().reshape(-1)
        tensors.append(flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8))
        specs.append([name, _dtype_name(t.dtype), list(t.shape)])
    header = json.dumps({
        "kind": message.kind, "step": message.step, "microbatch": message.microbatch,
        "src": str(message.src), "dst": str(message.dst), "skip": message.skip,
        "version": message.version, "shape": list(payload.shape),
        "dtype": _dtype_name(payload.dtype), "meta": payload.meta, "tensors": specs,
    }).encode()
    if len(header) > HEADER_ROOM:  # a receiver would refuse it as a lie: fail here, honestly
        raise WireError(f"{message.kind} {message.microbatch} of step {message.step} has a "
                        f"{len(header)}-byte header ({len(specs)} tensors); a message's header may "
                        f"take {HEADER_ROOM} bytes (wire.HEADER_ROOM)")
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    body = [t.to(device) for t in tensors]
    body_len = sum(t.numel() for t in body)
    return torch.cat([prefix(len(header), body_len, device), head, *body])


def unpack(buffer: torch.Tensor, peer: WorkerId) -> Message:
    """Rebuild the Message from a received buffer (possibly longer than the message); tensors land
    on ``buffer``'s device. Any bytes that do not make a valid message raise WireError (never
    another error: torch's, on a negative dimension, or ``int``'s, on JSON's ``Infinity``), so the
    transport refuses them as a lie instead of taking them for a broken link."""
    if buffer.numel() < PREFIX_BYTES:
        raise WireError(f"malformed message from {peer}: {buffer.numel()} bytes, no prefix")
    header_len, body_len = read_prefix(buffer)
    if header_len < 0 or PREFIX_BYTES + header_len + body_len > buffer.numel():
        raise WireError(f"malformed message from {peer}: prefix claims {header_len} + {body_len} bytes "
                        f"in a buffer of {buffer.numel()}")
    buffer = buffer[PREFIX_BYTES:PREFIX_BYTES + header_len + body_len]
    try:
        header = json.loads(bytes(buffer[:header_len].cpu().numpy()))
        offset = header_len
        tensors = {}
        for name, dtype_name, shape in header["tensors"]:
            dtype = _DTYPES[dtype_name]
            numel = 1
            for d in shape:
                numel *= int(d)
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            if offset + nbytes > buffer.numel():
                raise WireError(f"tensor {name!r} runs past the end of the buffer")
            # clone: a slice at an arbitrary byte offset is not aligned for the wider dtype
            raw = buffer[offset:offset + nbytes].clone()
            tensors[name] = raw.view(dtype).reshape(shape) if nbytes else torch.empty(
                shape, dtype=dtype, device=buffer.device)
            offset += nbytes
        payload = Encoded(tensors, tuple(header["shape"]), _DTYPES[header["dtype"]], dict(header["meta"]))
        message = Message(header["kind"], int(header["step"]), int(header["microbatch"]),
                          WorkerId.parse(header["src"]), WorkerId.parse(header["dst"]), payload,
                          skip=bool(header.get("skip", False)), version=int(header.get("version", 0)))
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError, RuntimeError) as err:
        raise WireError(f"malformed message from {peer}: {type(err).__name__}: {err}") from None
    if message.src != peer or message.kind not in KINDS:
        raise WireError(f"message from {peer} claims to be a {message.kind!r} from {message.src}")
    return message
