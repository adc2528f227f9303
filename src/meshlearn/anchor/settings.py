"""The anchor circuit's config section (``anchor.*``) and its checks. Kept free of torch so the
config tree can import it; ``validate_anchor`` is called by ``config.validate``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

WIRE_DTYPES = ("bf16", "fp32")
SENDS = ("factors", "gradients")
WEIGHTS = ("outer", "snapshot")
USES = ("basis", "error_feedback")


@dataclass(frozen=True)
class AnchorConfig:
    """Z anchor replicas of the pipeline (docs/adaptation.md). Config keys under ``anchor.``.

    Every ``delay`` steps the fast circuit hands an anchor replica (in turn) the step's batch ids
    (and, with ``weights = snapshot``, its current weights); the anchor runs an unmasked
    forward/backward through its own P stages over its own links and sends, for the targeted
    matrices, the top-r factors of its EMA (``send = factors``) or the gradients themselves to
    every fast replica of each stage. What was computed for step t is handed to the spectral
    correction at the first step end ≥ t + ``delay`` by which it has arrived on the virtual clock;
    the fast circuit never waits for it. Needs ``optim.spectral.enabled``. Under ``backend =
    dist`` the Z × P anchor stages are processes of their own (distributed/anchor.py).
    """

    z: int = 0
    """Anchor replicas (0 = no anchor circuit; the paper: 1). Each has its own clock, so Z > 1 lets
    the anchor keep up when one pass takes longer than ``delay`` fast steps."""
    delay: int = 20
    """K: steps between hand-offs, and the age of the weights a gradient was computed on when it is
    folded in (the paper: 20; quality falls with K). >= 1."""
    max_late: int = 10
    """Steps past its due step (t + K) after which an arrival is dropped (counted in
    ``anchor_dropped_late``); the note's cap of about 30 steps of staleness is K + max_late, which
    must stay within ``optim.spectral.max_staleness``. If summary.json shows drops, the anchor is
    too slow for K: raise ``anchor.z`` or K."""
    targets: str = ""
    """Comma-separated matrices the anchor sends (their factors or gradients), from those of
    ``optim.spectral.targets`` (empty = all of them)."""
    wire_dtype: str = "bf16"
    """What the weight snapshot, the anchor's boundary tensors and its gradients or factors travel
    as (bf16 or fp32). bf16 rounds the snapshot the anchor computes on; fp32 makes its gradient the
    unsplit model's exactly."""
    bandwidth_mbit: float = 0.0
    """Bandwidth of the anchor's own links (its pipeline links, and those to the fast replicas);
    0 = the PP links' (``links.pp_bandwidth_mbit`` or ``link.bandwidth_mbit``)."""
    latency_ms: float = -1.0
    """One-way latency of the anchor's links; -1 = the PP links'."""
    send: str = "factors"
    """What each anchor stage sends to the fast replicas (open detail 3). ``factors`` (the note's
    default): the stage keeps the EMA M of each targeted matrix itself (β = optim.spectral.beta_anc),
    takes its thin SVD on every pass and sends the top ``anchor.rank`` factors U_r, S_r, V_r:
    r·(m + n + 1) values per matrix instead of m·n. ``gradients`` (the note's simulation mode): the
    full gradients; each fast worker keeps the EMA and takes the SVD."""
    rank: int = 64
    """r of ``send = factors`` (the paper's rank-64 ablation; >= 1). A matrix with min(m, n) <= r
    sends its full thin SVD; with fp32 wire that is ``send = gradients`` up to rounding."""
    weights: str = "outer"
    """What the anchor computes on (open detail 2). ``outer`` (the note's default): the weights
    every fast replica already agrees on (after each update under dp.name = allreduce / powersgd,
    streaming DiLoCo's outer weights under diloco); no snapshot travels: fast replica 0 relays the
    reduced result of each DP round of its stage to the anchor, which applies the same update, and
    those bytes are charged on the anchor's link (``anchor_bytes_listen``; under backend = dist
    the relay is the changed agreed tensors in fp32, distributed/anchor.py). Needs mesh.replicas
    >= 2 and one of those strategies. ``snapshot``: fast replica 0's current
    weights, sent per stage every K steps in ``wire_dtype`` (2 B × stage parameters in bf16)."""
    use: str = "basis"
    """What a fast worker does with the anchor's share (issue 29, 4(b)). ``basis``: the spectral
    correction's basis (its EMA and SVD: the note's method). ``error_feedback``: a delayed
    correction: each fast worker keeps its own gradient of the targeted matrices for every
    handed-off step t and, when the anchor's clean gradient for t arrives, adds c_t = g_clean(t) −
    g_masked(t) to its updates of that step (optim/error_feedback.py; one fp32 copy of the targeted
    matrices per kept step). Needs ``send = gradients``; ``weights = snapshot`` makes g_clean the
    gradient at fast replica 0's own weights of step t."""


def anchor_targets(cfg: Any) -> tuple[str, ...]:
    """The matrix names (q, k, ...) the anchor sends: ``anchor.targets``, else the correction's."""
    from_spectral = tuple(t.strip() for t in cfg.optim.spectral.targets.split(",") if t.strip())
    own = tuple(t.strip() for t in cfg.anchor.targets.split(",") if t.strip())
    return own or from_spectral


def stage_targets(cfg: Any, names: Iterable[str]) -> list[str]:
    """Of a stage's matrices ``names`` (its spectral correction's, in order), those the anchor sends."""
    wanted = set(anchor_targets(cfg))
    return [n for n in names if n.split(".")[-2] in wanted]


def link_profile(pp: Any, a: AnchorConfig) -> Any:
    """The anchor links' ``LinkProfile``: ``anchor.bandwidth_mbit`` / ``latency_ms``, else the PP
    links' profile ``pp``."""
    return replace(pp, bandwidth_mbit=a.bandwidth_mbit or pp.bandwidth_mbit,
                   latency_ms=a.latency_ms if a.latency_ms >= 0 else pp.latency_ms)


def validate_anchor(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``anchor.*`` (``require(ok, key, value, allowed)`` raises the ConfigError)."""
    a = cfg.anchor
    require(a.z >= 0, "anchor.z", a.z, "must be >= 0 (0 = no anchor circuit)")
    require(a.delay >= 1, "anchor.delay", a.delay, "must be >= 1 (steps)")
    require(a.max_late >= 0, "anchor.max_late", a.max_late, "must be >= 0 (steps)")
    require(a.wire_dtype in WIRE_DTYPES, "anchor.wire_dtype", a.wire_dtype, f"allowed: {list(WIRE_DTYPES)}")
    require(a.bandwidth_mbit >= 0, "anchor.bandwidth_mbit", a.bandwidth_mbit,
            "must be > 0, or 0 for the PP links' bandwidth")
    require(a.latency_ms >= 0 or a.latency_ms == -1, "anchor.latency_ms", a.latency_ms,
            "must be >= 0, or -1 for the PP links' latency")
    require(a.send in SENDS, "anchor.send", a.send, f"allowed: {list(SENDS)}")
    require(a.rank >= 1, "anchor.rank", a.rank, "must be >= 1 (the factors' rank r)")
    require(a.weights in WEIGHTS, "anchor.weights", a.weights, f"allowed: {list(WEIGHTS)}")
    require(a.use in USES, "anchor.use", a.use, f"allowed: {list(USES)}")
