"""The async schedule (no-flush 1F1B) against its oracle: the unsplit model with each stage's
gradients applied at the same delays, and the invariants of the method note."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_config
from torch.func import functional_call

from meshlearn.data import global_batch, shard_batch
from meshlearn.errors import ConfigError
from meshlearn.mesh.schedule import stage_in_flight
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, init_model, merge_stages, split_model
from meshlearn.optim import build_optimizer
from meshlearn.optim.async_lr import async_lr_scale
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.train import Trainer

ASYNC = ["mesh.schedule=async", "mesh.microbatches=4", "train.steps=3"]


def train_records(run_dir, kind="train"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def delayed_oracle(trainer: Trainer, steps: int) -> tuple[list[float], Decoder]:
    """One process, the unsplit model's stages: microbatch j's forward at stage s uses the weights
    of version max(0, j − (n_s − 1)) // update_every, n_s the stage's in-flight depth (P − s by
    default) — the version no-flush 1F1B has when it runs F(j) — and its backward the same weights; each
    stage steps after every group of update_every microbatches, averaged over the replicas and
    clipped per stage at grad_clip / √P, at the scheduled lr × the stage's mesh.async_lr_rule factor."""
    cfg = trainer.cfg
    P, D, M, ue = cfg.mesh.stages, cfg.mesh.replicas, cfg.mesh.microbatches, cfg.mesh.update_every
    depth = [trainer.workers[WorkerId(0, s)].plan.in_flight for s in range(P)]
    stage_scale = [async_lr_scale(cfg.mesh.async_lr_rule, M, ue, depth[s]) for s in range(P)]
    stages = split_model(init_model(cfg.model, cfg.seed), P)
    optimizers = [build_optimizer(stage, cfg.optim, cfg.train.lr, cfg.train.steps) for stage in stages]
    history = [[{n: p.detach().clone() for n, p in stage.named_parameters()}] for stage in stages]
    grads = [dict() for _ in stages]
    losses = []
    for t in range(steps):
        x, y = global_batch(trainer.corpus.splits.train, t, cfg.train.batch_size, cfg.model.seq_len,
                            cfg.seed)
        shards = shard_batch(x, y, D, M)
        step_losses = []
        for m in range(M):
            j = t * M + m
            for r in range(D):
                weights = []
                for s in range(P):
                    version = max(0, j - (depth[s] - 1)) // ue
                    kept = history[s][version]
                    weights.append({n: w.clone().requires_grad_(True) for n, w in kept.items()})
                h = shards[r][m][0]
                for s, stage in enumerate(stages):
                    h = functional_call(stage, weights[s], (h,))
                loss = Decoder.loss(h, shards[r][m][1])
                step_losses.append(loss.item())
                (loss / ue).backward()
                for s in range(P):
                    for n, w in weights[s].items():
                        grads[s][n] = grads[s][n] + w.grad if n in grads[s] else w.grad.clone()
            if (j + 1) % ue:
                continue
            factor = lr_factor(t, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
            for s, stage in enumerate(stages):
                for n, p in stage.named_parameters():
                    p.grad = grads[s][n] / D
                torch.nn.utils.clip_grad_norm_(stage.parameters(), cfg.train.grad_clip / P**0.5,
                                               foreach=False)
                for group in optimizers[s].param_groups:
                    group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor * stage_scale[s]
                optimizers[s].step()
                optimizers[s].zero_grad(set_to_none=True)
                history[s].append({n: p.detach().clone() for n, p in stage.named_parameters()})
                grads[s] = {}
        losses.append(sum(step_losses) / len(step_losses))
    return losses, merge_stages(cfg.model, [stage.state_dict() for stage in stages])


def mesh_model(trainer: Trainer, replica: int = 0) -> Decoder:
    states = [trainer.workers[WorkerId(replica, s)].module.state_dict() for s in range(trainer.mesh.stages)]
    return merge_stages(trainer.cfg.model, states)


def max_param_gap(a: Decoder, b: Decoder) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("stages", [2, 4])
def test_stashed_async_mesh_equals_the_delayed_oracle(tiny_corpus, tmp_path, stages, replicas):
    cfg = tiny_config(tiny_corpus, *ASYNC, f"mesh.stages={stages}", f"mesh.replicas={replicas}")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    oracle_losses, oracle = delayed_oracle(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, oracle_losses, strict=True)) <= 1e-5
    for r in range(replicas):
        assert max_param_gap(mesh_model(trainer, r), oracle) <= 1e-5


@pytest.mark.parametrize("overrides", [
    ["mesh.update_every=2"],
    ["mesh.in_flight=6"],  # deeper than 1F1B: more staleness, the same oracle
    ["optim.name=nadamw", "mesh.replicas=2"],
    ["optim.name=muon", "mesh.replicas=2"],
    ["optim.name=numuon"],
    ["mesh.async_lr_rule=off"],
    ["mesh.async_lr_rule=microbatch", "mesh.update_every=2"],
], ids=["update_every", "in_flight", "nadamw", "muon", "numuon", "lr_rule_off", "lr_rule_microbatch"])
def test_groups_depths_and_optimizers_follow_the_oracle_too(tiny_corpus, tmp_path, overrides):
    cfg = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", *overrides)
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    oracle_losses, oracle = delayed_oracle(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, oracle_losses, strict=True)) <= 1e-5
    assert max_param_gap(mesh_model(trainer), oracle) <= 1e-5


def test_in_flight_auto_covers_the_round_trip_and_respects_the_cap(tiny_corpus):
    """With links slow against compute, auto holds more than 1F1B's P − s (capped, strictly
    decreasing so no stage stalls on its neighbour); with free links it is 1F1B's depth; the last
    stage always holds one; a request shallower than 1F1B is lifted to it."""
    slow = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", "mesh.in_flight=auto", "link.latency_ms=50",
                       "mesh.max_in_flight=12")
    depths = [stage_in_flight(slow, s) for s in range(4)]
    assert depths == [12, 11, 10, 1]
    free = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", "mesh.in_flight=auto", "link.latency_ms=0",
                       "link.bandwidth_mbit=inf")
    assert [stage_in_flight(free, s) for s in range(4)] == [4, 3, 2, 1]
    deep = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", "mesh.in_flight=16")
    assert [stage_in_flight(deep, s) for s in range(4)] == [16, 11, 6, 1]  # 1F1B's shape, scaled
    shallow = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", "mesh.in_flight=2")
    assert [stage_in_flight(shallow, s) for s in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize(("override", "message"), [
    ("mesh.update_every=3", "mesh.update_every = 3: must divide mesh.microbatches = 4"),
    ("mesh.in_flight=0", "mesh.in_flight = '0': allowed: default, auto or a positive integer"),
    ("mesh.schedule=1f1b", "mesh.weight_stashing = False: only the async schedule uses it"),
])
def test_bad_async_settings_name_the_field(tiny_corpus, override, message):
    extra = ["mesh.weight_stashing=false"] if override == "mesh.schedule=1f1b" else []
    with pytest.raises(ConfigError, match=message):
        tiny_config(tiny_corpus, *ASYNC, *extra, override)


def test_without_stashing_the_mesh_leaves_the_oracle(tiny_corpus, tmp_path):
    """Negative control: No-WS backpropagates through weights that changed since the forward."""
    cfg = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", "mesh.weight_stashing=false")
    trainer = Trainer(cfg, tmp_path, progress=False)
    for _ in range(3):
        trainer.step()
    _, oracle = delayed_oracle(trainer, 3)
    assert max_param_gap(mesh_model(trainer), oracle) > 1e-4


def test_one_stage_async_with_whole_batch_updates_is_the_synchronous_run(tiny_corpus, tmp_path):
    sync = Trainer(tiny_config(tiny_corpus, "train.steps=3"), tmp_path / "sync", progress=False)
    asyn = Trainer(tiny_config(tiny_corpus, "train.steps=3", "mesh.schedule=async",
                               "mesh.update_every=2"), tmp_path / "async", progress=False)
    a = [sync.step() for _ in range(3)]
    b = [asyn.step() for _ in range(3)]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6
    assert max_param_gap(mesh_model(sync), mesh_model(asyn)) <= 1e-6


def test_staleness_per_stage_is_p_minus_1_minus_s_in_steady_state(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4", "train.steps=4")
    Trainer(cfg, tmp_path, progress=False).train()
    records = train_records(tmp_path)
    assert records[0]["staleness"][0] < 3  # the first microbatches ran on version 0
    for record in records[1:]:
        assert record["staleness"] == [3.0, 2.0, 1.0, 0.0]


def test_stashing_holds_tau_plus_one_versions(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, *ASYNC, "mesh.stages=4")
    trainer = Trainer(cfg, tmp_path, progress=False)
    summary = trainer.train()
    peaks = [trainer.workers[WorkerId(0, s)].stash_peak for s in range(4)]
    assert peaks == [4, 3, 2, 1]
    assert summary["stash_bytes_peak"] == 4 * trainer.workers[WorkerId(0, 0)].param_bytes
    assert all(w.idle and not w._stash for w in trainer.workers.values())  # drained at the end


def test_async_keeps_every_worker_busy_with_free_links(tiny_corpus, tmp_path):
    """Unlimited bandwidth, zero latency, device-model compute: in steady state the slowest stage
    (the last, with the head) is ≥ 95% busy and every other ≥ 95% of its compute ÷ the slowest's;
    the flushing 1F1B idles in its bubble."""
    base = ["mesh.stages=4", "mesh.microbatches=8", "train.batch_size=16", "train.steps=12",
            "link.bandwidth_mbit=inf", "link.latency_ms=0", "sim.compute=device"]

    def steady_busy(schedule):
        trainer = Trainer(tiny_config(tiny_corpus, *base, f"mesh.schedule={schedule}"),
                          tmp_path / schedule, progress=False)
        for _ in range(4):
            trainer.step()
        clock = trainer.driver.clock
        busy0, time0 = dict(clock.busy_s), clock.step_end
        for _ in range(6):
            trainer.step()
        span = clock.step_end - time0
        return {w.stage: (clock.busy_s[w] - busy0[w]) / span for w in clock.busy_s}, trainer

    busy, trainer = steady_busy("async")
    compute = trainer.driver.compute
    work = {s: sum(compute.compute_s(trainer.workers[WorkerId(0, s)].shape, k, 2, 0.0) for k in "FB")
            for s in range(4)}
    slowest = max(work, key=work.get)
    assert slowest == 3
    assert busy[slowest] >= 0.95
    for s in range(4):
        assert busy[s] >= 0.95 * work[s] / work[slowest]
    flushing, _ = steady_busy("1f1b")
    assert flushing[slowest] <= busy[slowest] - 0.05  # the flush's bubble


def test_async_resumes_exactly_from_a_drain_point(tiny_corpus, tmp_path):
    overrides = [*ASYNC, "mesh.stages=4", "mesh.replicas=2", "train.steps=6", "train.eval_every=3",
                 "train.checkpoint_every=3", "link.jitter_ms=5"]
    Trainer(tiny_config(tiny_corpus, *overrides), tmp_path / "a", progress=False).train()
    Trainer(tiny_config(tiny_corpus, *overrides, "train.stop_at_step=3"), tmp_path / "b",
            progress=False).train()
    Trainer(tiny_config(tiny_corpus, *overrides), tmp_path / "b", resume=True, progress=False).train()
    a, b = train_records(tmp_path / "a"), train_records(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b, strict=True):
        assert ra["train_loss"] == rb["train_loss"] and ra["sim_time_s"] == rb["sim_time_s"]
    assert [r["val_loss"] for r in train_records(tmp_path / "a", "eval")] == \
        [r["val_loss"] for r in train_records(tmp_path / "b", "eval")]
