"""Turn a validated RunConfig into the pieces a run needs: tokens, tokenizer, workers, driver."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.registry import build_codec
from meshlearn.compress.wire_checks import WireGuard
from meshlearn.config import RunConfig
from meshlearn.data import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    TokenSplits,
    build_tokenizer,
    check_split_length,
    encode_corpus,
    is_token_file,
    load_text,
    load_tokens_bin,
    split_tokens,
)
from meshlearn.dp.registry import build_strategy
from meshlearn.mesh.compute import ComputeModel, StageShape
from meshlearn.mesh.network import Network
from meshlearn.mesh.network import build_network as network_from_config
from meshlearn.mesh.schedule import build_plan, round_trip_in_flight
from meshlearn.mesh.sim import SimDriver
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.models.llama import Decoder
from meshlearn.models.split import init_model, split_model
from meshlearn.optim.async_lr import async_lr_scale
from meshlearn.optim.factory import build_optimizer
from meshlearn.optim.no_ws import no_ws_stage_hparams
from meshlearn.optim.spectral import SpectralCorrection
from meshlearn.protocol.plugin import stage_modules


@dataclass
class Corpus:
    splits: TokenSplits
    tokenizer: Tokenizer | None  # None for a pre-tokenized .bin without a known tokenizer
    vocab_size: int


def load_corpus(cfg: RunConfig, run_dir: Path | None) -> Corpus:
    """Read and tokenize the corpus; the BPE tokenizer is trained once and cached in the run."""
    data = cfg.data
    if is_token_file(data.corpus):
        tokens = load_tokens_bin(data.corpus)
        vocab = cfg.model.vocab_size or int(tokens.max()) + 1
        tokenizer = ByteTokenizer() if vocab <= 256 else None
    else:
        text = load_text(data.corpus)
        cache = run_dir / "tokenizer.json" if run_dir is not None else None
        if data.tokenizer == "model":
            tokenizer = pretrained_tokenizer(cfg, cache)
        else:
            tokenizer = build_tokenizer(data.tokenizer, text, cache, data.bpe_vocab_size)
        tokens = encode_corpus(text, tokenizer)
        vocab = tokenizer.vocab_size
    splits = split_tokens(tokens, data.val_fraction)
    check_split_length(splits, cfg.model.seq_len)
    return Corpus(splits, tokenizer, vocab)


def pretrained_tokenizer(cfg: RunConfig, cache: Path | None) -> Tokenizer:
    """data.tokenizer = model: the run's saved copy, or model.init's tokenizer (saved on first use)."""
    if cache is not None and cache.is_file():
        return BPETokenizer.load(cache)
    from meshlearn.models.pretrained import find_source

    tokenizer = BPETokenizer(find_source(cfg.model.init).tokenizer())
    if cache is not None:
        tokenizer.save(cache)
    return tokenizer


def load_tokenizer(cfg: RunConfig, run_dir: Path) -> Tokenizer | None:
    """The tokenizer of a finished run, without re-reading the corpus (BPE comes from its cache)."""
    if is_token_file(cfg.data.corpus):
        return ByteTokenizer() if cfg.model.vocab_size <= 256 else None
    return build_tokenizer(cfg.data.tokenizer, None, run_dir / "tokenizer.json",
                           cfg.data.bpe_vocab_size)


def resolve(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """The one place derived values are filled in: the vocabulary comes from the tokenizer."""
    if cfg.model.vocab_size not in (0, vocab_size):
        raise ValueError(f"model.vocab_size = {cfg.model.vocab_size} but the tokenizer has "
                         f"{vocab_size} tokens; leave it at 0 to take the tokenizer's")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def build_workers(cfg: RunConfig) -> dict[WorkerId, Worker]:
    """Every replica of every stage starts from the same seeded unsplit model."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    stages = stage_modules(cfg, split_model(init_model(cfg.model, cfg.seed), cfg.mesh.stages))
    return {wid: build_worker(cfg, wid, copy.deepcopy(stages[wid.stage])) for wid in mesh.workers()}


def build_worker(cfg: RunConfig, wid: WorkerId, module: Decoder) -> Worker:
    """One worker around its stage module (the dist runtime builds just its own)."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    optimizer = build_optimizer(module, cfg.optim, cfg.train.lr, cfg.train.steps)
    plan = build_plan(cfg.mesh.schedule, wid.stage, mesh.stages, cfg.mesh.microbatches,
                      stage_in_flight(cfg, wid.stage), cfg.mesh.update_every)
    codec = build_codec(cfg.codec, cfg.model)
    worker = Worker(wid, mesh, module, optimizer, codec, plan, cfg.mesh.microbatches,
                    cfg.mesh.weight_stashing)
    worker.guard = WireGuard(codec, cfg.model.seq_len, cfg.model.d_model, cfg.model.vocab_size)
    worker.dp = build_strategy(cfg.dp, worker, dp_link_profile(cfg, wid))
    if cfg.optim.spectral.enabled:
        worker.spectral = SpectralCorrection(module.named_parameters(), cfg.optim.spectral)
        worker.spectral.attach(optimizer)
    if cfg.mesh.schedule == "async" and not cfg.mesh.weight_stashing:
        use_no_ws_hparams(worker, cfg)
    if cfg.mesh.schedule == "async":
        use_async_lr_rule(worker, cfg)
    return worker


def use_async_lr_rule(worker: Worker, cfg: RunConfig) -> None:
    """``mesh.async_lr_rule``: the stage's lr factor for per-microbatch, stale updates
    (:func:`~meshlearn.optim.async_lr.async_lr_scale`), on top of any No-WS scale. No-WS already
    compensates staleness, so it gets only the microbatch term."""
    rule = cfg.mesh.async_lr_rule
    if rule == "microbatch_staleness" and not cfg.mesh.weight_stashing:
        rule = "microbatch"
    scale = async_lr_scale(rule, cfg.mesh.microbatches, cfg.mesh.update_every, worker.plan.in_flight)
    inner = worker.stage_lr_scale
    if scale != 1.0:
        worker.stage_lr_scale = (lambda step: scale) if inner is None else (lambda step: scale * inner(step))


def use_no_ws_hparams(worker: Worker, cfg: RunConfig) -> None:
    """No-WS (method note): β1 grows with the stage's delay and early stages start at a smaller
    learning rate. β1 applies to every Adam-style group (those with ``betas``); Muon's own
    momentum is left as configured."""
    stage, stages, steps = worker.id.stage, cfg.mesh.stages, cfg.train.steps
    delay = worker.plan.in_flight - 1  # the stage's real staleness under mesh.in_flight
    beta1 = no_ws_stage_hparams(stage, stages, 0.0, cfg.optim.no_ws_lr_anneal, delay=delay).beta1
    for group in worker.optimizer.param_groups:
        if "betas" in group:
            group["betas"] = (beta1, group["betas"][1])
    worker.stage_lr_scale = lambda step: no_ws_stage_hparams(
        stage, stages, (step + 1) / steps, cfg.optim.no_ws_lr_anneal, delay=delay).lr_scale


def stage_in_flight(cfg: RunConfig, stage: int) -> int:
    """``mesh.in_flight`` for one stage of the async schedule (the last stage always holds one)."""
    return pipeline_in_flight(cfg)[stage]


def pipeline_in_flight(cfg: RunConfig) -> list[int]:
    """Every stage's in-flight depth. Whatever was asked, depths are at least 1F1B's (P − s) and
    strictly decrease along the pipeline: where two neighbours hold the same number, the upper one
    waits, in plan order, for an activation while a gradient it could backward sits in its inbox
    (measured: 2/2/2/1 runs at 0.37× the throughput of 4/3/2/1)."""
    mesh, stages = cfg.mesh, cfg.mesh.stages
    text = mesh.in_flight.strip()
    wanted = []
    for stage in range(stages):
        below = stages - 1 - stage
        if text == "default" or below == 0:
            wanted.append(below + 1)
        elif text.isdigit():
            # N is the first stage's depth; later stages hold proportionally fewer, 1F1B's shape.
            wanted.append(1 + math.ceil((int(text) - 1) * below / (stages - 1)))
        else:
            wanted.append(_round_trip_depth(cfg, stage))
    depths = [max(n, stages - s) for s, n in enumerate(wanted)]
    for s in range(1, stages):  # strictly decreasing, within what the stage above holds
        depths[s] = max(stages - s, min(depths[s], depths[s - 1] - 1))
    return depths


def _round_trip_depth(cfg: RunConfig, stage: int) -> int:
    """auto: the stage's own forward+backward per microbatch against the round trip below it, with
    the codec's real message size (encoded once, on zeros)."""
    mesh, stages = cfg.mesh, cfg.mesh.stages
    compute = ComputeModel(cfg.sim, cfg.model)
    micro = cfg.train.batch_size // mesh.replicas // mesh.microbatches
    stage_shape = StageShape(cfg.model.n_layer // stages, stage == 0, stage == stages - 1)
    own = sum(compute.compute_s(stage_shape, kind, micro, 0.0) for kind in ("F", "B"))
    shape = (micro, cfg.model.seq_len, cfg.model.d_model)
    ids = torch.zeros(shape[:-1], dtype=torch.long)
    ctx = MessageContext(0, 0, stage)  # a training message over this boundary
    message_bytes = build_codec(cfg.codec, cfg.model).encode(torch.zeros(shape), "act", ids, ctx).wire_bytes
    # The boundary below this stage (per-axis profiles and overrides included).
    profile = build_network(cfg).link(WorkerId(0, stage), WorkerId(0, stage + 1)).profile
    transfer = profile.serialization_s(message_bytes)
    return round_trip_in_flight(stage, stages, own, profile.latency_s, transfer, mesh.max_in_flight)


def dp_link_profile(cfg: RunConfig, wid: WorkerId):
    """The slowest profile of ``wid``'s links to the other replicas of its stage (default deadlines
    of DP rounds derive from it)."""
    network = build_network(cfg)
    peers = [WorkerId(r, wid.stage) for r in range(cfg.mesh.replicas) if r != wid.replica]
    profiles = [network.link(wid, p).profile for p in peers] or [network.link(wid, wid).profile]
    return max(profiles, key=lambda p: (p.serialization_s(1 << 20) + p.latency_s))


def build_network(cfg: RunConfig) -> Network:
    """The run's links: ``link.*``, the per-axis profiles and per-link overrides of ``links.*``."""
    return network_from_config(cfg.link, cfg.links, MeshShape(cfg.mesh.replicas, cfg.mesh.stages),
                               cfg.seed)


def build_sim_driver(cfg: RunConfig, workers: dict[WorkerId, Worker]) -> SimDriver:
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    network = build_network(cfg)
    return SimDriver(mesh, workers, network, ComputeModel(cfg.sim, cfg.model), cfg.train.grad_clip)
