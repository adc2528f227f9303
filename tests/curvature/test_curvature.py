"""The curvature tracker: HVPs against finite differences, Lanczos against known spectra and dense
eigendecompositions (plain and Adam-preconditioned, a dominant negative end, power iteration as the
negative control), the convergence flag, warm starts, thresholds, and the mesh plugin."""

import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.curvature import (
    CurvatureTracker,
    HessianOperator,
    adam_threshold,
    lanczos,
    power_iteration,
    stability_ratio,
    top_eigenvalue,
)
from meshlearn.curvature.plugin import PROBE_STEP
from meshlearn.data import global_batch
from meshlearn.errors import ConfigError
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


@pytest.fixture(scope="module")
def saddle():
    """tiny_problem(0) (its negative end dominates) and its dense Hessian, built once (664 HVPs)."""
    _, params, loss_fn = tiny_problem()
    return params, loss_fn, dense_hessian(loss_fn, params)


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


def spectrum_operator(eigs: torch.Tensor, seed: int = 0):
    """A matrix-free symmetric operator with the given spectrum (fp64) and its eigenvectors."""
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(seed)))
    a = q @ torch.diag(eigs) @ q.T
    return (lambda v: [a @ v[0]]), a


def start(n: int, seed: int = 1):
    return [torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))]


def shifted(op, sigma: float):
    """A − σI: the old tracker's fallback ran power iteration on it with σ = −‖A‖."""
    return lambda v: [y - sigma * x for y, x in zip(op(v), v, strict=True)]


def test_lanczos_finds_the_top_of_a_known_spectrum_whose_negative_end_dominates():
    # Two negative outliers 1000× the top eigenvalue, a bulk in [-1, 0.5] and the top at 1.0.
    eigs = torch.cat([torch.tensor([-1000.0, -900.0], dtype=torch.float64),
                      torch.linspace(-1.0, 0.5, 197, dtype=torch.float64),
                      torch.tensor([1.0], dtype=torch.float64)])
    op, a = spectrum_operator(eigs)
    eig = lanczos(op, start(200), 30, tol=1e-3)
    assert eig.converged and eig.iterations <= 30
    assert abs(eig.value - 1.0) < 1e-5 and abs(eig.bottom + 1000.0) < 1e-6
    y = eig.vector[0]
    explicit = ((a @ y - eig.value * y).norm() / abs(eig.value)).item()
    assert explicit == pytest.approx(eig.residual, rel=1e-3, abs=1e-12)  # the free residual is right
    assert eig.residual <= 1e-3
    # Power iteration finds the negative end; the old shifted fallback (A + ‖A‖I, 5 iterations)
    # lands in the bulk, and its residual, relative to the *shifted* eigenvalue, looked converged.
    assert abs(power_iteration(op, start(200), 50, tol=1e-9).value + 1000.0) < 1.0
    old = power_iteration(shifted(op, -1000.0), start(200), 5, tol=1e-12)
    assert old.residual < 1e-2  # what the old tracker logged as its residual
    assert abs((old.value - 1000.0) - 1.0) > 0.3  # and its value was far off the top


def test_an_estimate_capped_too_low_is_flagged_unconverged(saddle):
    params, loss_fn, h = saddle
    truth = torch.linalg.eigvalsh(h)[-1].item()
    few = top_eigenvalue(loss_fn, params, iters=4, generator=torch.Generator().manual_seed(0))
    enough = top_eigenvalue(loss_fn, params, iters=30, generator=torch.Generator().manual_seed(0))
    assert not few.converged and few.residual > 1e-2 and few.iterations == 4
    assert few.value < truth  # an unconverged top Ritz value is a lower bound, not an overshoot
    assert enough.converged and enough.residual <= 1e-2 and enough.iterations < 30
    assert abs(enough.value - truth) / truth < 0.01


def test_top_eigenvalue_matches_a_dense_hessian_whose_negative_end_dominates(saddle):
    params, loss_fn, h = saddle
    assert torch.allclose(h, h.T, atol=1e-8)
    eigs = torch.linalg.eigvalsh(h)
    dominant = eigs[eigs.abs().argmax()].item()
    top = eigs[-1].item()
    assert dominant < 0 < top and abs(dominant) > 1.4 * top  # a saddle direction larger than the top
    assert abs(eigs[-2].item() - top) / top > 0.05  # the answer is not just any eigenvalue
    result = top_eigenvalue(loss_fn, params, iters=20, generator=torch.Generator().manual_seed(0))
    assert result.converged and abs(result.value - top) / top < 0.01
    assert abs(result.bottom - dominant) / abs(dominant) < 0.01  # both ends from the same products
    # Negative controls: power iteration with as many products does not get the top.
    op = HessianOperator(loss_fn, params)
    plain = power_iteration(op, start_like(params), 20, tol=1e-12)
    assert plain.value < 0  # it heads for the magnitude-dominant end
    old = power_iteration(shifted(op, -abs(dominant)), start_like(params), 5, tol=1e-12)
    assert abs((old.value - abs(dominant)) - top) / top > 0.3  # the old 5-iteration fallback
    # method="power" is the paper's estimator: with enough iterations, the magnitude-dominant one.
    power = top_eigenvalue(loss_fn, params, iters=300, tol=1e-6, method="power",
                           generator=torch.Generator().manual_seed(0))
    assert abs(power.value - dominant) / abs(dominant) < 0.01


def start_like(params, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]


def test_preconditioned_value_matches_an_explicit_eigendecomposition():
    _, params, loss_fn = tiny_problem(1)
    h = dense_hessian(loss_fn, params)
    gen = torch.Generator().manual_seed(3)
    precond = [torch.rand(p.shape, dtype=torch.float64, generator=gen) * 0.9 + 0.1 for p in params]
    d = flat(precond).rsqrt()
    g = d[:, None] * h * d[None, :]
    eigs = torch.linalg.eigvalsh(g)
    result = top_eigenvalue(loss_fn, params, iters=30, precond=precond, generator=gen)
    assert result.converged and abs(result.value - eigs[-1].item()) / eigs[-1].item() < 0.01
    assert abs(eigs[-1].item() - torch.linalg.eigvalsh(h)[-1].item()) / eigs[-1].item() > 0.05


def test_unknown_method_is_refused():
    _, params, loss_fn = tiny_problem()
    with pytest.raises(ValueError, match="method"):
        top_eigenvalue(loss_fn, params, method="arnoldi")


def drifting_operators(steps: int):
    """A slowly changing H (‖ΔH‖ = 1/6 of the top gap per step), 200-dim, as matrix-free operators."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(200, 200, dtype=torch.float64, generator=gen))
    spectrum = torch.cat([torch.tensor([10.0], dtype=torch.float64),
                          torch.linspace(7.0, -3.0, 199, dtype=torch.float64)])
    base = q @ torch.diag(spectrum) @ q.T
    drift = torch.randn(200, 200, dtype=torch.float64, generator=gen)
    drift = 0.5 * (drift + drift.T) / drift.norm()
    return [(lambda v, a=base + k * drift: [a @ v[0]]) for k in range(steps)], gen


def test_warm_starts_converge_in_fewer_iterations_than_random_starts():
    ops, gen = drifting_operators(8)
    warm, cold, vector = [], [], None
    for k, op in enumerate(ops):
        n_cold = lanczos(op, start(200, 100 + k), 30, tol=1e-4)
        n_warm = lanczos(op, vector or start(200, 200 + k), 30, tol=1e-4)
        assert n_cold.converged and n_warm.converged
        vector = n_warm.vector
        if k:
            warm.append(n_warm.iterations)
            cold.append(n_cold.iterations)
    assert sum(warm) < 0.6 * sum(cold), (warm, cold)


def test_power_iteration_warm_starts_too():
    ops, gen = drifting_operators(8)
    warm, cold, vector = [], [], None
    for k, op in enumerate(ops):
        n_cold = power_iteration(op, start(200, 100 + k), 500, tol=1e-4)
        n_warm = power_iteration(op, vector or start(200, 200 + k), 500, tol=1e-4)
        vector = n_warm.vector
        if k:
            warm.append(n_warm.iterations)
            cold.append(n_cold.iterations)
    assert sum(warm) < 0.5 * sum(cold), (warm, cold)


def test_stability_thresholds():
    assert adam_threshold(1e-3, 0.9) == pytest.approx(38 / 1e-3)
    assert adam_threshold(1e-3, 0.95) == pytest.approx(78 / 1e-3)
    assert stability_ratio(38 / 1e-3, 1e-3, 0.9) == pytest.approx(1.0)


def test_a_full_estimate_below_one_of_its_blocks_reruns_from_that_block():
    """A warm start that is an eigenvector of the full H for a lower eigenvalue converges at once,
    to the wrong (lower) value; the diagonal blocks expose it and the rerun recovers the top."""
    gen = torch.Generator().manual_seed(0)
    mats = []
    for top in (5.0, 3.0):
        q, _ = torch.linalg.qr(torch.randn(30, 30, dtype=torch.float64, generator=gen))
        mats.append(q @ torch.diag(torch.cat([torch.tensor([top], dtype=torch.float64),
                                              torch.linspace(-2.0, 1.0, 29, dtype=torch.float64)])) @ q.T)
    x = [torch.randn(30, dtype=torch.float64, generator=gen, requires_grad=True) for _ in mats]
    op = HessianOperator(lambda: sum(0.5 * xi @ a @ xi for xi, a in zip(x, mats, strict=True)), x)
    tracker = CurvatureTracker(iters=40, seed=0, tol=1e-6)
    names = ["a", "b"]
    blocks = {f"stage{s}": tracker.estimate(f"stage{s}", op, [s], [names[s]]) for s in (0, 1)}
    assert [round(b.value, 6) for b in blocks.values()] == [5.0, 3.0]
    start_b = [torch.zeros(30, dtype=torch.float64), tracker.vectors["stage1"]["b"]]  # block b's top
    stuck = tracker.estimate("full", op, [0, 1], names, v0=start_b)
    assert stuck.converged and abs(stuck.value - 3.0) < 1e-6  # converged, but not to the top
    fixed, reran = tracker.reconcile("full", op, [0, 1], names, stuck, blocks)
    assert reran and fixed.converged and abs(fixed.value - 5.0) < 1e-6
    assert fixed.hvps > stuck.hvps
    again, reran = tracker.reconcile("full", op, [0, 1], names, fixed, blocks)
    assert not reran and again is fixed


def test_a_warm_start_on_a_lower_eigenvector_still_finds_the_top():
    """The previous Ritz vector is an exact eigenvector of a lower eigenvalue (the top moved):
    started on it alone Lanczos converges there at once; the tracker's warm start mixes in a random
    share (``WARM_MIX``), so the Krylov space sees the top and the estimate gets it."""
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64, generator=gen))
    eigenvalues = torch.cat([torch.tensor([6.0, 4.0], dtype=torch.float64),
                             torch.linspace(-3.0, 1.0, 38, dtype=torch.float64)])
    a = q @ torch.diag(eigenvalues) @ q.T
    x = torch.randn(40, dtype=torch.float64, generator=gen, requires_grad=True)
    op = HessianOperator(lambda: 0.5 * x @ a @ x, [x])
    lower = q[:, 1].clone()  # the eigenvector of 4.0
    stuck = lanczos(lambda v: op(v, [0]), [lower], 30, None, 1e-6)
    assert stuck.converged and abs(stuck.value - 4.0) < 1e-6  # the negative control
    tracker = CurvatureTracker(iters=30, seed=0, tol=1e-6)
    tracker.vectors["full"] = {"x": lower}
    found = tracker.estimate("full", op, [0], ["x"])
    assert found.converged and abs(found.value - 6.0) < 1e-6


# --- the plugin ----------------------------------------------------------------------------------


def records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r["kind"] == kind]


def test_tracker_in_the_mesh_logs_full_and_per_stage_values_and_changes_nothing(tiny_corpus, tmp_path):
    common = ["mesh.stages=2", "mesh.replicas=1", "train.steps=2"]
    trainer = Trainer(tiny_config(tiny_corpus, *common, "curvature.every=2", "curvature.iters=30",
                                  "curvature.batch_size=4"),
                      tmp_path / "c", progress=False)
    summary = trainer.train()
    Trainer(tiny_config(tiny_corpus, *common), tmp_path / "b", progress=False).train()
    assert [r["train_loss"] for r in records(tmp_path / "c", "train")] == \
        [r["train_loss"] for r in records(tmp_path / "b", "train")]  # a pure diagnostic
    curv = records(tmp_path / "c", "curvature")
    assert [r["step"] for r in curv] == [2]
    last = curv[-1]
    for key in ("lambda_max", "lambda_max_precond", "lambda_min", "stability_ratio", "curvature_s",
                "curvature_hvps"):
        assert last[key] is not None and last[key] == last[key], key
    assert len(last["lambda_max_stage"]) == 2 and len(last["lambda_max_precond_stage"]) == 2
    assert last["lambda_max_converged"] is True and last["lambda_max_residual"] <= 1e-2
    assert last["lambda_max_precond_converged"] is True
    assert last["lambda_max_stage_converged"] == [True, True]
    assert summary["curvature_evals"] == 1 and summary["curvature_hvps"] == last["curvature_hvps"] >= 6
    # The full-model value is the unsplit model's on the probe batch.
    cfg = trainer.cfg
    model = merge_stages(cfg.model, [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(2)])
    x, y = global_batch(trainer.corpus.splits.train, PROBE_STEP, cfg.curvature.batch_size,
                        cfg.model.seq_len, cfg.seed)
    ref = top_eigenvalue(lambda: Decoder.loss(model(x), y), list(model.parameters()), iters=60, tol=1e-4,
                         generator=torch.Generator().manual_seed(5))
    assert ref.converged and abs(ref.value - last["lambda_max"]) / ref.value < 0.01


def test_per_stage_values_are_lower_bounds_on_the_full_value_in_the_simulator(tiny_corpus, tmp_path):
    """Per-stage blocks are diagonal blocks of H (and of G), so λ_max(full) ≥ each block's λ_max:
    the logged converged values must respect it (to the tolerance of the full estimate)."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=4", "mesh.microbatches=4", "train.steps=2",
                      "curvature.every=1", "curvature.iters=30", "curvature.batch_size=2")
    Trainer(cfg, tmp_path / "c", progress=False).train()
    curv = records(tmp_path / "c", "curvature")
    assert len(curv) == 2
    tol = cfg.curvature.tol
    for r in curv:
        assert "lambda_max_restarted" in r and "lambda_max_precond_restarted" in r
        for key in ("lambda_max", "lambda_max_precond"):
            assert r[f"{key}_converged"] and r[f"{key}_stage_converged"] == [True] * 4, (r["step"], key)
            assert max(r[f"{key}_stage"]) <= r[key] * (1 + tol), (r["step"], key)
            assert max(r[f"{key}_stage"]) > 0.05 * r[key]  # the blocks carry real curvature


def test_unconverged_estimates_are_flagged_in_the_metrics(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, "train.steps=1", "curvature.every=1", "curvature.iters=2")
    Trainer(cfg, tmp_path / "c", progress=False).train()
    (r,) = records(tmp_path / "c", "curvature")
    assert r["lambda_max_converged"] is False and r["lambda_max_residual"] > cfg.curvature.tol
    assert r["lambda_max_iters"] == 2 and r["lambda_max_precond_converged"] is False


def test_tracker_config_is_validated(tiny_corpus):
    with pytest.raises(ConfigError, match="curvature.iters"):
        tiny_config(tiny_corpus, "curvature.iters=0")
    with pytest.raises(ConfigError, match="curvature.tol"):
        tiny_config(tiny_corpus, "curvature.tol=0")
    with pytest.raises(ConfigError, match="curvature.every"):
        tiny_config(tiny_corpus, "curvature.every=5", "backend=dist")
