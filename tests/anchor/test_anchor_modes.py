"""The note's two anchor defaults: top-r factors from the anchor's own EMA (open detail 3) and the
outer weights every replica agrees on, followed by listening to the DP traffic (open detail 2)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_config

from meshlearn.anchor.circuit import AnchorCircuit
from meshlearn.anchor.plugin import relay_bytes
from meshlearn.mesh.network import ring_allreduce_bytes_per_member
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer

# A masked fast circuit (keep 1/4) on P = 2, D = 2, an anchor every 2 steps with an exact wire.
FAST = ["mesh.stages=2", "mesh.replicas=2", "codec.name=mask", "codec.keep=0.25",
        "optim.spectral.enabled=true", "mesh.schedule=1f1b"]
ANCHOR = ["anchor.z=1", "anchor.delay=2", "anchor.wire_dtype=fp32", "anchor.weights=snapshot"]
COUNTS = ("anchor_passes", "anchor_delivered", "anchor_dropped_late", "anchor_pending_at_end",
          "anchor_mean_staleness", "spectral_anchor_accepted", "spectral_anchor_dropped_stale",
          "spectral_anchor_dropped_out_of_order", "spectral_corrected_steps")


def train(tiny_corpus, path, *sets: str) -> tuple[Trainer, dict]:
    run = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, *sets), path, progress=False)
    return run, run.train()


def max_weight_gap(a: Trainer, b: Trainer) -> float:
    return max(float((p - q).detach().abs().max()) for wid, w in a.workers.items()
               for p, q in zip(w.module.parameters(), b.workers[wid].module.parameters(), strict=True))


def test_full_rank_factors_give_the_updates_of_full_gradients(tiny_corpus, tmp_path):
    """r = 64 >= min(m, n) = 32 of every matrix and an fp32 wire: the fast workers install the
    anchor's own bases and end where the fast-side EMA and SVD of the gradients lead, to 1e-5, with
    the same deliveries; the anchor stage's EMA is the one the fast workers kept. At r = 2 the run
    differs (the check can fail)."""
    steps = ["train.steps=6", "optim.spectral.alpha=0.3"]
    grads, grads_summary = train(tiny_corpus, tmp_path / "grads", *steps, "anchor.send=gradients")
    factors, factors_summary = train(tiny_corpus, tmp_path / "factors", *steps, "anchor.send=factors",
                                     "anchor.rank=64")
    for key in COUNTS:
        assert grads_summary[key] == factors_summary[key], key
    assert factors_summary["anchor_delivered"] == 3 * 4 and factors_summary["spectral_corrected_steps"] > 0
    assert max_weight_gap(grads, factors) <= 1e-5
    circuit = factors.plugins["anchor"].circuit
    for wid, worker in factors.workers.items():
        kept = grads.workers[wid].spectral.priors
        for name, prior in worker.spectral.priors.items():
            assert prior.ema is None and prior.basis is not None and prior.last_step == 4
            anchor_ema = circuit.ema[WorkerId(2, wid.stage)].ema[name]
            torch.testing.assert_close(anchor_ema, kept[name].ema, rtol=1e-5, atol=1e-7)
    low, _ = train(tiny_corpus, tmp_path / "low", *steps, "anchor.send=factors", "anchor.rank=2")
    assert max_weight_gap(grads, low) > 1e-4


def test_under_diloco_the_anchor_computes_on_the_outer_weights(tiny_corpus, tmp_path, monkeypatch):
    """Streaming DiLoCo (H = 2): every hand-off gives the anchor θ_outer, which both replicas of the
    stage hold alike and which differs from replica 0's live weights; no snapshot travels."""
    handed, outer, live = {}, {}, {}
    original = AnchorCircuit.run_pass
    holder: dict[str, Trainer] = {}

    def spy(self, step, weights, sent_at, batches):
        handed[step] = [{n: t.clone() for n, t in w.items()} for w in weights]
        if "run" in holder:  # the plugin's own hand-off of step 0 runs while the trainer is built
            workers = holder["run"].workers
            outer[step] = [[{n: t.clone() for n, t in workers[WorkerId(r, s)].dp.agreed_weights().items()}
                            for s in range(2)] for r in range(2)]
            live[step] = [{n: p.detach().clone()
                           for n, p in workers[WorkerId(0, s)].module.named_parameters()}
                          for s in range(2)]
        return original(self, step, weights, sent_at, batches)

    monkeypatch.setattr(AnchorCircuit, "run_pass", spy)
    run = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, "anchor.weights=outer", "train.steps=6",
                              "dp.name=diloco", "dp.inner_steps=2"), tmp_path / "run", progress=False)
    holder["run"] = run
    summary = run.train()
    assert sorted(handed) == [0, 2, 4] and sorted(outer) == [2, 4]
    differs = False
    for step in (2, 4):
        for s in range(2):
            for name, value in handed[step][s].items():
                assert torch.equal(value, outer[step][0][s][name]), (step, s, name)
                assert torch.equal(value, outer[step][1][s][name]), (step, s, name)
                differs |= not torch.equal(value, live[step][s][name])
    assert differs
    assert summary["anchor_bytes_snapshot"] == 3 * 2 * 8 * 4  # the batch ids alone
    assert summary["anchor_delivered"] > 0


@pytest.mark.parametrize(("z", "dp"), [(1, []), (2, []),
                                       (1, ["dp.name=diloco", "dp.compress=powersgd", "dp.rank=2",
                                            "dp.inner_steps=2"])])
def test_listening_relays_each_dp_rounds_result_to_every_anchor_replica(tiny_corpus, tmp_path, z, dp):
    """weights = outer: fast (0, s) relays its stage's reduced DP results to each anchor replica's
    stage s on the hand-off link; at D = 2 that is exactly what (0, s) sent on its DP links (the
    ring's N, or the one message of each exchange round)."""
    run, summary = train(tiny_corpus, tmp_path / "run", "anchor.weights=outer", f"anchor.z={z}",
                         "train.steps=4", *dp)
    network, circuit = run.driver.network, run.plugins["anchor"].circuit
    total = 0
    for s in range(2):
        sent = sum(lk.bytes_sent for lk in network.links.values()
                   if lk.axis == "dp" and lk.src == WorkerId(0, s))
        assert sent > 0
        total += sent
        for zz in range(z):
            ids = 8 * 4 * len(range(zz, 2, z))  # the passes t = 0, 2 in turn; P = 2: both stages get ids
            assert circuit.links[(WorkerId(0, s), WorkerId(2 + zz, s))].bytes_sent == ids + sent
    assert summary["anchor_bytes_listen"] == z * total
    assert summary["anchor_delivered"] > 0


def test_the_relay_is_one_contribution_of_each_round():
    """D = 4: a ring all-reduce member sends 2(D − 1)·⌈N/D⌉, the result is D·⌈N/D⌉; an exchange
    round's part goes to D − 1 peers, the result is one part."""
    n = 1003
    sent = ring_allreduce_bytes_per_member(n, 4)
    assert relay_bytes(sent, 4, collective=True) == 4 * math.ceil(n / 4)
    assert relay_bytes(3 * 512, 4, collective=False) == 512
    assert relay_bytes(sent, 1, collective=True) == 0


@pytest.mark.parametrize("mode", [["anchor.send=factors", "anchor.weights=outer", "anchor.rank=3"],
                                  ["anchor.send=gradients", "anchor.weights=snapshot"],
                                  # the anchor's links on the senders' uplinks: their queues resume too
                                  ["anchor.send=gradients", "anchor.weights=snapshot",
                                   "links.access=uplink"]])
def test_a_resumed_run_carries_the_anchor_stage_ema(tiny_corpus, tmp_path, mode):
    """Passes at t = 0, 3, 6 (K = 3), checkpoint at 4: the pass of step 6 folds into the anchor's
    EMA saved at step 4, and the fast workers' bases installed before it (factors: no EMA of their
    own) are in their checkpoint; the resumed run equals the uninterrupted one bit for bit."""
    base = [*mode, "anchor.delay=3", "train.steps=8", "train.checkpoint_every=2"]
    whole, whole_summary = train(tiny_corpus, tmp_path / "whole", *base)
    Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, *base, "train.stop_at_step=4"), tmp_path / "split",
            progress=False).train()
    second = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, *base), tmp_path / "split", progress=False,
                     resume=True)
    split_summary = second.train()
    for key in (*COUNTS, "anchor_bytes_snapshot", "anchor_bytes_factors", "anchor_bytes_gradients",
                "anchor_bytes_listen", "anchor_bytes_boundary"):
        assert whole_summary[key] == split_summary[key], key
    assert whole_summary["sim_tokens_per_s"] == split_summary["sim_tokens_per_s"]
    assert whole_summary["anchor_passes"] == 3 and whole_summary["spectral_corrected_steps"] > 0
    for wid, worker in whole.workers.items():
        for p, q in zip(worker.module.parameters(), second.workers[wid].module.parameters(), strict=True):
            assert torch.equal(p, q), wid
    a, b = whole.plugins["anchor"].circuit.ema, second.plugins["anchor"].circuit.ema
    for stage, ema in a.items():
        assert ema.ema.keys() == b[stage].ema.keys()
        assert all(torch.equal(ema.ema[n], b[stage].ema[n]) for n in ema.ema)
