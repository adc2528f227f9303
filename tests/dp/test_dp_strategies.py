"""The DP strategies (meshlearn.dp) against their invariants: the method note's and the issue's.

Unit tests drive D strategy instances by hand, passing their dp messages between them; the run
tests compare whole simulator runs (tiny model, P = 2, D = 2) against ``dp.name = allreduce``.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config

from meshlearn.dp.diloco import StreamingDiLoCo
from meshlearn.dp.powersgd import PowerSGD
from meshlearn.dp.sparse import SparseAveraging, ema_coefficient, partition, parts_per_epoch
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer

# --- helpers -------------------------------------------------------------------------------------


def modules(replicas: int, seed: int = 0, same: bool = False) -> list[torch.nn.Module]:
    out = []
    for r in range(replicas):
        torch.manual_seed(seed if same else seed + r)
        out.append(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3)))
    return out


def sparse(module, r, replicas, **kw):
    opts = dict(fraction=0.3, delay=0, every=1, rule="avg", lam=1.0, m0=0.5, m1=0.99, warm=1000,
                ramp_end=30000, ema_init="first_round", moments=False, seed=3, deadline_s=None)
    opts |= kw
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return SparseAveraging(WorkerId(r, 0), replicas, module, optimizer, **opts)


def deliver(strategies, messages) -> None:
    """Hand every message to its receiver, and whatever that answers, until quiet."""
    queue = list(messages)
    while queue:
        message = queue.pop(0)
        queue += strategies[message.dst.replica].receive(message)


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def drift(mods, u: int) -> None:
    """A different local step on every replica (what the optimizer does between rounds)."""
    with torch.no_grad():
        for r, m in enumerate(mods):
            g = torch.Generator().manual_seed(100 * u + r)
            for p in m.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))


def run_rounds(mods, strategies, updates: int) -> None:
    for u in range(updates):
        drift(mods, u)
        out = [m for s in strategies for m in s.post_step(u)]
        deliver(strategies, out)
        for s in strategies:
            assert s.post_wait(u) is None  # every round is complete: nothing dropped here
            s.apply(u)


# --- partitions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "fraction"), [(1, 0.05), (7, 0.05), (97, 0.3), (1000, 0.05), (64, 1.0)])
def test_partitions_disjoint_cover_and_need_no_communication(n, fraction):
    parts = parts_per_epoch(fraction)
    assert parts == {0.05: 20, 0.3: 4, 1.0: 1}[fraction]
    for epoch in range(2):
        seen = torch.cat([partition(5, epoch * parts + k, 2, n, parts) for k in range(parts)])
        assert sorted(seen.tolist()) == list(range(n))  # disjoint and covering after K rounds
        # derived again from the seed alone (another replica): the very same indices
        again = torch.cat([partition(5, epoch * parts + k, 2, n, parts) for k in range(parts)])
        assert torch.equal(seen, again)
    if n > 10:  # a new permutation each epoch and per tensor
        assert not torch.equal(partition(5, 0, 2, n, parts), partition(5, parts, 2, n, parts))
        assert not torch.equal(partition(5, 0, 2, n, parts), partition(5, 0, 3, n, parts))


def test_ema_schedule():
    assert ema_coefficient(0, 0.5, 0.99, 1000, 30000) == 0.5
    assert ema_coefficient(999, 0.5, 0.99, 1000, 30000) == 0.5
    assert ema_coefficient(15500, 0.5, 0.99, 1000, 30000) == pytest.approx(0.745)
    assert ema_coefficient(30000, 0.5, 0.99, 1000, 30000) == pytest.approx(0.99)
    assert ema_coefficient(90000, 0.5, 0.99, 1000, 30000) == pytest.approx(0.99)


# --- averaging rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["avg", "delta"])
def test_delay_zero_avg_and_delta_equal_synchronous_sparta(rule):
    D = 3
    mods, ref = modules(D), modules(D)
    strategies = [sparse(m, r, D, rule=rule) for r, m in enumerate(mods)]
    for u in range(6):
        drift(mods, u)
        drift(ref, u)
        # synchronous SPARTA by hand: w_r[S] ← mean_r w_r[S], S this round's indices
        with torch.no_grad():
            for i, params in enumerate(zip(*[list(m.parameters()) for m in ref], strict=True)):
                idx = partition(3, u, i, params[0].numel(), strategies[0].parts)
                mean = torch.stack([p.reshape(-1)[idx] for p in params]).sum(0) / D
                for p in params:
                    p.view(-1)[idx] = mean
        deliver(strategies, [m for s in strategies for m in s.post_step(u)])
        for s in strategies:
            s.apply(u)
    for m, r in zip(mods, ref, strict=True):
        assert torch.allclose(flat(m), flat(r), atol=1e-6)
    assert not torch.allclose(flat(mods[0]), flat(mods[1]))  # fraction 0.3: replicas still differ


def mean_shifts(rule: str, updates: int, D: int = 4) -> tuple[list[float], int]:
    """Drift D replicas, run sparse averaging with ``rule`` (delay 2); per update, the largest change
    of the across-replica mean that the update's rounds and merges made; and the rounds started."""
    mods = modules(D)
    strategies = [sparse(m, r, D, rule=rule, delay=2) for r, m in enumerate(mods)]
    shifts = []
    for u in range(updates):
        drift(mods, u)
        before = torch.stack([flat(m) for m in mods]).mean(0)
        deliver(strategies, [m for s in strategies for m in s.post_step(u)])
        for s in strategies:
            s.apply(u)
        shifts.append((torch.stack([flat(m) for m in mods]).mean(0) - before).abs().max().item())
    return shifts, sum(s.rounds for s in strategies)


def test_delta_with_lambda_one_preserves_the_mean():
    shifts, rounds = mean_shifts("delta", 8)
    assert max(shifts) <= 1e-6
    assert rounds == 8 * 4


def test_avg_with_delay_does_not_preserve_the_mean():
    """The negative control of the delta test: avg throws the drift since the snapshot away."""
    shifts, _ = mean_shifts("avg", 6)
    assert max(shifts) > 1e-4


def test_ema_with_m_zero_equals_delta_and_is_not_a_noop_on_identical_replicas():
    D = 2
    a, b = modules(D), modules(D)
    delta = [sparse(m, r, D, rule="delta", delay=1, lam=0.7) for r, m in enumerate(a)]
    ema = [sparse(m, r, D, rule="ema", delay=1, lam=0.7, m0=0.0, m1=0.0) for r, m in enumerate(b)]
    run_rounds(a, delta, 7)
    run_rounds(b, ema, 7)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(flat(x), flat(y), atol=1e-6)
    # On identical replicas with identical steps the delta rule (λ = 1) is a no-op; ema (m = 0.5)
    # is not, once its e holds a drift of an earlier round (the note's invariant 6).
    same = modules(D, same=True)
    twins = [sparse(m, r, D, rule="ema", delay=1, fraction=1.0) for r, m in enumerate(same)]
    plain = modules(D, same=True)
    with torch.no_grad():
        for u in range(4):
            for group in (same, plain):
                for m in group:
                    for p in m.parameters():
                        p.add_(0.01 * (u + 1))
            deliver(twins, [m for s in twins for m in s.post_step(u)])
            for s in twins:
                s.apply(u)
    assert torch.equal(flat(same[0]), flat(same[1]))
    assert not torch.allclose(flat(same[0]), flat(plain[0]), atol=1e-4)


def test_moments_averaged_but_never_the_step_counter():
    D = 2
    mods = modules(D)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in mods]
    for r, (m, o) in enumerate(zip(mods, opts, strict=True)):
        m(torch.randn(4, 7, generator=torch.Generator().manual_seed(r))).sum().backward()
        o.step()
    strategies = [SparseAveraging(WorkerId(r, 0), D, m, o, fraction=1.0, delay=0, every=1, rule="avg",
                                  lam=1.0, m0=0.5, m1=0.99, warm=0, ramp_end=0, ema_init="first_round",
                                  moments=True, seed=1, deadline_s=None)
                  for r, (m, o) in enumerate(zip(mods, opts, strict=True))]
    steps = [[float(s["step"]) for s in o.state.values()] for o in opts]
    deliver(strategies, [m for s in strategies for m in s.post_step(0)])
    for s in strategies:
        s.apply(0)
    for p0, p1 in zip(mods[0].parameters(), mods[1].parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opts[0].state[p0][key], opts[1].state[p1][key])
        assert (opts[0].state[p0]["exp_avg_sq"] >= 0).all()
    assert [[float(s["step"]) for s in o.state.values()] for o in opts] == steps
    # bytes: parameters and both moments of every element, to the one peer
    assert strategies[0].round_numel(0) == 3 * sum(p.numel() for p in mods[0].parameters())


def test_a_round_past_its_deadline_is_dropped_and_later_parts_ignored():
    D = 2
    mods = modules(D)
    strategies = [sparse(m, r, D, rule="avg", delay=1, deadline_s=0.5) for r, m in enumerate(mods)]
    out0 = strategies[0].post_step(0)
    strategies[1].post_step(0)
    key = strategies[0].post_wait(1)
    assert key == (0, 0)
    strategies[0].expire(key)  # what a driver does when the deadline passes
    deliver(strategies, out0)
    before = flat(mods[0]).clone()
    strategies[0].apply(1)
    assert torch.equal(flat(mods[0]), before)  # nothing applied
    assert strategies[0].dropped == 1 and strategies[0].idle


# --- PowerSGD ------------------------------------------------------------------------------------


def test_powersgd_at_full_rank_equals_the_allreduce():
    D = 3
    mods = modules(D)
    grads = []
    for r, m in enumerate(mods):
        m(torch.randn(5, 7, generator=torch.Generator().manual_seed(r))).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    mean = [torch.stack(gs).sum(0) / D for gs in zip(*grads, strict=True)]
    strategies = [PowerSGD(WorkerId(r, 0), D, m, rank=64, seed=0) for r, m in enumerate(mods)]
    deliver(strategies, [m for s in strategies for m in s.pre_step(0)])
    for s, m in zip(strategies, mods, strict=True):
        assert s.pre_ready(0)
        for p, g in zip(m.parameters(), mean, strict=True):
            assert torch.allclose(p.grad, g, atol=1e-5)
    # error feedback keeps the local residual M − Ĝ; at full rank those sum to 0 over the replicas,
    # so the next update's mean is still the all-reduce's
    for i in strategies[0].compressor.error:
        assert torch.stack([s.compressor.error[i] for s in strategies]).sum(0).abs().max().item() < 1e-5
    low = [PowerSGD(WorkerId(r, 0), D, m, rank=1, seed=0) for r, m in enumerate(modules(D))]
    phase0, phase1 = low[0].wire_values()
    assert phase0 == 5 * 1 + 5 + 5 + 5 + 3 * 1 + 3 and phase1 == 7 + 5


# --- streaming DiLoCo with PowerSGD-compressed pseudo-gradients (dp.compress) -------------------


def diloco(module, r, replicas, **kw):
    opts = dict(inner_steps=2, fragments=2, overlap=0, outer_lr=0.7, outer_momentum=0.9,
                merge_weight=0.5, deadline_s=None, seed=5)
    return StreamingDiLoCo(WorkerId(r, 0), replicas, module, **(opts | kw))


@pytest.mark.parametrize(("rank", "equal"), [(64, True), (1, False)])
def test_compressed_diloco_at_full_rank_equals_the_uncompressed_mean(rank, equal):
    """Full rank: the factors' product is the pseudo-gradients' mean, so every replica's weights and
    outer weights follow plain streaming DiLoCo; rank 1 does not (the negative control)."""
    D = 3
    plain_mods, packed_mods = modules(D), modules(D)
    plain = [diloco(m, r, D) for r, m in enumerate(plain_mods)]
    packed = [diloco(m, r, D, compress="powersgd", rank=rank) for r, m in enumerate(packed_mods)]
    run_rounds(plain_mods, plain, 6)
    run_rounds(packed_mods, packed, 6)
    gap = max((flat(a) - flat(b)).abs().max().item() for a, b in zip(plain_mods, packed_mods, strict=True))
    assert (gap < 1e-5) == equal, gap
    assert all(s.rounds == 6 and s.dropped == 0 for s in packed)  # 6 updates × 1 fragment each


def test_compressed_diloco_keeps_the_error_and_a_dropped_sync_leaves_it():
    """Error feedback: after a sync each replica keeps e = M − P·Qᵀ; a sync dropped halfway (round
    1 missed) changes neither e, nor Q, nor the outer weights."""
    D = 2
    mods = modules(D)
    strategies = [diloco(m, r, D, compress="powersgd", rank=1, fragments=1, inner_steps=1)
                  for r, m in enumerate(mods)]
    run_rounds(mods, strategies, 1)
    c = strategies[0].compressors[0]
    assert c.error and all(e.abs().max() > 0 for e in c.error.values())
    before = ({i: e.clone() for i, e in c.error.items()}, {i: q.clone() for i, q in c.q.items()},
              [o.clone() for o in strategies[0].outer])
    drift(mods, 1)
    round0 = [m for s in strategies for m in s.post_step(1)]
    round1 = [m for m in round0 for m in strategies[m.dst.replica].receive(m)]
    assert round1 and all(m.microbatch == 1 for m in round1)  # key (u, F + f): round 1 of fragment 0
    assert strategies[0].post_wait(1) == (1, 1)  # overlap 0: update 1 waits for round 1
    strategies[0].expire((1, 1))
    assert strategies[0].post_wait(1) is None and strategies[0].dropped == 1
    strategies[0].receive(next(m for m in round1 if m.dst.replica == 0))  # a straggler: ignored
    assert all(torch.equal(before[0][i], c.error[i]) for i in c.error)
    assert all(torch.equal(before[1][i], c.q[i]) for i in c.q)
    assert all(torch.equal(a, b) for a, b in zip(before[2], strategies[0].outer, strict=True))


# --- whole runs ----------------------------------------------------------------------------------

PLAIN = ["mesh.stages=2", "mesh.replicas=2", "optim.name=sgd", "optim.weight_decay=0",
         "train.grad_clip=0", "train.steps=4", "train.lr=0.05"]


def plain_sgd(trainer: Trainer) -> Trainer:
    """No momentum (the config can't express SGD without it): plain w ← w − η·g."""
    for worker in trainer.workers.values():
        for group in worker.optimizer.param_groups:
            group["momentum"] = 0.0
    return trainer


def run(tiny_corpus, tmp_path, name, *sets):
    cfg = tiny_config(tiny_corpus, *PLAIN, *sets)
    trainer = plain_sgd(Trainer(cfg, tmp_path / name, progress=False))
    summary = trainer.train()
    return trainer, summary


def params(trainer):
    return torch.cat([p.detach().reshape(-1) for w in sorted(trainer.workers)
                      for p in trainer.workers[w].module.parameters()])


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
@pytest.mark.parametrize("strategy", [
    ["dp.name=sparse", "dp.fraction=1", "dp.delay=0", "dp.rule=avg"],
    ["dp.name=diloco", "dp.inner_steps=1", "dp.fragments=1", "dp.overlap=0", "dp.merge_weight=1",
     "dp.outer_lr=1", "dp.outer_momentum=0"],
    ["dp.name=powersgd", "dp.rank=1000"],
    ["dp.name=diloco", "dp.compress=powersgd", "dp.rank=1000", "dp.inner_steps=1", "dp.fragments=1",
     "dp.overlap=0", "dp.merge_weight=1", "dp.outer_lr=1", "dp.outer_momentum=0"],
])
def test_exact_settings_equal_the_allreduce_under_plain_sgd(tiny_corpus, tmp_path, schedule, strategy):
    ref, _ = run(tiny_corpus, tmp_path, "ref", f"mesh.schedule={schedule}")
    got, summary = run(tiny_corpus, tmp_path, "got", f"mesh.schedule={schedule}", *strategy)
    assert (params(ref) - params(got)).abs().max().item() <= 1e-4
    assert summary["dp_dropped_rounds"] == 0 and summary["dp_rounds"] > 0
    a = [r for r in _records(tmp_path / "ref")]
    b = [r for r in _records(tmp_path / "got")]
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-4


def test_sparse_with_a_fraction_drifts_and_evaluates_the_average(tiny_corpus, tmp_path):
    """The negative control: fraction 0.25 with a delay is not the all-reduce, and evaluation
    reports the averaged model with replica 0 beside it."""
    ref, _ = run(tiny_corpus, tmp_path, "ref", "train.eval_every=4")
    got, summary = run(tiny_corpus, tmp_path, "got", "dp.name=sparse", "dp.fraction=0.25",
                       "dp.delay=1", "train.eval_every=4")
    assert (params(ref) - params(got)).abs().max().item() > 1e-4
    (record,) = _records(tmp_path / "got", "eval")
    assert record["val_loss"] != record["val_loss_replica0"]
    assert summary["dp_rounds"] == 4 * 4 and summary["dp_dropped_rounds"] == 0  # 4 workers × 4 updates


@pytest.mark.parametrize("strategy", ["sparse", "powersgd", "diloco", "diloco+powersgd"])
def test_dp_bytes_equal_the_strategy_formula(tiny_corpus, tmp_path, strategy):
    sets = {"sparse": ["dp.fraction=0.3", "dp.delay=2"], "powersgd": ["dp.rank=2"],
            "diloco": ["dp.inner_steps=2", "dp.fragments=2", "dp.overlap=1"],
            "diloco+powersgd": ["dp.inner_steps=2", "dp.fragments=2", "dp.overlap=1",
                                "dp.compress=powersgd", "dp.rank=2"]}[strategy]
    trainer, summary = run(tiny_corpus, tmp_path, "x", f"dp.name={strategy.split('+')[0]}", *sets)
    steps, D = 4, 2
    expected = 0
    for worker in trainer.workers.values():
        s = worker.dp
        if strategy == "sparse":
            values = sum(s.round_numel(r) for r in range(steps))
        elif strategy == "powersgd":
            values = steps * sum(s.wire_values())
        elif s.compressors is None:
            values = sum(s.fragment_numel(f) for u in range(steps) for f in s.syncing(u))
        else:  # two rounds per sync: P, then Q
            values = sum(sum(s.compressors[f].wire_values()) for u in range(steps) for f in s.syncing(u))
            assert values < sum(s.fragment_numel(f) for u in range(steps) for f in s.syncing(u))
        expected += 4 * values * (D - 1)
    assert summary["bytes_per_token_dp"] * summary["tokens"] == expected
    assert expected > 0


def test_missed_deadlines_drop_rounds_and_never_block(tiny_corpus, tmp_path):
    """A deadline far below the link's latency: every round is dropped, none is waited for, and
    the replicas then never average (so they differ)."""
    trainer, summary = run(tiny_corpus, tmp_path, "x", "dp.name=sparse", "dp.fraction=1",
                           "dp.delay=1", "dp.deadline_s=0.000001")
    assert summary["dp_rounds"] == 16 and summary["dp_dropped_rounds"] == 16
    assert summary["dp_wait_s"] == 0.0
    w = trainer.workers
    assert not torch.equal(flat(w[WorkerId(0, 0)].module), flat(w[WorkerId(1, 0)].module))


def test_bad_dp_settings_name_the_key(tiny_corpus):
    for sets, key in [(["dp.name=gossip"], "dp.name"), (["dp.fraction=0"], "dp.fraction"),
                      (["dp.rule=mean"], "dp.rule"), (["dp.delay=-1"], "dp.delay"),
                      (["dp.overlap=10"], "dp.overlap"), (["dp.ema_m=1"], "dp.ema_m"),
                      (["dp.compress=topk"], "dp.compress"),
                      (["dp.name=sparse", "dp.compress=powersgd"], "dp.compress")]:
        with pytest.raises(ConfigError) as err:
            tiny_config(tiny_corpus, *sets)
        assert err.value.key == key


def _records(run_dir, kind="train"):
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]
