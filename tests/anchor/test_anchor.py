"""The anchor circuit: its gradient is the unsplit model's on the K-steps-old weights, it never
delays the fast circuit, late arrivals are dropped, α = 1 stays the base optimizer, config errors."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.anchor.circuit import AnchorCircuit
from meshlearn.data import global_batch
from meshlearn.errors import ConfigError
from meshlearn.mesh.compute import stage_shape
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder
from meshlearn.models.split import merge_stages
from meshlearn.optim.spectral import SpectralCorrection
from meshlearn.train import Trainer

# A masked fast circuit (keep 1/4) on P = 2, D = 2: the anchor's gradients are the only clean ones.
FAST = ["mesh.stages=2", "mesh.replicas=2", "codec.name=mask", "codec.keep=0.25",
        "optim.spectral.enabled=true"]
ANCHOR = ["anchor.z=1", "anchor.delay=2", "anchor.wire_dtype=fp32", "anchor.send=gradients",
          "anchor.weights=snapshot"]


def train_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def unsplit_gradients(trainer: Trainer, stages: list[dict], step: int) -> dict[str, torch.Tensor]:
    """The oracle: the unsplit model on ``stages``' weights, unmasked, on replica 0's share of
    ``step``'s batch (the rows the anchor was handed)."""
    cfg = trainer.cfg
    model = merge_stages(cfg.model, stages)
    x, y = global_batch(trainer.corpus.splits.train, step, cfg.train.batch_size, cfg.model.seq_len,
                        cfg.seed)
    rows = cfg.train.batch_size // cfg.mesh.replicas
    Decoder.loss(model(x[:rows]), y[:rows]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def weights(trainer: Trainer) -> list[dict]:
    return [{n: p.detach().clone() for n, p in trainer.workers[WorkerId(0, s)].module.named_parameters()}
            for s in range(trainer.cfg.mesh.stages)]


@pytest.mark.parametrize("source", ["snapshot", "outer"])
def test_the_anchor_gradient_is_the_unsplit_gradient_on_the_k_steps_old_weights(tiny_corpus, tmp_path,
                                                                                source):
    """1F1B, K = 2, β_anc = 0: after step 4 every fast worker's anchor EMA is the gradient computed
    for step 2, i.e. on the weights as step 2 began (those of a 2-step run: nothing was folded in
    before step 2's update) and step 2's batch, folded in at step 4. Under the all-reduce the
    replicas' weights are common, so the outer weights are these too, with no snapshot sent."""
    steps = ["mesh.schedule=1f1b", "optim.spectral.beta_anc=0"]
    before = Trainer(tiny_config(tiny_corpus, *FAST, *steps, "train.steps=2"), tmp_path / "two",
                     progress=False)
    before.train()
    oracle = unsplit_gradients(before, weights(before), step=2)
    run = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, *steps, f"anchor.weights={source}",
                              "train.steps=4"), tmp_path / "four", progress=False)
    summary = run.train()
    assert summary["anchor_passes"] == 2 and summary["anchor_delivered"] == 2 * 4  # t = 0, 2; 4 workers
    sequence_ids = 2 * 2 * 8 * 4  # 2 passes, first and last stage, 8 B for each of 4 sequences
    assert (summary["anchor_bytes_snapshot"] == sequence_ids) == (source == "outer")
    assert summary["anchor_mean_staleness"] == 2.0
    compared = 0
    for wid, worker in run.workers.items():
        for name, prior in worker.spectral.priors.items():
            assert prior.last_step == 2, (wid, name)
            torch.testing.assert_close(prior.ema, oracle[name], rtol=1e-5, atol=1e-7)
            compared += 1
    assert compared == 4 * 2 * 7  # 4 workers, 2 blocks each, 7 matrices per block


def test_under_async_the_anchor_gradient_is_the_unsplit_one_on_the_weights_handed_off(
        tiny_corpus, tmp_path, monkeypatch):
    """Under async a step's end finds the stages at their own versions; whatever was handed off,
    the gradient is the unsplit model's on exactly those weights."""
    handed = {}
    original = AnchorCircuit.run_pass

    def spy(self, step, weights, sent_at, batches):
        handed[step] = [{n: t.clone() for n, t in w.items()} for w in weights]
        return original(self, step, weights, sent_at, batches)

    monkeypatch.setattr(AnchorCircuit, "run_pass", spy)
    run = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, "mesh.schedule=async",
                              "optim.spectral.beta_anc=0", "train.steps=4"), tmp_path / "run",
                  progress=False)
    run.train()
    oracle = unsplit_gradients(run, handed[2], step=2)
    for worker in run.workers.values():
        for name, prior in worker.spectral.priors.items():
            torch.testing.assert_close(prior.ema, oracle[name], rtol=1e-5, atol=1e-7)


def test_the_anchor_gradient_is_not_the_masked_one(tiny_corpus, tmp_path):
    """The check above can fail: the fast circuit's own (masked) gradient at the same weights and
    batch differs from the anchor's."""
    run = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, "train.steps=8",
                              "train.grad_clip=0", "mesh.replicas=1"), tmp_path / "run", progress=False)
    start = weights(run)
    captured = {}
    worker = run.workers[WorkerId(0, 0)]
    name = "layers.0.attn.q.weight"
    param = dict(worker.module.named_parameters())[name]

    def capture(opt, args, kwargs) -> None:
        captured.setdefault("masked", param.grad.clone())

    handle = worker.optimizer.register_step_pre_hook(capture)
    run.step()  # step 0: the fast gradient of batch 0 on the initial weights
    handle.remove()
    oracle = unsplit_gradients(run, start, step=0)[name]
    assert not torch.allclose(captured["masked"], oracle, rtol=1e-3, atol=1e-6)
    while run.plugins["anchor"].counters.delivered == 0:  # due after step 1, folded in on arrival
        assert run.totals.step < 2 + run.cfg.anchor.max_late
        run.step()
    assert worker.spectral.priors[name].last_step == 0
    torch.testing.assert_close(worker.spectral.priors[name].ema, oracle, rtol=1e-5, atol=1e-7)


def test_the_anchor_never_delays_the_fast_circuit(tiny_corpus, tmp_path):
    """Async schedule, anchor links 1000× slower than the mesh's: every step's virtual time and the
    mesh's PP and DP bytes are the same as without an anchor; the anchor's own bytes and busy time
    are counted apart."""
    base = [*FAST, "mesh.schedule=async", "train.steps=6"]
    plain = Trainer(tiny_config(tiny_corpus, *base), tmp_path / "plain", progress=False)
    plain_summary = plain.train()
    slow = Trainer(tiny_config(tiny_corpus, *base, "anchor.z=1", "anchor.delay=2",
                               "anchor.bandwidth_mbit=0.1", "anchor.max_late=20"),
                   tmp_path / "slow", progress=False)
    slow_summary = slow.train()
    a, b = train_records(tmp_path / "plain"), train_records(tmp_path / "slow")
    assert [r["step_sim_s"] for r in a] == [r["step_sim_s"] for r in b]
    assert [(r["bytes_pp"], r["bytes_dp"]) for r in a] == [(r["bytes_pp"], r["bytes_dp"]) for r in b]
    assert plain_summary["sim_time_s"] == slow_summary["sim_time_s"]
    assert slow_summary["anchor_passes"] == 3 and b[-1]["bytes_anchor"] > 0
    assert all(t > 0 for t in slow_summary["anchor_busy_s"].values())
    anchor_links = {(link["src"], link["dst"]) for link in slow_summary["links"]}
    assert not any(src.startswith("r2") or dst.startswith("r2") for src, dst in anchor_links)


@pytest.mark.parametrize(("bandwidth", "max_late", "delivered"), [
    ("0", 0, True),  # PP links' speed: on time
    ("5", 0, False),  # 1/20 of the PP links: every arrival misses its due step, the cap
    ("5", 20, True),  # the same anchor with a wide cap: delivered, late
])
def test_late_arrivals_beyond_the_cap_are_dropped(tiny_corpus, tmp_path, bandwidth, max_late, delivered):
    run = Trainer(tiny_config(tiny_corpus, *FAST, "train.steps=8", "anchor.z=1", "anchor.delay=2",
                              f"anchor.bandwidth_mbit={bandwidth}", f"anchor.max_late={max_late}"),
                  tmp_path / "run", progress=False)
    summary = run.train()
    passes = summary["anchor_passes"]  # t = 0, 2, 4, 6
    assert passes == 4
    shares = passes * 4  # one per fast worker
    accounted = sum(summary[k] for k in ("anchor_delivered", "anchor_dropped_late", "anchor_pending_at_end"))
    assert accounted == shares
    if delivered:
        assert summary["anchor_delivered"] > 0 and summary["spectral_anchor_accepted"] > 0
    else:
        assert summary["anchor_delivered"] == 0 and summary["anchor_dropped_late"] > 0
        assert summary["spectral_anchor_accepted"] == 0 and summary["spectral_corrected_steps"] == 0
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        events = [e for e in map(json.loads, lines) if e["kind"] == "anchor"]
        assert sum(e.get("dropped_late", 0) for e in events) == summary["anchor_dropped_late"]
    if delivered and max_late:
        assert summary["anchor_mean_staleness"] > 2  # the slow anchor's gradients came late
    elif delivered:
        assert summary["anchor_mean_staleness"] == 2


def test_alpha_one_with_an_anchor_is_the_base_optimizer(tiny_corpus, tmp_path):
    base = [*FAST, "train.steps=5"]
    plain = Trainer(tiny_config(tiny_corpus, *base[:-1], "optim.spectral.enabled=false", "train.steps=5"),
                    tmp_path / "plain", progress=False)
    anchored = Trainer(tiny_config(tiny_corpus, *base, *ANCHOR, "optim.spectral.alpha=1"),
                       tmp_path / "anchored", progress=False)
    assert [plain.step() for _ in range(5)] == [anchored.step() for _ in range(5)]
    for wid, worker in plain.workers.items():
        for (name, p), q in zip(worker.module.named_parameters(), anchored.workers[wid].module.parameters(),
                                strict=True):
            assert torch.equal(p, q), (wid, name)
    assert anchored.plugins["anchor"].counters.delivered > 0
    # ... and the same anchor with α = 0.3 does change the weights
    mixed = Trainer(tiny_config(tiny_corpus, *base, *ANCHOR, "optim.spectral.alpha=0.3"),
                    tmp_path / "mixed", progress=False)
    for _ in range(5):
        mixed.step()
    w0 = WorkerId(0, 0)
    assert not all(torch.equal(p, q) for p, q in zip(plain.workers[w0].module.parameters(),
                                                     mixed.workers[w0].module.parameters(), strict=True))


@pytest.mark.parametrize(("mode", "sets"), [
    ("A", ["dp.name=powersgd", "dp.rank=4"]),
    ("B", ["dp.name=diloco", "dp.compress=powersgd", "dp.rank=4", "dp.inner_steps=2"]),
])
def test_the_note_dp_modes_put_the_filter_after_the_average_or_on_local_gradients(
        tiny_corpus, tmp_path, monkeypatch, mode, sets):
    """Mode A (PowerSGD per update): the filter sees the replicas' common averaged gradient. Mode B
    (streaming DiLoCo, compressed pseudo-gradients): it sees each replica's own local gradient."""
    seen: dict[tuple[WorkerId, int], torch.Tensor] = {}
    original = SpectralCorrection.correct
    owner = {}

    def spy(self):
        wid, worker = owner[id(self)]
        name = next(iter(self.params))
        seen[(wid, worker.version)] = self.params[name].grad.clone()
        original(self)

    monkeypatch.setattr(SpectralCorrection, "correct", spy)
    run = Trainer(tiny_config(tiny_corpus, *FAST, *ANCHOR, *sets, "train.steps=4"), tmp_path / "run",
                  progress=False)
    owner.update({id(w.spectral): (wid, w) for wid, w in run.workers.items()})
    summary = run.train()
    assert summary["dp_rounds"] > 0 and summary["anchor_delivered"] > 0
    assert summary["spectral_corrected_steps"] > 0
    pairs = [(seen[(WorkerId(0, s), v)], seen[(WorkerId(1, s), v)]) for s in range(2) for v in range(4)]
    if mode == "A":
        assert all(torch.equal(a, b) for a, b in pairs)
    else:
        assert not any(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("use", ["basis", "error_feedback"])
def test_a_resumed_anchored_run_equals_an_uninterrupted_one(tiny_corpus, tmp_path, use):
    """Pending arrivals, the anchor's clocks and links travel in the checkpoint; under the error
    feedback so does the gradient each worker kept for step 3 (its share is due at step 6)."""
    base = [*FAST, *ANCHOR, "anchor.delay=3", "train.steps=6", "train.checkpoint_every=2",
            f"anchor.use={use}"]
    whole = Trainer(tiny_config(tiny_corpus, *base), tmp_path / "whole", progress=False)
    whole_summary = whole.train()
    first = Trainer(tiny_config(tiny_corpus, *base, "train.stop_at_step=4"), tmp_path / "split",
                    progress=False)
    first.train()
    second = Trainer(tiny_config(tiny_corpus, *base), tmp_path / "split", progress=False, resume=True)
    split_summary = second.train()
    if use == "error_feedback":
        assert all(3 in w.spectral.feedback.kept for w in first.workers.values())
        assert whole_summary["ef_corrections"] == split_summary["ef_corrections"] > 0
    for key in ("anchor_passes", "anchor_delivered", "anchor_bytes_snapshot", "spectral_anchor_accepted"):
        assert whole_summary[key] == split_summary[key], key
    for wid, worker in whole.workers.items():
        for p, q in zip(worker.module.parameters(), second.workers[wid].module.parameters(), strict=True):
            assert torch.equal(p, q), wid


@pytest.mark.parametrize(("overrides", "hint"), [
    (["anchor.z=-1"], "anchor.z = -1: must be >= 0"),
    (["anchor.delay=0"], "anchor.delay = 0: must be >= 1"),
    (["anchor.max_late=-2"], "anchor.max_late = -2: must be >= 0"),
    (["anchor.wire_dtype=fp8"], "anchor.wire_dtype = 'fp8': allowed: ['bf16', 'fp32']"),
    (["anchor.bandwidth_mbit=-1"], "anchor.bandwidth_mbit = -1.0: must be > 0"),
    (["anchor.latency_ms=-3"], "anchor.latency_ms = -3.0: must be >= 0"),
    (["optim.spectral.targets=q,k", "anchor.targets=q,up"], "anchor.targets = 'q,up': names from"),
    (["anchor.z=1", "mesh.replicas=2"], "anchor.z = 1: the anchor feeds the spectral correction"),
    (["anchor.z=1", "optim.spectral.enabled=true", "backend=dist", "verify.name=sentinel"],
     "anchor.z = 1: under backend = dist the anchor circuit and verify.name = 'sentinel' are not combined"),
    (["anchor.z=1", "optim.spectral.enabled=true", "backend=dist", "elastic.enabled=true", "mesh.replicas=2"],
     "anchor.z = 1: under backend = dist the anchor circuit needs a fixed mesh"),
    (["anchor.z=1", "optim.spectral.enabled=true", "protocol.morph=orthogonal", "optim.name=muon"],
     "anchor.z = 1: with protocol.morph = 'orthogonal'"),
    (["anchor.z=1", "optim.spectral.enabled=true", "anchor.delay=40"],
     "anchor.max_late = 10: anchor.delay = 40 exceeds optim.spectral.max_staleness = 30"),
    (["anchor.z=1", "optim.spectral.enabled=true", "anchor.delay=25"],
     "anchor.max_late = 10: anchor.delay + anchor.max_late = 35 exceeds optim.spectral.max_staleness = 30"),
    (["anchor.send=grads"], "anchor.send = 'grads': allowed: ['factors', 'gradients']"),
    (["anchor.rank=0"], "anchor.rank = 0: must be >= 1"),
    (["anchor.weights=live"], "anchor.weights = 'live': allowed: ['outer', 'snapshot']"),
    (["anchor.use=both"], "anchor.use = 'both': allowed: ['basis', 'error_feedback']"),
    (["anchor.z=1", "optim.spectral.enabled=true", "anchor.use=error_feedback", "anchor.weights=snapshot"],
     "anchor.use = 'error_feedback': the error feedback subtracts the fast gradient from the anchor's"),
    (["anchor.z=1", "optim.spectral.enabled=true"],
     "anchor.weights = 'outer': with mesh.replicas = 1 there is no DP synchronization to listen to"),
    (["anchor.z=1", "optim.spectral.enabled=true", "mesh.replicas=2", "dp.name=sparse"],
     "anchor.weights = 'outer': under dp.name = 'sparse' the replicas agree on no weights"),
])
def test_bad_anchor_settings_are_refused_with_one_line(tiny_corpus, overrides, hint):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *overrides)
    assert str(err.value).startswith(hint) and "\n" not in str(err.value)


@pytest.mark.parametrize(("mode", "rank"), [("gradients", 0), ("factors", 64), ("factors", 5)])
def test_a_pass_charges_its_own_compute_and_counts_its_bytes_exactly(tiny_corpus, tmp_path, mode, rank):
    """One pass at P = 2, M = 2, D = 2, bf16 wire: the anchor stages are busy exactly the compute
    model's F + B per microbatch, and its bytes are the hand-off (the snapshot's 2 B per parameter
    under weights = snapshot, plus 8 B per sequence id on the first and last stage), the boundary
    (both directions, 2 B per element) and the shares to each of the D fast replicas: 2 B per
    targeted element (gradients), or r·(m + n + 1) · 2 B per matrix, r = min(rank, m, n) (factors)."""
    sets = (["anchor.send=gradients", "anchor.weights=snapshot"] if mode == "gradients" else
            ["anchor.send=factors", f"anchor.rank={rank}", "anchor.weights=outer"])
    run = Trainer(tiny_config(tiny_corpus, *FAST, "anchor.z=1", "anchor.wire_dtype=bf16", *sets),
                  tmp_path / "run", progress=False)
    circuit = run.plugins["anchor"].circuit  # pass t = 0 ran when the plugin was built
    cfg, compute = run.cfg, run.driver.compute
    micro = cfg.train.batch_size // cfg.mesh.replicas // cfg.mesh.microbatches
    for s, module in enumerate(circuit.modules):
        shape = stage_shape(module)
        expected = cfg.mesh.microbatches * sum(compute.compute_s(shape, k, micro, 0.0) for k in "FB")
        assert circuit.busy_s[WorkerId(2, s)] == pytest.approx(expected, rel=1e-12)
    params = sum(p.numel() for m in circuit.modules for p in m.parameters())
    sequences = cfg.train.batch_size // cfg.mesh.replicas
    snapshot = 2 * params if mode == "gradients" else 0
    assert circuit.bytes.snapshot == snapshot + 2 * 8 * sequences
    boundary = sequences * cfg.model.seq_len * cfg.model.d_model  # all M microbatches, one boundary
    assert circuit.bytes.boundary == 2 * 2 * boundary
    matrices = [p for s in range(2) for p in run.workers[WorkerId(0, s)].spectral.params.values()]
    if mode == "gradients":
        assert circuit.bytes.gradients == 2 * 2 * sum(p.numel() for p in matrices)
        assert circuit.bytes.factors == 0
    else:
        per_replica = sum(min(rank, m, n) * (m + n + 1) * 2 for m, n in (p.shape for p in matrices))
        assert circuit.bytes.factors == 2 * per_replica and circuit.bytes.gradients == 0
        assert any(min(p.shape) > rank for p in matrices) == (rank == 5)  # truncated only at rank 5
    assert circuit.bytes.listen == 0  # nothing synchronized yet
    assert sum(link.bytes_sent for link in circuit.links.values()) == circuit.bytes.total
    assert run.driver.network.bytes_on_axis("pp") == run.driver.network.bytes_on_axis("dp") == 0
