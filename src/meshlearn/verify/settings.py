"""SENTINEL's settings (``verify.*``) and their validation, next to each other.

``config.validate`` calls ``validate_verify``; everything the verifier can be told is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.verify.distances import DISTANCES, PAIR_DISTANCES, STATISTICS
from meshlearn.verify.fence import FENCES

MONITORS = ("none", "sentinel")
GRAD_ACTIONS = ("ema", "zero")
REFERENCE_UPDATES = ("mean", "median")
VIEWS = ("auto", "decoded")
DECISION_LOGS = ("all", "flags", "none")
TRUSTED_ENDS = ("auto", "always", "never")
MIN_COMPARABLE = 3
"""Replicas a stage needs before SENTINEL can compare them with an honest majority (and ban one)."""


@dataclass(frozen=True)
class VerifyConfig:
    """Verification of pipeline-boundary traffic. Config keys under ``verify.``.

    The defaults are sized for the demo (4 stages × 2 replicas × 4 microbatches, 300 steps): each
    boundary and direction sees 8 messages per step, so a window of 256 holds the last 32 steps.
    """

    name: str = "none"
    """``sentinel`` verifies every boundary message; ``none`` trusts them all."""
    warmup_steps: int = 80
    """Steps that build the references and fill the windows before any fence or ban applies (the
    paper uses ~1000 on far longer runs). Only sanity checks quarantine messages meanwhile. Make it
    at least window / (replicas · microbatches) steps, so the early, fast-moving distances have left
    the windows when fences start; attacks that begin earlier poison the reference. Measured on the
    demo with 50: most false flags of a clean run fell in the 30 steps after warm-up, while the
    loss still falls fast."""
    warmup_suspend: bool = True
    """While fences are open (the warm-up, and a boundary's re-warm-up), a sender whose messages on such a
    boundary all stand out from its peers' in the same step (excess ≥ ``ban_margin`` fence-widths; at most a
    minority of a stage, never an end assumed honest) is suspended: its messages of the next step are
    quarantined, without strikes, and kept out of the windows, until a step in which it no longer stands
    out; suspended for
    ``strikes`` steps in a row, it is banned (within ``ban_budget``). The windows' own fences cannot do this:
    early distances trend so fast that a fence on them is far too wide. Without it, an attack begun inside the
    warm-up runs unchecked until the fences open, and its values in the windows lift the calibrated fence
    (measured on the demo at 4 replicas: bias from step 21 of a 40-step warm-up, banned 25 steps after the
    fences opened, +0.71 nats against the clean run; and a drift begun after warm-up that set off a re-warm-up
    was accepted through it, then banned 26 steps after it began, +0.07). At 2 replicas there is no honest
    majority to compare with: nobody is suspended."""
    beta_act: float = 0.9
    """EMA factor of the forward-activation reference, per accepted message (paper: 0.9)."""
    beta_grad: float = 0.8
    """EMA factor of the backward-gradient reference (paper: 0.8; gradients drift faster)."""
    statistic: str = "position_mean"
    """φ: ``position_mean`` (batch mean per position, (n, c)) or ``global_mean`` (mean over batch and
    positions, (c,); blind to attacks on a few positions)."""
    metrics: str = "l1,l2n,sfr,swd"
    """Comma-separated distances to the boundary's reference that vote: l1, l2n (normalized L2),
    sfr (sign-flip ratio), swd (sliced Wasserstein) — the paper's four."""
    pair_metrics: str = "coh,gain"
    """Our pair distances, comparing what a worker sends with what it received for the same
    microbatch (``""`` turns them off): coh (1 − token-wise coherence of output and input: negation,
    permutation, replay, noise) and gain (change of log scale: scaling). They need the sender's
    input, so they apply to activations from stages ≥ 1 and gradients from stages ≤ P − 2 (where
    attackers live), and blame the sender alone."""
    pair_floor: float = 0.2
    """The lowest fence a pair metric gets: coh 0.2 is a token-wise cosine of 0.8 (measured on the
    demo: honest activations ≥ 0.92, gradients ≥ 0.75 in the first 40 steps; permutation −0.28,
    negation −0.92), gain 0.2 a 22% change of scale. Honest pair distances are small and
    heavy-tailed, so a fence fitted to them alone flags their tail."""
    min_metrics: int = 1
    """A message is flagged when at least this many metrics exceed their fences (1 = any; the paper's
    ablation favours all four OR-ed; 2 halves false positives at some recall)."""
    fence: str = "mad"
    """``mad``: median + (1 + 2k)·MAD, breakdown point 50% (an attacker owning a quarter of a window
    cannot move it far); ``tukey``: the paper's Q3 + k·IQR, breakdown point 25%. Both equal on
    symmetric data."""
    fence_k: float = 3.0
    """Tukey's k (3 = "far out"): the smallest k any fence uses (see ``fpr_target``)."""
    fence_k_max: float = 8.0
    """Calibration never raises k above this, so an attacker supplying part of the warm-up window
    cannot lift the fence to its own values (measured on the demo: calibrated k stays below it)."""
    fpr_target: float = 0.01
    """At the end of warm-up each fence raises its k until at most fpr_target / (number of metrics)
    of its window's clean distances lie above it (the method note's calibration; 0 keeps
    ``fence_k``). Measured on the demo: clean-run false positives sit just above a k = 3 fence."""
    window: int = 256
    """Accepted distances per metric kept for the fence (and message norms for the sanity check)."""
    strikes: int = 3
    """Strikes within a worker's last ``strike_history`` steps that ban it (1 = ban at once). A
    strike is a pair-distance or sanity flag, or a step in which a strict majority of the worker's
    messages on one boundary and direction were flagged by the statistical fences (one flag among
    several honest messages is the heavy tail of honest gradients, not evidence)."""
    strike_history: int = 10
    """Steps of the per-worker history the strikes are counted in."""
    ban: bool = True
    """False keeps flagging and quarantining messages but never bans: the attacker keeps sending, so
    the detector is measured per message over a whole attack (the bench's message-level numbers).
    It also keeps a DP outlier (dp.outlier_score) reported but never evicted."""
    swd_directions: int = 64
    """Random unit directions L of the sliced Wasserstein distance."""
    swd_quantiles: int = 64
    """Quantiles Q per direction of the sliced Wasserstein distance."""
    norm_ratio: float = 100.0
    """Sanity check, also during warm-up: quarantine a message whose norm is more than this factor
    above or below the median norm of recently accepted messages."""
    explain_level: float = 0.5
    """Attribution: a flagged message earns its sender no strike when an earlier message of the
    same microbatch from another worker (the activations it computed on, the gradients it
    back-propagated) scored at least this far from its window's median towards its fence (0 = the
    median, 1 = the fence, on any statistical metric), i.e. the anomaly is explained upstream. The
    message is still quarantined. Pair distances compare the sender with its own input, so they
    are never explained away."""
    ban_margin: float = 1.0
    """A flag is a strike only if the message's suspicion (0 at its windows' medians, 1 at the
    fences, largest over metrics) exceeds the median suspicion of the other senders' messages on
    the same boundary in the same step by this much: it must stand out from its peers, not only
    from the past. 0 counts every (unexplained, unvoided) flag."""
    ban_budget: int = -1
    """Most bans per stage over the run; −1: the threat model's minority, ⌈D/2⌉ − 1 (0 at 2
    replicas, 1 at 3 or 4); a larger value is capped at that minority. Evidence beyond it stops
    banning and raises an alert (console, metrics.jsonl, summary.json); messages are still
    quarantined one by one. The first and last
    stages are never banned while ``trusted_ends`` assumes them honest."""
    lock_steps: int = 2
    """A boundary whose senders are mostly flagged for this many consecutive steps re-warms (the
    reference is rebased at the first such step): the bound on how long it may drop (nearly) all
    its traffic."""
    rewarm_steps: int = 8
    """Re-warm-up length: windows are refilled (sanity and pair checks stay on), then calibrated."""
    majority_rebase: bool = True
    """When a strict majority of a boundary's senders are flagged in one step, the reference went
    stale: restart it from that step's messages. Without it, a reference that drifted (an adaptive
    attacker, a regime change) flags every honest replacement forever, since flagged messages never
    update it. With 3 or more senders the honest majority of the threat model also voids those
    strikes; with 2, a flagged "majority" may be the attacker plus one false positive, so the strikes
    stand (otherwise the attacker could shield itself)."""
    reference_update: str = "median"
    """How a step's accepted messages enter the reference: ``median`` folds in, per microbatch, the
    element-wise median of its replicas' summaries when there are 3 or more (one EMA step of weight
    β^count), so a minority of senders pulls the reference no further than the honest spread (the
    threat model's honest majority), however far off its accepted messages are; with fewer it falls
    back to ``mean``, the paper's rule: one EMA step per message, in (microbatch, replica) order."""
    grad_action: str = "zero"
    """What replaces a flagged gradient: ``zero`` or ``ema`` (the paper's: the reference, broadcast
    over samples). Zero by measurement (issue 31, docs/sentinel.md): on gradients ×−1 at r1s1 and
    r0s2, 2 replicas, 160 steps, val 2.090 with zero against 4.269 with ema (none: 5.126): a
    broadcast mean is a constant push on every sample, where zero only skips the microbatch."""
    ends_norm_ratio: float = 1.2
    """Where the last stage is verified (``trusted_ends``): a last-stage sender whose gradients in a
    step are at least this many times larger (median norm) than its peers' has its flags there
    explained by its row's data, not struck: a first stage that permutes its sequences leaves every
    activation statistic unchanged and shows only as larger honest gradients at the last stage
    (``verify/ends.py``). 1.2 sits between the ratios of honest senders and of a permuting first
    stage's last stage as measured (docs/sentinel.md, "First and last stages among strangers")."""
    ends_mean_share: float = 0.15
    """The other half of that rule: data explain a larger gradient, not a constant added to every
    token's gradient. A larger last-stage sender whose gradients' share of energy in their mean
    over tokens (``verify/ends.py``, ``mean_share``) exceeds its peers' median share by at least
    this is not explained by its data: its flags are its own (a last stage adding a bias).
    Gradients made ``ends_norm_ratio`` (1.2) times larger by a constant alone carry a share of at
    least 1 − 1/1.2² = 0.31; the honest last stage behind a permuting first stage measured an
    excess of 0.04 (demo) and 0.05 (tiny test mesh); 0.15 sits between."""
    view: str = "auto"
    """What is verified: ``auto`` reads the coefficients a compressing codec puts on the wire
    (subspace, lowrank) and decodes the others; ``decoded`` always decodes with the trusted codec."""
    charge_time: bool = True
    """Charge the verifier's CPU time on its own resource: each boundary's verifier is one CPU queue,
    and a message is delivered when its inspection finishes (``Sentinel.release_s``, called by the
    driver). Never added to a GPU's compute. False keeps the virtual clock bit-reproducible."""
    decision_log: str = "all"
    """Decisions written to the run's ``verify.jsonl``: ``all``, ``flags`` (flags and bans) or ``none``."""
    seed: int = 0
    """Seed of the sliced-Wasserstein directions."""
    trusted_ends: str = "auto"
    """Whether the first and last stages are assumed honest: ``auto``, below 3 replicas (where no stage
    can be banned, so assuming them honest is what keeps their evidence from being turned against
    their neighbours) and verified like any stage from 3 (attackers allowed there, bans within the
    same strict-minority budget); ``always`` (the paper's threat model) or ``never`` (attackers
    allowed there at any replica count, e.g. to measure them at 2 replicas). A ``[cluster]`` run
    whose ends are trusted places their workers only on hosts marked ``trusted`` (docs/cluster.md)."""

    def metric_names(self) -> list[str]:
        """The reference metrics, then the pair metrics: every metric with a fence."""
        return [m.strip() for m in f"{self.metrics},{self.pair_metrics}".split(",") if m.strip()]

    def reference_metric_names(self) -> list[str]:
        return [m.strip() for m in self.metrics.split(",") if m.strip()]

    def ends_trusted(self, replicas: int) -> bool:
        """Whether the first and last stages are assumed honest in a mesh of ``replicas``."""
        return self.trusted_ends == "always" or (self.trusted_ends == "auto" and replicas < MIN_COMPARABLE)

    def budget(self, replicas: int) -> int:
        """Bans allowed per stage over the run: a strict minority of its replicas, or fewer if set."""
        minority = (replicas + 1) // 2 - 1
        return minority if self.ban_budget < 0 else min(self.ban_budget, minority)


def validate_verify(cfg, require) -> None:
    """Checks of ``verify.*`` run by ``config.validate`` (``cfg`` is the RunConfig;
    ``require(ok, key, value, allowed)`` raises the ConfigError)."""
    v = cfg.verify
    require(v.name in MONITORS, "verify.name", v.name, f"allowed: {list(MONITORS)}")
    require(v.warmup_steps >= 0, "verify.warmup_steps", v.warmup_steps, "must be >= 0")
    for key, beta in [("verify.beta_act", v.beta_act), ("verify.beta_grad", v.beta_grad)]:
        require(0 <= beta < 1, key, beta, "in [0, 1)")
    require(v.statistic in STATISTICS, "verify.statistic", v.statistic, f"allowed: {sorted(STATISTICS)}")
    metrics = v.reference_metric_names()
    require(bool(metrics) and set(metrics) <= set(DISTANCES) and len(set(metrics)) == len(metrics),
            "verify.metrics", v.metrics, f"comma-separated, distinct, from {sorted(DISTANCES)}")
    pairs = [m.strip() for m in v.pair_metrics.split(",") if m.strip()]
    require(set(pairs) <= set(PAIR_DISTANCES) and len(set(pairs)) == len(pairs), "verify.pair_metrics",
            v.pair_metrics, f"comma-separated, distinct, from {list(PAIR_DISTANCES)}, or empty")
    require(1 <= v.min_metrics <= len(metrics), "verify.min_metrics", v.min_metrics,
            f"in [1, {len(metrics)}] (the number of verify.metrics)")
    require(v.fence in FENCES, "verify.fence", v.fence, f"allowed: {list(FENCES)}")
    require(v.pair_floor >= 0, "verify.pair_floor", v.pair_floor, "must be >= 0")
    require(v.fence_k > 0, "verify.fence_k", v.fence_k, "must be > 0")
    require(v.fence_k_max >= v.fence_k, "verify.fence_k_max", v.fence_k_max,
            f"must be >= verify.fence_k = {v.fence_k}")
    require(0 <= v.fpr_target < 1, "verify.fpr_target", v.fpr_target, "in [0, 1) (0: no calibration)")
    require(v.window >= 8, "verify.window", v.window, "must be >= 8 (quartiles need values)")
    require(v.strikes >= 1, "verify.strikes", v.strikes, "must be >= 1")
    require(v.strike_history >= v.strikes, "verify.strike_history", v.strike_history,
            f"must be >= verify.strikes = {v.strikes}")
    require(v.explain_level >= 0, "verify.explain_level", v.explain_level, "must be >= 0")
    require(v.ban_margin >= 0, "verify.ban_margin", v.ban_margin, "must be >= 0")
    require(v.ban_budget >= -1, "verify.ban_budget", v.ban_budget,
            "-1 (a minority of each stage) or a number of bans per stage >= 0")
    require(v.lock_steps >= 1, "verify.lock_steps", v.lock_steps, "must be >= 1")
    require(v.rewarm_steps >= 1, "verify.rewarm_steps", v.rewarm_steps, "must be >= 1")
    for key, value in [("verify.swd_directions", v.swd_directions),
                       ("verify.swd_quantiles", v.swd_quantiles)]:
        require(value >= 1, key, value, "must be a positive integer")
    require(v.norm_ratio > 1, "verify.norm_ratio", v.norm_ratio, "must be > 1")
    require(v.reference_update in REFERENCE_UPDATES, "verify.reference_update", v.reference_update,
            f"allowed: {list(REFERENCE_UPDATES)}")
    require(v.grad_action in GRAD_ACTIONS, "verify.grad_action", v.grad_action,
            f"allowed: {list(GRAD_ACTIONS)}")
    require(v.ends_norm_ratio >= 1, "verify.ends_norm_ratio", v.ends_norm_ratio, "must be >= 1")
    require(0 < v.ends_mean_share <= 1, "verify.ends_mean_share", v.ends_mean_share, "must be in (0, 1]")
    require(v.trusted_ends in TRUSTED_ENDS, "verify.trusted_ends", v.trusted_ends,
            f"allowed: {list(TRUSTED_ENDS)}")
    require(v.view in VIEWS, "verify.view", v.view, f"allowed: {list(VIEWS)}")
    require(v.decision_log in DECISION_LOGS, "verify.decision_log", v.decision_log,
            f"allowed: {list(DECISION_LOGS)}")
