"""Strategy by name: ``dp.name`` → a ``DPStrategy`` for one worker (built-in, or a plug-in's:
``dp/strategies.py``)."""

from __future__ import annotations

from collections.abc import Callable

from meshlearn.dp import strategies
from meshlearn.dp.base import DPStrategy, round_deadline_s
from meshlearn.dp.diloco import StreamingDiLoCo
from meshlearn.dp.powersgd import PowerSGD
from meshlearn.dp.robust import Robust
from meshlearn.dp.settings import DPConfig
from meshlearn.dp.sparse import SparseAveraging


class AllReduce(DPStrategy):
    """``dp.name = allreduce``: the blocking fp32 mean of gradients at every update, run by the
    drivers' built-in ring all-reduce (exact; replicas stay bitwise identical)."""

    name = "allreduce"
    collective = True
    drifts = False


def _deadline(cfg: DPConfig, nbytes: int, profile) -> float:
    return cfg.deadline_s if cfg.deadline_s > 0 else round_deadline_s(nbytes, profile)


def _sparse(cfg: DPConfig, worker, profile) -> DPStrategy:
    strategy = SparseAveraging(
        worker.id, worker.mesh.replicas, worker.module, worker.optimizer, fraction=cfg.fraction,
        delay=cfg.delay, every=cfg.every, rule=cfg.rule, lam=cfg.lam, m0=cfg.ema_m,
        m1=cfg.ema_m_final, warm=cfg.ema_warm_updates, ramp_end=cfg.ema_ramp_end,
        ema_init=cfg.ema_init, moments=cfg.moments, seed=cfg.seed, deadline_s=None)
    # The largest round's part (moments: up to 3 tensors per parameter) on this worker's DP link.
    factor = 3 if cfg.moments else 1
    nbytes = 4 * factor * max(strategy.round_numel(r) for r in range(strategy.parts))
    strategy._deadline_s = _deadline(cfg, nbytes, profile)
    return strategy


def _powersgd(cfg: DPConfig, worker, profile) -> DPStrategy:
    return PowerSGD(worker.id, worker.mesh.replicas, worker.module, rank=cfg.rank, seed=cfg.seed)


def _diloco(cfg: DPConfig, worker, profile) -> DPStrategy:
    strategy = StreamingDiLoCo(
        worker.id, worker.mesh.replicas, worker.module, inner_steps=cfg.inner_steps,
        fragments=cfg.fragments, overlap=cfg.overlap, outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum, merge_weight=cfg.merge_weight, deadline_s=None,
        compress=cfg.compress, rank=cfg.rank, seed=cfg.seed)
    if strategy.compressors is None:
        nbytes = 4 * max(strategy.fragment_numel(f) for f in range(len(strategy.fragments)))
    else:  # the larger of a sync's two rounds
        nbytes = 4 * max(max(c.wire_values()) for c in strategy.compressors)
    strategy._deadline_s = _deadline(cfg, nbytes, profile)
    return strategy


BUILDERS: dict[str, Callable] = {
    "allreduce": lambda cfg, worker, profile: AllReduce(worker.id, worker.mesh.replicas),
    "sparse": _sparse,
    "powersgd": _powersgd,
    "diloco": _diloco,
}
assert tuple(BUILDERS) == strategies.BUILT_IN


def builder_of(name: str) -> Callable:
    """The builder of strategy ``name``: a built-in one, else the plug-in's (``dp/strategies.py``)."""
    if name in BUILDERS:
        return BUILDERS[name]
    if name not in strategies.plugins():
        raise ValueError(f"dp.name = {name!r}: allowed: {list(strategies.names())}")
    return strategies.load(name)


def robust_of(cfg: DPConfig) -> Robust:
    """The aggregation rule of ``dp.robust`` / ``dp.trim``."""
    return Robust(cfg.robust, cfg.trim)


def build_strategy(cfg: DPConfig, worker, profile) -> DPStrategy:
    """The strategy of ``worker`` (built after its module and optimizer); ``profile``: the
    LinkProfile of its DP links, from which default deadlines derive. Its parts leave through
    the worker's ``dp_contribution`` (the seam of ``attack.target = dp``); its outlier scores in
    robust rounds go to the worker's ``note_round_score`` (attribution)."""
    strategy = builder_of(cfg.name)(cfg, worker, profile)
    strategy.exchange.robust = robust_of(cfg)
    strategy.outgoing = worker.dp_contribution
    strategy.scored = worker.note_round_score
    return strategy
