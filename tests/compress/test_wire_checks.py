"""Receiver-side wire checks: honest payloads of every codec pass, every forgery is refused with its
reason, and a refused message becomes a quarantined stand-in instead of a crash."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshlearn.compress.codecs import Encoded, MessageContext
from meshlearn.compress.registry import CODECS, CodecConfig, build_codec
from meshlearn.compress.wire_checks import (
    WireGuard,
    check_header,
    check_payload,
    payload_layout,
)
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import DecoderConfig
from meshlearn.verify.attacks import FORGERIES, AttackConfig, build_attack

VOCAB, B, T, D = 50, 2, 6, 16
SHAPE = (B, T, D)
MODEL = DecoderConfig(vocab_size=VOCAB, d_model=D, n_head=2, seq_len=T, subspace_rank=4)
GEN = torch.Generator().manual_seed(0)
X = torch.randn(SHAPE, generator=GEN)
IDS = torch.randint(VOCAB, (B, T), generator=GEN)
CTX = MessageContext(step=5, microbatch=1, boundary=1, replica=1)  # the messages built here


def codec(name: str, **options):
    return build_codec(CodecConfig(name=name, topk=4, lowrank=4, keep=0.25, **options), MODEL)


def honest(name: str, kind: str, ctx: MessageContext = CTX, **options) -> Encoded:
    return codec(name, **options).encode(X, kind, IDS, ctx)


def check(name: str, kind: str, payload: Encoded, max_bytes: int | None = None) -> str | None:
    layout = payload_layout(codec(name), kind, SHAPE, ctx=CTX)
    return check_payload(payload, layout, VOCAB, layout.wire_bytes if max_bytes is None else max_bytes)


def forged(forgery: str, payload: Encoded) -> Encoded:
    message = Message("act", 1, 0, WorkerId(1, 1), WorkerId(1, 2), payload)
    return build_attack(forgery, AttackConfig(kind=forgery), seed=0).forge(message).payload


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("kind", ["act", "grad"])
def test_honest_payloads_of_every_codec_pass(name, kind):
    payload = honest(name, kind)
    assert payload_layout(codec(name), kind, SHAPE, ctx=CTX).wire_bytes == payload.wire_bytes  # exact
    assert check(name, kind, payload) is None


def context(kind: str, step: int, microbatch: int) -> MessageContext:
    """The receiver r1s2's context of a message from r1s1 (boundary 1)."""
    return MessageContext(step, microbatch, boundary=1, replica=1)


def test_a_bernoulli_mask_message_is_checked_against_its_own_mask():
    """The Bernoulli form's size depends on the message: the guard derives each layout from the
    message's own context, so an honest one passes and one sized for another microbatch does not."""
    guard = WireGuard(codec("mask", mask="bernoulli"), T, D, VOCAB)
    payload = honest("mask", "act", mask="bernoulli")
    message = Message("act", 5, 1, WorkerId(1, 1), WorkerId(1, 2), payload)
    assert guard.admit(message, 5, B, {0, 1}, context) is message
    other = honest("mask", "act", MessageContext(5, 0, 1, 1), mask="bernoulli")
    sizes = payload.tensors["values"].numel(), other.tensors["values"].numel()
    assert sizes[0] != sizes[1]  # these two masks keep different counts
    out = guard.admit(dataclasses.replace(message, payload=other), 5, B, {0, 1}, context)
    assert out.skip and guard.pop_rejections()[0].reason == (
        f"oversized: {2 * sizes[1]} bytes, budget {2 * sizes[0]}" if sizes[1] > sizes[0]
        else f"shape: values is ({sizes[1]},), expected ({sizes[0]},)")


@pytest.mark.parametrize("forgery,name,reason", [
    ("forge_ids", "subspace", "index: ids in [-1, 32767], allowed [0, 50)"),
    ("forge_ids", "topk", "index: index in [-1, 32767], allowed [0, 16)"),
    ("forge_shape", "identity", "shape: values is (1, 6, 16), expected (2, 6, 16)"),
    ("forge_shape", "int8", "shape: q is (11, 16), expected (12, 16)"),
    ("forge_dtype", "bf16", "dtype: values is torch.int16, expected torch.bfloat16"),
    ("forge_dtype", "subspace", "dtype: coeffs is torch.int16, expected torch.bfloat16"),
    ("forge_nonfinite", "identity", "nonfinite: values has 2 non-finite values"),
    ("forge_nonfinite", "int4", "nonfinite: scale has 2 non-finite values"),
    ("forge_oversize", "identity", "oversized: 8448 bytes, budget 768"),
    ("forge_oversize", "subspace", "oversized:"),
])
def test_every_forgery_is_rejected_with_its_reason(forgery, name, reason):
    payload = forged(forgery, honest(name, "act"))
    assert check(name, "act", payload).startswith(reason)


def test_forged_ids_crash_an_unchecked_receiver():
    """Why the check exists: the subspace codec indexes its table with whatever ids it is sent."""
    payload = forged("forge_ids", honest("subspace", "act"))
    with pytest.raises(IndexError):
        codec("subspace").decode(payload, "act")


def test_header_lies_and_missing_fields_are_rejected():
    payload = honest("int8", "act")
    wrong_header = Encoded(payload.tensors, (B, T + 1, D), payload.dtype)
    reason = check("int8", "act", wrong_header, max_bytes=10**6)
    assert reason == f"shape: header (2, 7, 16), expected {SHAPE}"
    missing = Encoded({"q": payload.tensors["q"]}, SHAPE, payload.dtype)
    assert check("int8", "act", missing).startswith("fields: ['q'], expected ['q', 'scale']")
    assert check("int8", "grad", Encoded({"q": [1, 2]}, SHAPE, payload.dtype)).startswith("malformed")
    sub = honest("subspace", "act")
    other_basis = Encoded(sub.tensors, sub.shape, sub.dtype, {"version": "someone else's U"})
    assert check("subspace", "act", other_basis).startswith("meta: version = \"someone else's U\"")


def test_the_header_belongs_to_the_receivers_step_and_microbatches():
    message = Message("grad", 3, 1, WorkerId(0, 2), WorkerId(0, 1), honest("identity", "grad"))
    assert check_header(message, 3, {0, 1}) is None
    assert check_header(message, 4, {0, 1}) == "stale step: message for step 3, receiver at step 4"
    assert check_header(message, 3, {0}) == "microbatch: 1 is not one of this step's [0]"
    assert check_header(message, 3, {0, 1}, sender=WorkerId(0, 2)) is None
    assert check_header(message, 3, {0, 1}, sender=WorkerId(1, 2)) == (
        "route: claims to come from r0s2, sent by r1s2")
    assert check_header(message, 3, {0, 1}, WorkerId(0, 2), carries="grad") is None
    assert check_header(message, 3, {0, 1}, WorkerId(0, 2), carries="act") == (
        "route: a 'grad' on a link that carries 'act'")


def test_a_stand_in_for_a_message_that_lies_about_its_kind_is_of_the_link_s_kind():
    guard = WireGuard(codec("identity"), T, D, VOCAB)
    lie = Message("grad", 5, 1, WorkerId(1, 1), WorkerId(1, 2), honest("identity", "act"))
    out = guard.admit(lie, 5, B, {0, 1}, context, sender=WorkerId(1, 1), carries="act")
    assert (out.kind, out.src, out.skip) == ("act", WorkerId(1, 1), True)
    [rejection] = guard.pop_rejections()
    assert (rejection.kind, rejection.src) == ("act", WorkerId(1, 1))
    assert rejection.reason == "route: a 'grad' on a link that carries 'act'"


def test_a_stand_in_for_a_message_that_claims_another_sender_names_the_real_one():
    guard = WireGuard(codec("identity"), T, D, VOCAB)
    claim = Message("act", 5, 1, WorkerId(0, 1), WorkerId(1, 2), honest("identity", "act"))
    out = guard.admit(claim, 5, B, {0, 1}, context, sender=WorkerId(1, 1))
    assert (out.src, out.skip) == (WorkerId(1, 1), True)
    [rejection] = guard.pop_rejections()
    assert rejection.src == WorkerId(1, 1)
    assert rejection.reason == "route: claims to come from r0s1, sent by r1s1"


@pytest.mark.parametrize("name", ["identity", "subspace", "int8", "mask"])
def test_the_guard_turns_a_forged_message_into_a_quarantined_stand_in(name):
    guard = WireGuard(codec(name), T, D, VOCAB)
    honest_message = Message("act", 5, 1, WorkerId(1, 1), WorkerId(1, 2), honest(name, "act"))
    assert guard.admit(honest_message, 5, B, {0, 1}, context) is honest_message
    assert guard.rejections == []
    stale = dataclasses.replace(honest_message, step=2)
    out = guard.admit(stale, 5, B, {0, 1}, context)
    assert (out.step, out.microbatch, out.kind, out.skip) == (5, 1, "act", True)
    assert guard.admit(out, 5, B, {0, 1}, context) is out  # the stand-in is an honest-looking payload ...
    zeros = codec(name).decode(guard.neutral("act", SHAPE, CTX), "act", CTX)  # (plus the table)
    assert not codec(name).decode(out.payload, "act", CTX).sub(zeros).any()  # ... of zeros
    [record] = [r.record() for r in guard.pop_rejections()]
    assert record == {"kind": "wire_reject", "step": 6, "microbatch": 1, "message": "act", "src": "r1s1",
                      "dst": "r1s2", "reason": "stale step: message for step 2, receiver at step 5"}
    assert guard.pop_rejections() == []


def test_every_forgery_has_a_case_here():
    cases = {"forge_ids", "forge_shape", "forge_dtype", "forge_nonfinite", "forge_oversize", "forge_stale",
             "forge_src", "forge_kind"}
    assert set(FORGERIES) == cases  # forge_stale, forge_src and forge_kind are header lies: the guard above
