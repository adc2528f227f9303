"""The anchor stage actor and the fast side's rule without any runtime: events in, actions out."""

from __future__ import annotations

import copy

import pytest
import torch

from meshlearn.anchor.actor import (
    Activation,
    AnchorStageActor,
    Await,
    Compute,
    FastSide,
    Fate,
    Gradient,
    HandOff,
    RealMath,
    Send,
    ShapeMath,
    Share,
    decode_share,
)
from meshlearn.anchor.factors import AnchorEMA
from meshlearn.mesh.compute import stage_shape
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder
from meshlearn.models.llama import DecoderConfig
from meshlearn.models.split import init_model, split_model

CFG = DecoderConfig(vocab_size=40, n_layer=3, d_model=16, n_head=2, seq_len=8)
P, D, M, ROWS = 3, 2, 2, 2  # stages, fast replicas, microbatches, rows per microbatch


def matrices(module: Decoder) -> list[str]:
    return [n for n, p in module.named_parameters() if p.ndim == 2 and n.startswith("layers.")]


def batch(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (M * ROWS, CFG.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return [(x[m * ROWS:(m + 1) * ROWS], y[m * ROWS:(m + 1) * ROWS]) for m in range(M)]


def shape_actor(stage: int) -> AnchorStageActor:
    with torch.device("meta"):
        module = split_model(Decoder(CFG), P)[stage]
    math = ShapeMath(module, matrices(module), stage, P, CFG.d_model)
    return AnchorStageActor(WorkerId(D, stage), P, D, math, torch.bfloat16, None)


def test_a_middle_stage_runs_gpipe_in_the_order_it_awaits():
    """Stage 1 of 3: nothing until its activations, every forward (each sent up) before any
    backward (each sent down), then its share to each of the D fast replicas; bf16 boundaries of
    rows × seq × d_model."""
    actor, t = shape_actor(1), 4
    meta = torch.empty(ROWS, CFG.seq_len, CFG.d_model, dtype=torch.bfloat16, device="meta")
    assert actor.handle(HandOff(t, M, {}, None)) == [] and actor.awaiting == Await(Activation, t, 0)
    boundary = ROWS * CFG.seq_len * CFG.d_model * 2
    seen = []
    for event in [Activation(t, 0, meta), Activation(t, 1, meta), Gradient(t, 0, meta),
                  Gradient(t, 1, meta)]:
        assert actor.takes(event)
        seen += [(type(a).__name__, getattr(a, "kind", None), getattr(a, "dst", None),
                  getattr(a, "nbytes", None)) for a in actor.handle(event)]
    up, down = WorkerId(D, 2), WorkerId(D, 0)
    share = seen[-1][3]
    assert seen == [("Compute", "F", None, None), ("Send", None, up, boundary),
                    ("Compute", "F", None, None), ("Send", None, up, boundary),
                    ("Compute", "B", None, None), ("Send", None, down, boundary),
                    ("Compute", "B", None, None), ("Send", None, down, boundary),
                    ("Share", None, None, share), ("Share", None, None, share)]
    assert actor.awaiting is None and actor.passes == 1


def test_actions_carry_the_compute_and_the_bytes():
    """A Compute names the stage's shape and rows (its FLOPs), a Send its wire bytes, a Share its
    replica and the bytes of the gradients in the wire dtype."""
    actor = shape_actor(0)
    actions = actor.handle(HandOff(0, M, {}, batch()))
    computes = [a for a in actions if isinstance(a, Compute)]
    assert [(c.kind, c.microbatch, c.rows, c.measured_s) for c in computes] == [
        ("F", 0, ROWS, 0.0), ("F", 1, ROWS, 0.0)]
    assert computes[0].shape == stage_shape(actor.math.module)
    sends = [a for a in actions if isinstance(a, Send)]
    assert [s.nbytes for s in sends] == [ROWS * CFG.seq_len * CFG.d_model * 2] * M
    grad = torch.empty(ROWS, CFG.seq_len, CFG.d_model, dtype=torch.bfloat16, device="meta")
    actor.handle(Gradient(0, 0, grad))
    shares = [a for a in actor.handle(Gradient(0, 1, grad)) if isinstance(a, Share)]
    params = dict(actor.math.module.named_parameters())
    assert [s.replica for s in shares] == list(range(D))
    assert shares[0].nbytes == 2 * sum(params[n].numel() for n in matrices(actor.math.module))


def test_an_event_it_does_not_await_is_refused():
    actor = shape_actor(1)
    meta = torch.empty(ROWS, CFG.seq_len, CFG.d_model, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="outside|awaiting a hand-off"):
        actor.handle(Activation(0, 0, meta))
    actor.handle(HandOff(0, M, {}, None))
    assert not actor.takes(Activation(0, 1, meta)) and not actor.takes(Gradient(0, 0, meta))
    with pytest.raises(RuntimeError, match="awaiting"):
        actor.handle(Activation(0, 1, meta))


def host(actors: list[AnchorStageActor], hand_offs: list[HandOff]) -> dict[int, list[Share]]:
    """The least host: deliver each event once its actor awaits it; shares by stage."""
    mail = [(a.me, h) for a, h in zip(actors, hand_offs, strict=True)]
    by_id = {a.me: a for a in actors}
    shares: dict[int, list[Share]] = {}
    while mail:
        i = next(i for i, (dst, event) in enumerate(mail) if by_id[dst].takes(event))
        dst, event = mail.pop(i)
        for action in by_id[dst].handle(event):
            if isinstance(action, Send):
                mail.append((action.dst, action.event))
            elif isinstance(action, Share):
                shares.setdefault(dst.stage, []).append(action)
    return shares


def real_actors(full: Decoder, wire: torch.dtype, factors: bool) -> list[AnchorStageActor]:
    stages = split_model(copy.deepcopy(full), P)
    return [AnchorStageActor(WorkerId(D, s), P, D, RealMath(m, matrices(m), s, P), wire,
                             AnchorEMA(0.5, 3) if factors else None) for s, m in enumerate(stages)]


def test_three_actors_with_an_fp32_wire_give_the_unsplit_gradient():
    """The arithmetic the actors own, routed by hand: each stage's share is the unsplit model's
    gradient of the mean loss over the whole batch, whatever weights were handed off."""
    full = init_model(CFG, 0)
    actors = real_actors(init_model(CFG, 1), torch.float32, factors=False)  # other weights: handed off
    micro = batch()
    weights = [dict(s.named_parameters()) for s in split_model(copy.deepcopy(full), P)]
    hands = [HandOff(6, M, weights[s], micro if s in (0, P - 1) else None) for s in range(P)]
    shares = host(actors, hands)
    x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
    Decoder.loss(full(x), y).backward()
    oracle = dict(full.named_parameters())
    for s in range(P):
        assert len(shares[s]) == D and all(a.step == 6 for a in shares[s])
        got = decode_share(shares[s][0].tensors, "gradients")
        assert got and set(got) == set(matrices(actors[s].math.module))
        for name, grad in got.items():
            torch.testing.assert_close(grad, oracle[name].grad, rtol=1e-5, atol=1e-7)


def test_factors_are_the_top_r_of_the_stage_ema_on_the_wire():
    """send = factors: the share is U, s, Vh of rank r of the EMA the stage keeps, in bf16."""
    full = init_model(CFG, 0)
    actors = real_actors(full, torch.bfloat16, factors=True)
    for t in (0, 2):
        shares = host(actors, [HandOff(t, M, {}, batch(t) if s in (0, P - 1) else None) for s in range(P)])
    share = shares[1][0]
    assert all(t.dtype == torch.bfloat16 for t in share.tensors.values())
    bases = decode_share(share.tensors, "factors")
    ema = actors[1].ema.ema
    assert set(bases) == set(ema)
    for name, basis in bases.items():
        m, n = ema[name].shape
        assert basis.u.shape == (m, 3) and basis.vh.shape == (3, n)
        top = torch.linalg.svdvals(ema[name])[:3]
        torch.testing.assert_close(basis.s, top, rtol=1e-2, atol=1e-6)
    assert share.nbytes == sum(3 * (m + n + 1) * 2 for m, n in (e.shape for e in ema.values()))


@pytest.mark.parametrize(("max_late", "table"), [
    # (now, arrived) → fate, for a share of step 0 with K = 2
    (1, [(1, True, Fate.WAIT), (2, False, Fate.WAIT), (3, True, Fate.DELIVER), (3, False, Fate.DROP)]),
    (0, [(1, True, Fate.WAIT), (2, True, Fate.DELIVER), (2, False, Fate.DROP)]),
])
def test_the_fast_side_takes_due_shares_and_drops_one_max_late_late(max_late, table):
    for now, arrived, fate in table:
        fast = FastSide(delay=2, max_late=max_late, send="gradients")
        assert fast.settle(now, 0, arrived) is fate, (now, arrived)
        c = fast.counters
        assert (c.delivered, c.dropped_late) == (fate is Fate.DELIVER, fate is Fate.DROP)
        if fate is Fate.DELIVER:
            assert (c.staleness_sum, c.late_max) == (now, now - 2)
