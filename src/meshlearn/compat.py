"""Which settings of different components cannot be combined, and why: one table, checked in one place.

A component's checks of its own keys stay beside its config (``dp/settings.py`` checks ``dp.*``);
a refusal that reads another component's settings is a row here. So adding a method or a DP
strategy touches its own package and this table, and ``meshlearn config --compat`` (and
docs/compat.md, generated from the table) lists every combination that is refused today.

A row is refused when all of its conditions hold; the ConfigError names the row's key with its
value and the row's reason. ``config.validate`` checks the rows in table order after every
component's own checks (so each row may assume its components' own keys are valid), before any
work starts. Every row carries an example (``--set`` overrides of the defaults) that it refuses
before any other row: the tests check that, and the docs show each example's message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshlearn.anchor.settings import anchor_targets
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId

# DP strategies whose replicas agree on some weights the anchor can follow by listening: the
# per-update averages keep replicas identical, streaming DiLoCo's outer weights are common.
AGREEING_DP = ("allreduce", "powersgd", "diloco")
# Morphs change the basis of every weight: only optimizers without per-coordinate second moments,
# and DP strategies that average whole tensors (not slices of coordinates), follow them.
MORPH_OPTIMIZERS = ("muon", "numuon")
MORPH_DP = ("allreduce", "powersgd", "diloco")
ELASTIC_SCHEDULES = ("gpipe", "1f1b")
# Codecs whose payloads carry index fields (token ids, positions) for ``forge_ids`` to forge.
INDEX_CODECS = ("subspace", "topk")


def setting(cfg: Any, key: str) -> Any:
    """The value of the dotted ``key`` in the RunConfig ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if value != "" else '""'


@dataclass(frozen=True)
class Condition:
    """One setting's part of a refused combination: how it reads in the table, and the test."""

    text: str
    holds: Callable[[Any], bool]


def equals(key: str, *values: Any) -> Condition:
    """``key`` is one of ``values``."""
    shown = _show(values[0]) if len(values) == 1 else "{" + ", ".join(map(_show, values)) + "}"
    return Condition(f"{key} {'=' if len(values) == 1 else '∈'} {shown}",
                     lambda cfg: setting(cfg, key) in values)


def differs(key: str, *values: Any) -> Condition:
    """``key`` is none of ``values``."""
    shown = _show(values[0]) if len(values) == 1 else "{" + ", ".join(map(_show, values)) + "}"
    return Condition(f"{key} {'≠' if len(values) == 1 else '∉'} {shown}",
                     lambda cfg: setting(cfg, key) not in values)


def below(key: str, bound: float) -> Condition:
    """``key`` < ``bound``."""
    return Condition(f"{key} < {_show(bound)}", lambda cfg: setting(cfg, key) < bound)


def relation(text: str, holds: Callable[[Any], bool]) -> Condition:
    """Any other condition (a relation between keys), as ``text`` says."""
    return Condition(text, holds)


@dataclass(frozen=True)
class Refusal:
    """One refused combination: refused when every condition holds; the ConfigError names ``key``
    (with its value) and ``reason(cfg)``; ``example`` (``--set`` overrides of the defaults)
    triggers this row alone."""

    when: tuple[Condition, ...]
    key: str
    reason: Callable[[Any], str]
    example: tuple[str, ...]

    def refuses(self, cfg: Any) -> bool:
        return all(c.holds(cfg) for c in self.when)

    @property
    def settings(self) -> str:
        return " · ".join(c.text for c in self.when)


SIM, DIST = equals("backend", "sim"), equals("backend", "dist")
NOT_SIM = differs("backend", "sim")
ELASTIC = equals("elastic.enabled", True)
TORCHFT = equals("elastic.membership", "torchft")  # "control" uses no process group
VERIFYING = differs("verify.name", "none")
SENTINEL = equals("verify.name", "sentinel")
MORPHED = differs("protocol.morph", "off")
MORPHING = differs("protocol.morph", "off", "none")
ANCHORED = differs("anchor.z", 0)
OUTER = equals("anchor.weights", "outer")
ROBUST = differs("dp.robust", "none")
WARMUP = equals("warmup.enabled", True)
TIED = equals("model.tie_embeddings", True)
DENSE = equals("model.subspace_rank", 0)
BASIS_UPDATES = differs("subspace_update.every", 0)
ATTACKING = differs("attack.kind", "none")
ON_ELASTIC = ("elastic.enabled=true", "backend=dist")
ON_DIST_SENTINEL = ("backend=dist", "verify.name=sentinel")
ON_ANCHOR = ("anchor.z=1", "optim.spectral.enabled=true")
ON_MORPH = ("protocol.morph=orthogonal", "optim.name=muon")


def _unknown_anchor_targets(cfg: Any) -> list[str]:
    spectral = tuple(t.strip() for t in cfg.optim.spectral.targets.split(",") if t.strip())
    return [t for t in anchor_targets(cfg) if t not in spectral]


def _elastic_dp_attack(cfg: Any) -> bool:
    """An attack on the DP axis of an elastic run under the control service's membership, which
    runs no verifier (docs/dp_robust.md): its attacker corrupts what it gives its stage's reduce
    in its own process, and a robust rule is what answers it."""
    return cfg.elastic.enabled and cfg.elastic.membership == "control" and cfg.attack.target == "dp"


def _elastic_batch_misfits(cfg: Any) -> list[int]:
    """Row counts k = 1..mesh.replicas whose share of the batch is not whole microbatches."""
    return [k for k in range(1, cfg.mesh.replicas + 1)
            if cfg.train.batch_size % (k * cfg.mesh.microbatches)]


def _attackers(cfg: Any) -> list[tuple[str, WorkerId]]:
    """attack.workers as written and parsed (the attack's own checks parsed them already)."""
    ids = [w.strip() for w in cfg.attack.workers.split(",") if w.strip()]
    return [(text, WorkerId.parse(text)) for text in ids]


def _outside_mesh(cfg: Any) -> list[str]:
    return [text for text, w in _attackers(cfg)
            if not (w.replica < cfg.mesh.replicas and w.stage < cfg.mesh.stages)]


def _on_an_end_stage(cfg: Any) -> list[str]:
    """Attackers on a first or last stage that ``verify.trusted_ends`` assumes honest."""
    if not cfg.verify.ends_trusted(cfg.mesh.replicas):
        return []
    return [text for text, w in _attackers(cfg) if w.stage < cfg.mesh.stages and w.replica < cfg.mesh.replicas
            and not 0 < w.stage < cfg.mesh.stages - 1]


def _untrusted_ends(cfg: Any) -> list[tuple[str, list[str]]]:
    """Hosts not marked trusted that run a first- or last-stage worker, with those workers, while
    ``verify.trusted_ends`` assumes those stages honest: among strangers that assumption must be the
    run owner's to keep (docs/cluster.md)."""
    if not cfg.verify.ends_trusted(cfg.mesh.replicas):
        return []
    ends = {f"r{r}s{s}" for r in range(cfg.mesh.replicas) for s in (0, cfg.mesh.stages - 1)}
    return [(name, on_it) for name, host in sorted(cfg.cluster.hosts.items())
            if not host.trusted and (on_it := [w for w in host.workers if w in ends])]


def _untrusted_ends_reason(cfg: Any) -> str:
    name, workers = _untrusted_ends(cfg)[0]
    return (f"assumes the first and last stages honest at {cfg.mesh.replicas} replicas, and host {name} "
            f"runs {', '.join(workers)} without cluster.hosts.{name}.trusted = true: set it if you own "
            "that machine, or place those workers on a trusted host (docs/cluster.md)")


def _untrusted_verifier_host(cfg: Any) -> str | None:
    """The host that runs the SENTINEL verifier while it is neither the coordinator nor marked
    trusted: the verifier bans and evicts workers, so its machine's honesty is the run's."""
    return next((name for name, host in sorted(cfg.cluster.hosts.items()) if "verifier" in host.workers
                 and name != cfg.cluster.coordinator and not host.trusted), None)


def _attackable(cfg: Any) -> str:
    return (f"stages 1..{cfg.mesh.stages - 2}" if cfg.mesh.stages > 2
            else "none: the mesh needs at least 3 stages to have an attackable one")


def _warmup_locks_none(cfg: Any) -> bool:
    from meshlearn.warmup.locking import locked_layers

    w, m = cfg.warmup, cfg.model
    return not locked_layers(m.n_layer, cfg.mesh.stages, w.locked_fraction, w.placement)


def _late_window(cfg: Any) -> int:
    return cfg.anchor.delay + cfg.anchor.max_late


def _drops_late_arrivals(cfg: Any) -> bool:
    """The correction would drop what arrives late but not every arrival (that is the next row)."""
    return cfg.anchor.delay <= cfg.optim.spectral.max_staleness < _late_window(cfg)


TABLE: tuple[Refusal, ...] = (
    # --- the model (was models/settings.py) ---
    Refusal((TIED, relation("mesh.stages > 1", lambda c: c.mesh.stages > 1)), "model.tie_embeddings",
            lambda c: f"the embedding (stage 0) and the head (stage {c.mesh.stages - 1}) cannot share one "
            f"weight across mesh.stages = {c.mesh.stages}; set model.tie_embeddings = false (the last stage "
            "gets its own copy of the embedding, trained separately) or mesh.stages = 1",
            ("model.tie_embeddings=true", "mesh.stages=2")),
    Refusal((equals("data.tokenizer", "model"), equals("model.init", "")), "data.tokenizer",
            lambda c: "the tokenizer of a pretrained model needs model.init (a preset, .gguf, HF folder "
            "or run)",
            ("data.tokenizer=model",)),
    # --- protocol models and morphs (was protocol/settings.py; before the codec's rows, so a
    # subspace codec in a protocol model is refused for the protocol's reason) ---
    Refusal((MORPHED, equals("codec.name", "subspace")), "codec.name",
            lambda c: "the subspace codec is refused in protocol models: its public basis U would leak "
            "the morphs' transforms (method note, open detail 5); use another codec or protocol.morph = off",
            ("protocol.morph=none", "codec.name=subspace", "model.subspace_rank=8")),
    Refusal((MORPHED, differs("model.subspace_rank", 0)), "model.subspace_rank",
            lambda c: "the protocol model is dense; set model.subspace_rank = 0 or protocol.morph = off",
            ("protocol.morph=none", "model.subspace_rank=8")),
    Refusal((MORPHED, TIED), "model.tie_embeddings",
            lambda c: "the protocol model's head is folded (Qᵀ·diag(g)·W), not the embedding; set false "
            "or protocol.morph = off",
            ("protocol.morph=none", "model.tie_embeddings=true", "mesh.stages=1")),
    Refusal((MORPHED, WARMUP), "warmup.enabled",
            lambda c: "architecture warm-up is not supported in the protocol model yet; set false "
            "or protocol.morph = off",
            ("protocol.morph=none", "warmup.enabled=true")),
    Refusal((MORPHING, differs("optim.name", *MORPH_OPTIMIZERS)), "optim.name",
            lambda c: f"morphs need {' or '.join(MORPH_OPTIMIZERS)}: Adam-style second moments cannot "
            "follow a change of basis (method note, Training); or protocol.morph = none",
            ("protocol.morph=orthogonal",)),
    Refusal((MORPHING, NOT_SIM, differs("protocol.keep_snapshots", 0)), "protocol.keep_snapshots",
            lambda c: "the distributed driver keeps no attack snapshots (they need every stage in one "
            "process); set 0 under backend = dist, or use backend = sim",
            (*ON_MORPH, "backend=dist", "protocol.keep_snapshots=1")),
    Refusal((MORPHING, NOT_SIM, differs("protocol.every_seconds", 0.0)), "protocol.every_seconds",
            lambda c: "seconds are the simulator's virtual clock; under backend = dist use "
            "protocol.every_steps or protocol.every_tokens",
            (*ON_MORPH, "backend=dist", "protocol.keep_snapshots=0", "protocol.every_seconds=1")),
    Refusal((MORPHING, NOT_SIM, ELASTIC), "elastic.enabled",
            lambda c: "elastic membership does not carry morphs (a joining worker's masters); set false "
            "or protocol.morph = none",
            (*ON_MORPH, *ON_ELASTIC, "protocol.keep_snapshots=0")),
    Refusal((MORPHING, differs("dp.name", *MORPH_DP)), "dp.name",
            lambda c: f"morphs work with {list(MORPH_DP)}: sparse averaging mixes slices of coordinates, "
            "which do not follow a change of basis; use one of those or protocol.morph = none",
            (*ON_MORPH, "dp.name=sparse")),
    Refusal((MORPHING, differs("dp.compress", "none")), "dp.compress",
            lambda c: "compressed DiLoCo keeps PowerSGD error feedback and factors of the pseudo-gradients, "
            "which morphs do not transform yet; set dp.compress = none or protocol.morph = none",
            (*ON_MORPH, "dp.name=diloco", "dp.compress=powersgd")),
    Refusal((MORPHING, VERIFYING), "verify.name",
            lambda c: "morphs do not yet reset the verifiers' activation statistics; use verify.name = none "
            "or protocol.morph = none",
            (*ON_MORPH, "verify.name=sentinel")),
    # --- subspace networks (were in config.py) ---
    Refusal((BASIS_UPDATES, DENSE), "subspace_update.every",
            lambda c: "basis updates need a constrained model: set model.subspace_rank > 0",
            ("subspace_update.every=10",)),
    Refusal((equals("codec.name", "subspace"), DENSE), "codec.name",
            lambda c: "the subspace codec needs a constrained model: set model.subspace_rank > 0",
            ("codec.name=subspace",)),
    # --- SENTINEL (was verify/settings.py) ---
    Refusal((VERIFYING, BASIS_UPDATES), "verify.name",
            lambda c: "SENTINEL's references assume a fixed basis, and subspace_update changes it (method "
            "note, open detail 7: re-warming after a basis change is not wired to it); set "
            "subspace_update.every = 0 or verify.name = none",
            ("verify.name=sentinel", "model.subspace_rank=8", "subspace_update.every=10")),
    # --- attacks (were in verify/attacks.py) ---
    Refusal((equals("attack.target", "dp"), ATTACKING, below("mesh.replicas", 2)),
            "attack.target",
            lambda c: f"needs mesh.replicas >= 2 for a DP contribution (mesh.replicas = {c.mesh.replicas})",
            ("attack.target=dp", "attack.kind=sign_flip", "attack.workers=r0s1", "mesh.replicas=1")),
    Refusal((equals("attack.kind", "forge_ids"), differs("codec.name", *INDEX_CODECS),
             differs("codec.backward.name", *INDEX_CODECS)), "attack.kind",
            lambda c: f"forges index fields, which only codec.name or codec.backward.name in "
            f"{list(INDEX_CODECS)} sends (codec.name = {c.codec.name!r}, codec.backward.name = "
            f"{c.codec.backward.name!r})",
            ("attack.kind=forge_ids", "attack.workers=r0s1")),
    Refusal((ATTACKING, relation("an attack.workers entry outside the mesh",
                                 lambda c: bool(_outside_mesh(c)))),
            "attack.workers",
            lambda c: f"{_outside_mesh(c)[0]} is not in the mesh of {c.mesh.replicas} replicas × "
            f"{c.mesh.stages} stages",
            ("attack.kind=sign_flip", "attack.workers=r2s1")),
    Refusal((ATTACKING, relation("an attack.workers entry on the first or last stage while "
                                 "verify.trusted_ends assumes them honest (auto: below 3 replicas)",
                                 lambda c: bool(_on_an_end_stage(c)))), "attack.workers",
            lambda c: f"{_on_an_end_stage(c)[0]}: the first and last stages are honest in SENTINEL's threat "
            f"model at {c.mesh.replicas} replicas (verify.trusted_ends = {c.verify.trusted_ends!r}: verified "
            f"from 3 replicas with 'auto', always with 'never'); attackers may sit on {_attackable(c)}",
            ("attack.kind=sign_flip", "attack.workers=r0s3")),
    Refusal((SENTINEL, relation("a [cluster] host not marked trusted runs a first- or last-stage worker "
                                "while verify.trusted_ends assumes those stages honest (auto: below 3 "
                                "replicas)", lambda c: bool(_untrusted_ends(c)))), "verify.trusted_ends",
            _untrusted_ends_reason,
            ("verify.name=sentinel", "cluster.coordinator=alice", "cluster.hosts.alice.address=127.0.0.1",
             "cluster.hosts.alice.workers=r0s0,r0s1,r0s2,r0s3,r1s0,r1s1,r1s2,r1s3")),
    Refusal((SENTINEL, relation("the verifier is placed on a [cluster] host that is neither the coordinator "
                                "nor marked trusted", lambda c: _untrusted_verifier_host(c) is not None)),
            "verify.name",
            lambda c: f"host {_untrusted_verifier_host(c)} runs the verifier, which bans and evicts any "
            f"worker, without cluster.hosts.{_untrusted_verifier_host(c)}.trusted = true: set it if you own "
            "that machine, or leave the verifier to the coordinator (docs/cluster.md)",
            ("verify.name=sentinel", "cluster.coordinator=alice", "cluster.hosts.alice.address=127.0.0.1",
             "cluster.hosts.alice.workers=r0s0,r0s1,r0s2,r0s3,r1s0,r1s1,r1s2,r1s3",
             "cluster.hosts.alice.trusted=true", "cluster.hosts.bob.address=127.0.0.2",
             "cluster.hosts.bob.workers=verifier")),
    # --- the distributed runtime (was distributed/settings.py) ---
    Refusal((DIST, BASIS_UPDATES), "subspace_update.every",
            lambda c: "must be 0 with backend = 'dist' (only the simulator runs it so far)",
            ("backend=dist", "model.subspace_rank=8", "subspace_update.every=10")),
    Refusal((DIST, ATTACKING, differs("verify.name", "sentinel"),
             relation("not (elastic.membership = 'control' and attack.target = 'dp' with elastic.enabled)",
                      lambda c: not _elastic_dp_attack(c))), "attack.kind",
            lambda c: "needs verify.name = 'sentinel' with backend = 'dist' (unverified attacks run in the "
            "simulator only, and on the DP axis of an elastic run with elastic.membership = 'control')",
            ("backend=dist", "attack.kind=sign_flip", "attack.workers=r0s1", "mesh.stages=4")),
    # (also refuses elastic runs with SENTINEL and another strategy: elastic needs backend = dist)
    Refusal((DIST, SENTINEL, differs("dp.name", "allreduce")), "dp.name",
            lambda c: "must be 'allreduce' with verify.name = 'sentinel' and backend = 'dist'",
            (*ON_DIST_SENTINEL, "dp.name=powersgd")),
    Refusal((DIST, SENTINEL, equals("dist.comm", "nccl")), "dist.comm",
            lambda c: "must be 'gloo' or 'auto' with verify.name = 'sentinel' (the verifier relays over "
            "gloo)",
            (*ON_DIST_SENTINEL, "dist.comm=nccl")),
    Refusal((equals("dist.links", "tcp"), ELASTIC, TORCHFT), "dist.links",
            lambda c: "must be 'auto' or 'collective' with elastic.enabled and elastic.membership = "
            "'torchft' (rows link over gloo pair groups)",
            (*ON_ELASTIC, "dist.links=tcp")),
    Refusal((equals("dist.trusted_links", "false"), ELASTIC, TORCHFT), "dist.trusted_links",
            lambda c: "must be 'auto' or 'true' with elastic.enabled and elastic.membership = 'torchft' "
            "(torchft's process groups carry its DP axis)",
            (*ON_ELASTIC, "dist.trusted_links=false")),
    # --- elastic membership (was elastic/settings.py) ---
    Refusal((relation("elastic.min_replicas ∉ [1, mesh.replicas]",
                      lambda c: not 1 <= c.elastic.min_replicas <= c.mesh.replicas),),
            "elastic.min_replicas",
            lambda c: f"must be between 1 and mesh.replicas = {c.mesh.replicas}",
            ("elastic.min_replicas=3",)),
    Refusal((ELASTIC, SIM), "elastic.enabled",
            lambda c: "needs backend = 'dist' (the simulator has fixed membership)",
            ("elastic.enabled=true",)),
    Refusal((ELASTIC, differs("mesh.schedule", *ELASTIC_SCHEDULES)), "mesh.schedule",
            lambda c: f"with elastic.enabled: allowed: {list(ELASTIC_SCHEDULES)} (async is not elastic yet)",
            (*ON_ELASTIC, "mesh.schedule=async")),
    Refusal((ELASTIC, below("mesh.replicas", 2)), "mesh.replicas",
            lambda c: "with elastic.enabled: must be >= 2 (a stage of one replica cannot lose it and go on)",
            (*ON_ELASTIC, "mesh.replicas=1")),
    Refusal((ELASTIC, relation("train.batch_size % (k × mesh.microbatches) ≠ 0 for a k ≤ mesh.replicas",
                               lambda c: bool(_elastic_batch_misfits(c)))), "train.batch_size",
            lambda c: "with elastic.enabled: must be divisible by k × mesh.microbatches for every number of "
            "rows k = 1..mesh.replicas (the rows that train a step split its batch; "
            f"not for k = {_elastic_batch_misfits(c)[0]})",
            (*ON_ELASTIC, "mesh.replicas=3", "train.batch_size=36")),
    Refusal((ELASTIC, VERIFYING, differs("elastic.membership", "torchft")), "elastic.membership",
            lambda c: f"with verify.name = {c.verify.name!r}: must be 'torchft' (the verifier's relayed "
            "links under the control service's membership are not built)",
            (*ON_ELASTIC, "verify.name=sentinel", "elastic.membership=control")),
    # --- robust aggregation (was dp/settings.py) ---
    Refusal((ROBUST, below("mesh.replicas", 3)), "dp.robust",
            lambda c: f"needs mesh.replicas >= 3 (mesh.replicas = {c.mesh.replicas}: with 2 there is no "
            "majority, every rule is their mean); use dp.robust = none",
            ("dp.robust=median", "mesh.replicas=2")),
    Refusal((equals("dp.robust", "trimmed_mean"),
             relation("2·dp.trim ≥ mesh.replicas", lambda c: 2 * c.dp.trim >= c.mesh.replicas)), "dp.trim",
            lambda c: f"2·dp.trim < mesh.replicas = {c.mesh.replicas} (trimmed_mean keeps D − 2·trim values)",
            ("dp.robust=trimmed_mean", "mesh.replicas=4", "dp.trim=2")),
    Refusal((ROBUST, ELASTIC, TORCHFT), "dp.robust",
            lambda c: "none with elastic.enabled and elastic.membership = 'torchft' (its quorum rounds are "
            "sums through torchft's all-reduce, which no member can reduce robustly); use elastic.membership "
            "= 'control', whose members gather every contribution",
            (*ON_ELASTIC, "mesh.replicas=3", "train.batch_size=48", "dp.robust=median")),
    # --- architecture warm-up (was warmup/settings.py) ---
    Refusal((WARMUP, relation("no block locked per stage", _warmup_locks_none)), "warmup.locked_fraction",
            lambda c: f"locks no block of {c.model.n_layer // c.mesh.stages} per stage; raise it or use "
            "fewer stages",
            ("warmup.enabled=true", "mesh.stages=4", "warmup.locked_fraction=0.1")),
    Refusal((WARMUP, differs("model.subspace_rank", 0)), "warmup.enabled",
            lambda c: "locked blocks need dense residual writers: set model.subspace_rank = 0",
            ("warmup.enabled=true", "mesh.stages=2", "model.subspace_rank=8")),
    Refusal((WARMUP, differs("dp.name", "allreduce")), "warmup.enabled",
            lambda c: "DP strategies other than allreduce hold a fixed parameter list; use dp.name = "
            "allreduce",
            ("warmup.enabled=true", "mesh.stages=2", "dp.name=powersgd")),
    # --- the curvature tracker (was curvature/settings.py) ---
    Refusal((differs("curvature.every", 0), NOT_SIM), "curvature.every",
            lambda c: "the tracker needs every stage in one process (backend = sim); under --backend dist "
            "Hessian-vector products across processes are not implemented",
            ("curvature.every=10", "backend=dist")),
    # --- the anchor circuit (was anchor/settings.py) ---
    Refusal((relation("anchor.targets ⊄ optim.spectral.targets",
                      lambda c: bool(_unknown_anchor_targets(c))),),
            "anchor.targets",
            lambda c: f"names from optim.spectral.targets = {c.optim.spectral.targets!r} (the correction "
            f"receives only those); not there: {_unknown_anchor_targets(c)}",
            ("optim.spectral.targets=q", "anchor.targets=k")),
    Refusal((ANCHORED, equals("optim.spectral.enabled", False)), "anchor.z",
            lambda c: "the anchor feeds the spectral correction: set optim.spectral.enabled = true",
            ("anchor.z=1",)),
    Refusal((ANCHORED, NOT_SIM, VERIFYING), "anchor.z",
            lambda c: f"under backend = dist the anchor circuit and verify.name = {c.verify.name!r} are not "
            "combined (the verifier relays the pipeline links only); use verify.name = none",
            (*ON_ANCHOR, *ON_DIST_SENTINEL)),
    Refusal((ANCHORED, NOT_SIM, ELASTIC), "anchor.z",
            lambda c: "under backend = dist the anchor circuit needs a fixed mesh: set elastic.enabled = "
            "false",
            (*ON_ANCHOR, *ON_ELASTIC)),
    Refusal((ANCHORED, MORPHING), "anchor.z",
            lambda c: f"with protocol.morph = {c.protocol.morph!r} a morph between hand-off and arrival "
            "would put the anchor's gradients in another basis than the weights'; use protocol.morph = off",
            (*ON_ANCHOR, *ON_MORPH)),
    Refusal((ANCHORED, relation("anchor.delay ≤ optim.spectral.max_staleness < anchor.delay + "
                                "anchor.max_late",
                                _drops_late_arrivals)),
            "anchor.max_late",
            lambda c: f"anchor.delay + anchor.max_late = {_late_window(c)} exceeds optim.spectral."
            f"max_staleness = {c.optim.spectral.max_staleness}, which would drop what the anchor delivers "
            f"late; at most {c.optim.spectral.max_staleness - c.anchor.delay}",
            (*ON_ANCHOR, "anchor.delay=20", "anchor.max_late=10", "optim.spectral.max_staleness=25")),
    Refusal((ANCHORED, relation("optim.spectral.max_staleness < anchor.delay",
                                lambda c: c.optim.spectral.max_staleness < c.anchor.delay)),
            "anchor.max_late",
            lambda c: f"anchor.delay = {c.anchor.delay} exceeds optim.spectral.max_staleness = "
            f"{c.optim.spectral.max_staleness}, which would drop every arrival",
            (*ON_ANCHOR, "anchor.delay=20", "optim.spectral.max_staleness=10")),
    Refusal((ANCHORED, equals("anchor.use", "error_feedback"), differs("anchor.send", "gradients")),
            "anchor.use",
            lambda c: f"the error feedback subtracts the fast gradient from the anchor's, which "
            f"anchor.send = {c.anchor.send!r} does not deliver: set anchor.send = gradients",
            (*ON_ANCHOR, "anchor.use=error_feedback", "anchor.weights=snapshot")),
    Refusal((ANCHORED, OUTER, below("mesh.replicas", 2)), "anchor.weights",
            lambda c: "with mesh.replicas = 1 there is no DP synchronization to listen to: "
            "set anchor.weights = snapshot",
            (*ON_ANCHOR, "anchor.weights=outer", "mesh.replicas=1")),
    Refusal((ANCHORED, OUTER, differs("dp.name", *AGREEING_DP)), "anchor.weights",
            lambda c: f"under dp.name = {c.dp.name!r} the replicas agree on no weights: use dp.name "
            f"from {list(AGREEING_DP)}, or anchor.weights = snapshot",
            (*ON_ANCHOR, "anchor.weights=outer", "dp.name=sparse")),
)


def first_refusal(cfg: Any) -> Refusal | None:
    """The first row of the table that refuses ``cfg``, or None."""
    return next((row for row in TABLE if row.refuses(cfg)), None)


def check(cfg: Any) -> None:
    """Raise the ConfigError of the first refused combination in ``cfg`` (a RunConfig whose
    components passed their own checks)."""
    row = first_refusal(cfg)
    if row is not None:
        raise ConfigError(row.key, setting(cfg, row.key), row.reason(cfg))
