"""The curvature tracker: HVPs against finite differences, power iteration against dense
eigendecompositions (plain and Adam-preconditioned), warm starts, thresholds, and the mesh plugin."""

import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.config import ConfigError
from meshlearn.curvature import (
    CurvatureTracker,
    HessianOperator,
    adam_threshold,
    power_iteration,
    stability_ratio,
    top_eigenvalue,
)
from meshlearn.curvature.plugin import PROBE_STEP
from meshlearn.data import global_batch
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, DecoderConfig, init_model, merge_stages
from meshlearn.train import Trainer

TINY = DecoderConfig(vocab_size=12, n_layer=1, d_model=8, n_head=2, seq_len=6, ffn_hidden=8)


def tiny_problem(seed: int = 0):
    """A 1-layer decoder in fp64 with ~500 parameters, and its loss on a fixed batch."""
    model = init_model(TINY, seed).double()
    with torch.no_grad():  # larger weights than init: a Hessian with some structure
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=gen)
    params = list(model.parameters())
    return model, params, lambda: Decoder.loss(model(x[:, :-1]), x[:, 1:])


def dense_hessian(loss_fn, params) -> torch.Tensor:
    op = HessianOperator(loss_fn, params)
    sizes = [p.numel() for p in params]
    n = sum(sizes)
    rows = []
    for i in range(n):
        e = torch.zeros(n, dtype=torch.float64)
        e[i] = 1.0
        parts = [t.view_as(p) for t, p in zip(e.split(sizes), params, strict=True)]
        rows.append(torch.cat([h.reshape(-1) for h in op(parts)]))
    return torch.stack(rows)


def flat(vs):
    return torch.cat([v.reshape(-1) for v in vs])


def test_hvp_matches_a_central_finite_difference_in_fp64():
    _, params, loss_fn = tiny_problem()
    v = [torch.randn(p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
         for i, p in enumerate(params)]
    hv = flat(HessianOperator(loss_fn, params)(v))
    eps = 1e-5

    def grad_at(sign):
        with torch.no_grad():
            for p, d in zip(params, v, strict=True):
                p.add_(d, alpha=sign * eps)
        g = flat(torch.autograd.grad(loss_fn(), params))
        with torch.no_grad():
            for p, d in zip(params, v, strict=True):
                p.add_(d, alpha=-sign * eps)
        return g

    fd = (grad_at(1) - grad_at(-1)) / (2 * eps)
    assert ((hv - fd).norm() / fd.norm()).item() < 1e-3
    assert ((hv - 0.5 * fd).norm() / fd.norm()).item() > 0.1  # the check can fail


def test_power_iteration_recovers_a_known_spectrum():
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64, generator=gen))
    eigs = torch.tensor([10.0, 6.0] + [1.0] * 18, dtype=torch.float64)
    a = q @ torch.diag(eigs) @ q.T
    x = torch.randn(20, dtype=torch.float64, requires_grad=True)
    result = top_eigenvalue(lambda: 0.5 * x @ a @ x, [x], iters=200,
                            generator=torch.Generator().manual_seed(1))
    assert abs(result.value - 10.0) < 1e-8
    # Most negative dominates in magnitude: plain power iteration returns it, the tracker the top.
    a2 = q @ torch.diag(torch.tensor([-20.0, 4.0] + [1.0] * 18, dtype=torch.float64)) @ q.T
    op = HessianOperator(lambda: 0.5 * x @ a2 @ x, [x])
    v0 = [torch.randn(20, dtype=torch.float64, generator=torch.Generator().manual_seed(2))]
    assert abs(power_iteration(op, v0, 300).value + 20.0) < 1e-6
    tracker = CurvatureTracker(iters=300, seed=0)
    assert abs(tracker.estimate("a", op, [0], ["x"]).value - 4.0) < 1e-3


def test_top_eigenvalue_matches_a_dense_hessian_of_a_tiny_model():
    _, params, loss_fn = tiny_problem()
    h = dense_hessian(loss_fn, params)
    assert torch.allclose(h, h.T, atol=1e-8)
    eigs = torch.linalg.eigvalsh(h)
    dominant = eigs[eigs.abs().argmax()].item()
    assert dominant < 0 < eigs[-1]  # this problem has a saddle direction larger than its top
    result = top_eigenvalue(loss_fn, params, iters=300, generator=torch.Generator().manual_seed(0))
    assert abs(result.value - dominant) / abs(dominant) < 0.01
    assert abs(eigs[1].item() - dominant) / abs(dominant) > 0.05  # not just any eigenvalue
    # The tracker reports the top (algebraically largest) eigenvalue: it reruns with a shift.
    op = HessianOperator(loss_fn, params)
    top = CurvatureTracker(iters=300, seed=0).estimate("full", op, range(len(params)),
                                                      [str(i) for i in range(len(params))])
    assert abs(top.value - eigs[-1].item()) / eigs[-1].item() < 0.01
    assert abs(eigs[-2].item() - eigs[-1].item()) / eigs[-1].item() > 0.05


def test_preconditioned_value_matches_an_explicit_eigendecomposition():
    _, params, loss_fn = tiny_problem(1)
    h = dense_hessian(loss_fn, params)
    gen = torch.Generator().manual_seed(3)
    precond = [torch.rand(p.shape, dtype=torch.float64, generator=gen) * 0.9 + 0.1 for p in params]
    d = flat(precond).rsqrt()
    g = d[:, None] * h * d[None, :]
    eigs = torch.linalg.eigvalsh(g)
    dominant = eigs[eigs.abs().argmax()].item()
    result = top_eigenvalue(loss_fn, params, iters=400, precond=precond, generator=gen)
    assert abs(result.value - dominant) / abs(dominant) < 0.01
    assert abs(dominant - eigs_of(h)) / abs(dominant) > 0.05  # preconditioning changed the answer


def eigs_of(h):
    e = torch.linalg.eigvalsh(h)
    return e[e.abs().argmax()].item()


def test_warm_starts_converge_in_fewer_iterations_than_random_starts():
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(200, 200, dtype=torch.float64, generator=gen))
    spectrum = torch.cat([torch.tensor([10.0], dtype=torch.float64),
                          torch.linspace(7.0, 0.1, 199, dtype=torch.float64)])
    base = q @ torch.diag(spectrum) @ q.T
    drift = torch.randn(200, 200, dtype=torch.float64, generator=gen)
    drift = 0.5 * (drift + drift.T) / drift.norm()  # a slowly changing H (‖ΔH‖ = 1/6 of the gap)
    x = torch.randn(200, dtype=torch.float64, requires_grad=True)

    def iterations(op, v0, truth):
        eig = power_iteration(op, v0, 500)
        return next(i for i, lam in enumerate(eig.history) if abs(lam - truth) <= 1e-6 * truth) + 1, eig

    warm, cold, vector = [], [], None
    for k in range(8):
        a = base + k * drift
        truth = torch.linalg.eigvalsh(a)[-1].item()
        op = HessianOperator(lambda a=a: 0.5 * x @ a @ x, [x])
        n_cold, _ = iterations(op, [torch.randn(200, dtype=torch.float64, generator=gen)], truth)
        n_warm, eig = iterations(op, vector or [torch.randn(200, dtype=torch.float64, generator=gen)], truth)
        vector = eig.vector
        if k:
            warm.append(n_warm)
            cold.append(n_cold)
    assert sum(warm) < 0.5 * sum(cold), (warm, cold)


def test_stability_thresholds():
    assert adam_threshold(1e-3, 0.9) == pytest.approx(38 / 1e-3)
    assert adam_threshold(1e-3, 0.95) == pytest.approx(78 / 1e-3)
    assert stability_ratio(38 / 1e-3, 1e-3, 0.9) == pytest.approx(1.0)


# --- the plugin ----------------------------------------------------------------------------------


def records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r["kind"] == kind]


def test_tracker_in_the_mesh_logs_full_and_per_stage_values_and_changes_nothing(tiny_corpus, tmp_path):
    common = ["mesh.stages=2", "mesh.replicas=1", "train.steps=2"]
    trainer = Trainer(tiny_config(tiny_corpus, *common, "curvature.every=2", "curvature.iters=40",
                                  "curvature.batch_size=4"),
                      tmp_path / "c", progress=False)
    summary = trainer.train()
    Trainer(tiny_config(tiny_corpus, *common), tmp_path / "b", progress=False).train()
    assert [r["train_loss"] for r in records(tmp_path / "c", "train")] == \
        [r["train_loss"] for r in records(tmp_path / "b", "train")]  # a pure diagnostic
    curv = records(tmp_path / "c", "curvature")
    assert [r["step"] for r in curv] == [2]
    last = curv[-1]
    for key in ("lambda_max", "lambda_max_precond", "stability_ratio", "curvature_s", "curvature_hvps"):
        assert last[key] is not None and last[key] == last[key], key
    assert len(last["lambda_max_stage"]) == 2 and len(last["lambda_max_precond_stage"]) == 2
    assert last["lambda_max_residual"] < 0.05  # converged: the bound below holds for converged values
    assert max(last["lambda_max_stage"]) <= last["lambda_max"] * 1.01  # diagonal blocks: lower bounds
    assert summary["curvature_evals"] == 1 and summary["curvature_hvps"] >= 6 * 40
    # The full-model value is the unsplit model's on the probe batch.
    cfg = trainer.cfg
    model = merge_stages(cfg.model, [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(2)])
    x, y = global_batch(trainer.corpus.splits.train, PROBE_STEP, cfg.curvature.batch_size,
                        cfg.model.seq_len, cfg.seed)
    ref = top_eigenvalue(lambda: Decoder.loss(model(x), y), list(model.parameters()), iters=80,
                         generator=torch.Generator().manual_seed(5))
    assert abs(ref.value - last["lambda_max"]) / ref.value < 0.02


def test_tracker_config_is_validated(tiny_corpus):
    with pytest.raises(ConfigError, match="curvature.iters"):
        tiny_config(tiny_corpus, "curvature.iters=0")
    with pytest.raises(ConfigError, match="curvature.every"):
        tiny_config(tiny_corpus, "curvature.every=5", "backend=dist")
