"""The data-parallel axis's config section (``dp.*``): which strategy syncs a stage's replicas.

Kept free of torch so the config tree can import it. ``validate_dp`` is called by
``config.validate`` and owns every check of this section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlearn.dp import strategies

RULES = ("avg", "delta", "ema")
EMA_INITS = ("first_round", "per_coordinate")
COMPRESSIONS = ("none", "powersgd")
ROBUST_RULES = ("none", "trimmed_mean", "median", "centered_clip")  # dp.robust (meshlearn.dp.robust)


@dataclass(frozen=True)
class DPConfig:
    """How the replicas of one stage stay together. Config keys under ``dp.``.

    Strategies (docs/asyncmesh.md):

    - ``allreduce``: the blocking fp32 mean of gradients every update (exact; the default).
    - ``sparse``: AsyncMesh's asynchronous sparse parameter averaging: after every ``dp.every``-th
      update a rotating slice of ``dp.fraction`` of every tensor is averaged over the replicas in
      the background and applied ``dp.delay`` updates later by ``dp.rule``.
    - ``powersgd``: gradients compressed to rank ``dp.rank`` with error feedback and a warm start.
    - ``diloco``: streaming DiLoCo: ``dp.fragments`` parameter fragments, each synced every
      ``dp.inner_steps`` updates at staggered offsets through an outer Nesterov step; with
      ``dp.compress = powersgd`` its pseudo-gradients travel as rank-``dp.rank`` factors.

    The method note of mesh adaptation names two DP modes (docs/adaptation.md): A, per-update
    gradient averaging before the spectral filter = ``powersgd``; B, streaming DiLoCo with
    compressed pseudo-gradients and the filter on local gradients = ``diloco`` + ``compress``.
    """

    name: str = "allreduce"
    """allreduce, sparse, powersgd or diloco; or a plug-in's name (an installed package's entry point
    in the group ``meshlearn.dp_strategies``: docs/architecture.md, Where a new method plugs in)."""
    fraction: float = 0.05
    """sparse: fraction p of each tensor's elements averaged per round, in (0, 1]. The tensor is
    cut into K = ⌈1/p⌉ disjoint parts by a seeded affine permutation, so no index travels and
    every element is averaged once every K rounds."""
    delay: int = 10
    """sparse: updates between a round's start and its application (0 = synchronous SPARTA: the
    round is waited for). diloco uses dp.overlap instead."""
    every: int = 1
    """sparse: a round starts after every ``every``-th update of the stage (agora: 20)."""
    rule: str = "ema"
    """sparse: how a round's average a is applied to the local slice w[S], with u = w[S] − (the
    slice when the round started): ``avg`` w[S] ← a (AsyncSPARTA); ``delta`` w[S] ← a + λu;
    ``ema`` e[S] ← m·e[S] + (1−m)·u, w[S] ← a + λ·e[S] (AsyncMesh)."""
    lam: float = 1.0
    """sparse: λ of the delta and ema rules (1 keeps the across-replica mean exactly under delta)."""
    ema_m: float = 0.5
    """sparse, ema: m until dp.ema_warm_updates."""
    ema_m_final: float = 0.99
    """sparse, ema: m reached by cosine at dp.ema_ramp_end (the method note's 0.5 → 0.99)."""
    ema_warm_updates: int = 1000
    """sparse, ema: updates at m = dp.ema_m before the cosine ramp starts."""
    ema_ramp_end: int = 30000
    """sparse, ema: the update at which m reaches dp.ema_m_final."""
    ema_init: str = "first_round"
    """sparse, ema: ``first_round``: e starts as the first applied round's drift, later-visited
    coordinates from 0 (the reference code); ``per_coordinate``: each coordinate starts from its
    own first drift."""
    moments: bool = False
    """sparse: also average the optimizer's moment tensors (exp_avg, exp_avg_sq, momentum) on the
    same indices (agora); step counters are never touched. Second moments are clamped at 0."""
    deadline_s: float = 0.0
    """sparse (delay > 0) and diloco (overlap > 0): seconds after a round's start by which every
    peer's part must have arrived, else the round is dropped (its slice waits for its next turn).
    0 = derived from the DP link: twice the modelled transfer of one round. If summary.json shows
    ``dp_dropped_rounds`` above a few percent of ``dp_rounds``, raise it. Not used with
    elastic.enabled: rounds are reduced inside their step (docs/elastic.md)."""
    seed: int = 1337
    """Seeds the sparse partitions and PowerSGD's initial Q (the same on every replica)."""
    rank: int = 4
    """powersgd: rank r of the factors of each matrix gradient (capped at its smaller side;
    vectors travel uncompressed). r = the smaller side reproduces the all-reduce."""
    inner_steps: int = 10
    """diloco: H, updates between two syncs of one fragment."""
    fragments: int = 1
    """diloco: parameter fragments (whole tensors, in order) synced at staggered offsets."""
    overlap: int = 0
    """diloco: updates between a fragment's sync start and the merge of its result (0 = waited for)."""
    outer_lr: float = 0.7
    """diloco: learning rate of the outer Nesterov step on the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """diloco: Nesterov momentum of the outer step (0 = plain SGD)."""
    merge_weight: float = 0.5
    """diloco: α of the merge θ_local ← α·θ_outer + (1−α)·θ_local (1 = take the outer weights)."""
    compress: str = "none"
    """diloco: ``none`` (the pseudo-gradient's fp32 mean) or ``powersgd`` (rank ``dp.rank`` factors
    with error feedback and a warm start, two rounds per sync; vectors travel whole)."""
    robust: str = "none"
    """How every strategy aggregates its D contributions (docs/dp_robust.md): ``none`` (the mean),
    ``trimmed_mean`` (per coordinate, without the dp.trim largest and smallest), ``median``
    (per coordinate) or ``centered_clip`` (iterative clipping around the median). A robust rule
    needs every contribution whole: the all-reduce becomes an all-gather ((D − 1)·N bytes sent
    per replica instead of the ring's 2(D − 1)/D·N). Needs mesh.replicas >= 3."""
    trim: int = 1
    """trimmed_mean: values dropped at each end per coordinate (the outliers tolerated); 2·trim <
    mesh.replicas."""
    outlier_score: float = 3.0
    """With a robust rule: a replica whose contribution to a stage's reduce lies more than this
    many times the median replica's distance from the aggregate is marked an outlier of that update;
    one marked in 3 of its last 8 updates is reported and evicted like a SENTINEL ban, within the
    same budget (verify.ban_budget: a strict minority of each stage, never an end assumed honest;
    verify.ban = false reports only; so do sparse with dp.delay > 0 and diloco with dp.overlap > 0,
    never at a drain point at a step's end, PowerSGD factors, whose error feedback keeps an
    honest replica an outlier, mesh.schedule = async, whose step ends are no drain points, and
    elastic runs, whose stage records do not evict yet). Every
    strategy's rounds are scored (the all-reduce's gradients, sparse slices, PowerSGD factors,
    DiLoCo pseudo-gradients). docs/dp_robust.md, Attribution. > 1."""


def scores_dp_outliers(cfg) -> bool:
    """Whether the run scores each replica's DP contribution (``dp/attribution.py``): with a robust
    rule, which is what scores them (per update, under every schedule)."""
    return cfg.dp.robust != "none"


def merges_within_update(dp: DPConfig) -> bool:
    """Whether every DP round is merged by the update that starts it, so every worker is at a
    drain point at each step's end: not sparse with ``delay`` > 0 nor diloco with ``overlap`` > 0,
    whose rounds run behind the updates (one is always open)."""
    return not ((dp.name == "sparse" and dp.delay > 0) or (dp.name == "diloco" and dp.overlap > 0))


def feeds_back_error(dp: DPConfig) -> bool:
    """Whether the DP rounds carry PowerSGD factors with error feedback (powersgd; diloco with
    ``compress = powersgd``)."""
    return dp.name == "powersgd" or (dp.name == "diloco" and dp.compress == "powersgd")


def evicts_dp_outliers(cfg) -> bool:
    """Whether a reported DP outlier is evicted (``TrustLayer.evict``): scored, bans are on, the
    strategy's rounds are merged within their update, and they carry no error feedback.

    An eviction hands the slot a donor's whole state at the step's end, which exists only at a
    drain point; with rounds running behind the updates there is none, nor under ``async``
    (SENTINEL's bans wait there for the next drain point, ``TrustLayer.pending_bans``; a DP
    report's eviction would have to wait the same way: not built). With error feedback an honest
    replica's score is not calibrated: the part of its factors a robust rule leaves out stays in
    its error and comes back larger, so it stays an outlier (honest replicas were evicted on the
    demo: docs/dp_robust.md). In both cases a report is a report only. So is one under elastic
    membership: an eviction there must come from the stage's honest members leaving the
    outlier out of their quorum's record (it cannot be trusted to leave), which the control
    service's records do not take yet (SENTINEL's elastic evictions are its verifier's, which
    that membership does not run: elastic/evictions.py)."""
    return (scores_dp_outliers(cfg) and cfg.verify.ban and merges_within_update(cfg.dp)
            and not feeds_back_error(cfg.dp) and not cfg.elastic.enabled and cfg.mesh.schedule != "async")


def validate_dp(cfg, require) -> None:
    """The checks of ``dp.*`` (``require(ok, key, value, allowed)`` raises the ConfigError)."""
    dp = cfg.dp
    validate_name(dp.name, require)
    require(0 < dp.fraction <= 1, "dp.fraction", dp.fraction, "in (0, 1]")
    require(dp.delay >= 0, "dp.delay", dp.delay, "must be >= 0 (0 = synchronous)")
    require(dp.every >= 1, "dp.every", dp.every, "must be >= 1")
    require(dp.rule in RULES, "dp.rule", dp.rule, f"allowed: {list(RULES)}")
    require(math.isfinite(dp.lam), "dp.lam", dp.lam, "must be a finite number")
    for key, value in [("dp.ema_m", dp.ema_m), ("dp.ema_m_final", dp.ema_m_final)]:
        require(0 <= value < 1, key, value, "in [0, 1)")
    require(0 <= dp.ema_warm_updates <= dp.ema_ramp_end, "dp.ema_ramp_end", dp.ema_ramp_end,
            f"must be >= dp.ema_warm_updates = {dp.ema_warm_updates} (and both >= 0)")
    require(dp.ema_init in EMA_INITS, "dp.ema_init", dp.ema_init, f"allowed: {list(EMA_INITS)}")
    require(dp.deadline_s >= 0 and math.isfinite(dp.deadline_s), "dp.deadline_s", dp.deadline_s,
            "a finite number of seconds >= 0 (0 = derived from the DP link)")
    require(dp.rank >= 1, "dp.rank", dp.rank, "must be >= 1")
    require(dp.inner_steps >= 1, "dp.inner_steps", dp.inner_steps, "must be >= 1")
    require(dp.fragments >= 1, "dp.fragments", dp.fragments, "must be >= 1")
    require(dp.fragments <= dp.inner_steps, "dp.fragments", dp.fragments,
            f"at most dp.inner_steps = {dp.inner_steps} (one fragment sync per update at most)")
    require(0 <= dp.overlap < dp.inner_steps, "dp.overlap", dp.overlap,
            f"in [0, dp.inner_steps = {dp.inner_steps}): a fragment's result merges before its next sync")
    require(dp.outer_lr > 0, "dp.outer_lr", dp.outer_lr, "must be > 0")
    require(0 <= dp.outer_momentum < 1, "dp.outer_momentum", dp.outer_momentum, "in [0, 1)")
    require(0 < dp.merge_weight <= 1, "dp.merge_weight", dp.merge_weight, "in (0, 1]")
    require(dp.compress in COMPRESSIONS, "dp.compress", dp.compress, f"allowed: {list(COMPRESSIONS)}")
    validate_robust(cfg, require)
    require(dp.compress == "none" or dp.name == "diloco", "dp.compress", dp.compress,
            f"compresses diloco's pseudo-gradients only (dp.name = {dp.name!r}; powersgd "
            "compresses gradients itself)")


def validate_name(name: str, require) -> None:
    """``dp.name``: a built-in strategy, or a plug-in installed under ``meshlearn.dp_strategies``
    whose builder loads (a broken plug-in is named in one line, before any work starts)."""
    allowed = strategies.names()
    require(name in allowed, "dp.name", name,
            f"allowed: {list(allowed)} (plug-ins: the entry point group {strategies.GROUP})")
    if name in strategies.BUILT_IN:
        return
    try:
        strategies.load(name)
    except Exception as err:  # whatever a third party's import raises: one line, not a traceback
        require(False, "dp.name", name, f"the plug-in {strategies.plugins()[name].value} does not load: "
                f"{type(err).__name__}: {err}")


def validate_robust(cfg, require) -> None:
    """``dp.robust``, ``dp.trim`` and ``dp.outlier_score`` on their own; what they need of the mesh
    (a majority to outvote: D ≥ 3, at D = 2 every rule is the mean of the two and nothing can be
    attributed) and of elastic membership are rows of ``meshlearn.compat``."""
    dp = cfg.dp
    require(dp.robust in ROBUST_RULES, "dp.robust", dp.robust, f"allowed: {list(ROBUST_RULES)}")
    require(dp.trim >= 1, "dp.trim", dp.trim, "must be >= 1")
    score = dp.outlier_score
    require(math.isfinite(score) and score > 1, "dp.outlier_score", score,
            "a finite number > 1 (a multiple of the median replica's distance; at 1 half are outliers)")
