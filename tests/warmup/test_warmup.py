"""Architecture warm-up: the method note's invariants (identity, no state, continuity, the saddle),
the placement and schedule, the compute model, resume, and the optimizer seam."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from tiny import tiny_config

from meshlearn.data import global_batch
from meshlearn.errors import ConfigError
from meshlearn.mesh.compute import forward_flops, stage_shape
from meshlearn.models import Decoder, DecoderConfig, init_model
from meshlearn.optim import OptimConfig, build_optimizer
from meshlearn.train import Trainer
from meshlearn.warmup import (
    BlockLocks,
    WarmupCallback,
    WarmupConfig,
    WarmupSchedule,
    locked_layers,
    unlock_groups,
)

CFG = DecoderConfig(vocab_size=32, n_layer=4, d_model=32, n_head=2, seq_len=16)
LOCKED = [1, 3]


def batch(seed: int = 0, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def locked_model(optim: str = "adamw", weight_decay: float = 0.1):
    model = init_model(CFG, 0)
    optimizer = build_optimizer(model, OptimConfig(name=optim, weight_decay=weight_decay), 1e-2, 10)
    locks = BlockLocks(model, optimizer)
    locks.lock(LOCKED)
    return model, optimizer, locks


def train_steps(model, optimizer, n: int, seed: int = 0) -> list[float]:
    losses = []
    for t in range(n):
        x, y = batch(seed + t)
        loss = Decoder.loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def block_params(model, layer: int) -> dict[str, torch.Tensor]:
    return dict(model.layers[str(layer)].named_parameters())


# --- identity --------------------------------------------------------------------------------


def test_locked_model_equals_the_shallower_model_bitwise():
    model, _, _ = locked_model()
    shallow = Decoder(CFG, layer_ids=[0, 2])
    shallow.load_state_dict({k: v for k, v in model.state_dict().items() if k in shallow.state_dict()})
    x, _ = batch()
    assert torch.equal(model(x), shallow(x))
    # Skipping a locked block is bitwise the same as running it (its matrices are zero: x + 0).
    for i in LOCKED:
        model.layers[str(i)].locked = False
    assert torch.equal(model(x), shallow(x))
    # Negative control: a full-depth model with its real weights differs.
    assert not torch.equal(init_model(CFG, 0)(x), shallow(x))


def test_training_with_locked_blocks_equals_training_the_shallower_model(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, "model.n_layer=4", "mesh.microbatches=1", "train.grad_clip=0",
                      "train.steps=4", "warmup.enabled=true", "warmup.start_step=100")
    trainer = Trainer(cfg, tmp_path, progress=False)
    trainer.train()
    losses = [json.loads(line)["train_loss"] for line in (tmp_path / "metrics.jsonl").open()
              if json.loads(line)["kind"] == "train"]
    c = trainer.cfg
    full = init_model(c.model, c.seed)
    shallow = Decoder(c.model, layer_ids=[0, 2])
    shallow.load_state_dict({k: v for k, v in full.state_dict().items() if k in shallow.state_dict()})
    optimizer = build_optimizer(shallow, c.optim, c.train.lr, c.train.steps)
    from meshlearn.optim.schedule_lr import lr_factor
    ref = []
    for t in range(4):
        x, y = global_batch(trainer.corpus.splits.train, t, c.train.batch_size, c.model.seq_len, c.seed)
        loss = Decoder.loss(shallow(x), y)
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * lr_factor(
                t, c.train.warmup_steps, c.train.steps, c.train.min_lr_ratio)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref.append(loss.item())
    assert losses == ref
    state = trainer.workers[next(iter(trainer.workers))].module.state_dict()
    for k, v in shallow.state_dict().items():
        assert torch.equal(state[k], v), k


# --- no state, no update -----------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["adamw", "nadamw", "sgd", "muon", "numuon"])
def test_locked_parameters_get_no_state_and_no_update_with_weight_decay(optim):
    model, optimizer, _ = locked_model(optim, weight_decay=0.1)
    before = copy.deepcopy(model.state_dict())
    train_steps(model, optimizer, 3)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for i in LOCKED:
        for name, p in block_params(model, i).items():
            assert id(p) not in held and p not in optimizer.state, name
            assert torch.equal(p, before[f"layers.{i}.{name}"]), name  # zeros, gains at 1
            assert p.grad is None
    assert not torch.equal(model.layers["0"].attn.q.weight, before["layers.0.attn.q.weight"])


# --- unlocking -----------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_unlock_is_continuous_and_the_first_gradient_is_nonzero(optim):
    model, optimizer, locks = locked_model(optim)
    train_steps(model, optimizer, 3)
    x, y = batch(99)
    with torch.no_grad():
        logits_before = model(x)
    groups_before = len(optimizer.param_groups)
    added = locks.unlock([1], "zero_out_small_in", 0.1, seed=0)
    assert len(optimizer.param_groups) == groups_before + len(added) and added
    def hyper(g):
        return {k: v for k, v in g.items() if k not in ("params", "param_names")}

    # Each new group copies the hyperparameters of a group built at construction (decay on
    # matrices only, the same lr), so the lr schedule drives it too.
    assert all(hyper(g) in [hyper(t) for t in optimizer.param_groups[:groups_before]] for g in added)
    if optim == "adamw":
        for g in added:
            assert g["weight_decay"] == (0.1 if all(p.dim() >= 2 for p in g["params"]) else 0.0)
    logits_after = model(x)
    assert torch.equal(logits_before, logits_after)
    loss = Decoder.loss(logits_after, y)
    loss.backward()
    block = model.layers["1"]
    assert block.attn.o.weight.grad.abs().sum() > 0 and block.mlp.down.weight.grad.abs().sum() > 0
    optimizer.step()
    assert block.attn.o.weight.abs().sum() > 0
    # Fresh state: the unlocked block's step counts start at 0 while the others' are at 4.
    counts = [float(optimizer.state[p]["step"]) for p in block.parameters() if "step" in optimizer.state[p]]
    assert counts and all(c == 1.0 for c in counts)
    assert float(optimizer.state[model.layers["0"].attn_norm.weight]["step"]) == 4.0
    assert model.layers["3"].locked and model.layers["3"].attn.o.weight.abs().sum() == 0


@pytest.mark.parametrize("ramp", [0, 4])
def test_the_first_update_after_unlock_is_lr_per_coordinate_and_the_ramp_divides_it(ramp):
    """Why ``warmup.lr_ramp_steps`` exists: Adam's first update from fresh state is lr·g/|g|, so the
    unlocked block's output projection jumps from 0 to ±lr in every coordinate at once (against an
    init of ~0.01); a ramp of R steps makes that first jump lr/R."""
    lr = 1e-2
    model = init_model(CFG, 0)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", weight_decay=0.0), lr, 10)
    for group in optimizer.param_groups:  # as the worker does
        group.setdefault("initial_lr", group["lr"])
    w = WarmupConfig(enabled=True, groups=1, start_step=1, unlock_every=1, lr_ramp_steps=ramp)
    cfg = SimpleNamespace(warmup=w, model=SimpleNamespace(n_layer=CFG.n_layer), seed=0,
                          mesh=SimpleNamespace(stages=1), train=SimpleNamespace(warmup_steps=0))
    callback = WarmupCallback(cfg, {0: SimpleNamespace(module=model, optimizer=optimizer)}, None)
    assert callback.schedule.locked == LOCKED
    train_steps(model, optimizer, 1)
    callback.on_drain(1)
    for group in optimizer.param_groups:  # what the worker's lr schedule does before every step
        group["lr"] = group["initial_lr"]
    train_steps(model, optimizer, 1, seed=1)
    moved = model.layers["1"].attn.o.weight.detach().abs()
    assert torch.allclose(moved.median(), torch.tensor(lr / max(1, ramp)), rtol=1e-3)
    callback.on_step_end(1, None)  # the ramp's next factor: 2/R
    assert all(g["initial_lr"] == pytest.approx(lr * (2 / ramp if ramp else 1))
               for g in optimizer.param_groups[-2:])


def test_literal_zero_unlock_is_a_saddle_that_never_trains():
    model, optimizer, locks = locked_model("adamw", weight_decay=0.1)
    locks.unlock([1], "literal_zero", 0.1, seed=0)
    x, y = batch(5)
    Decoder.loss(model(x), y).backward()
    block = model.layers["1"]
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
    optimizer.zero_grad(set_to_none=True)
    train_steps(model, optimizer, 10)
    for name, p in block.named_parameters():
        if p.dim() >= 2:
            assert torch.count_nonzero(p) == 0, name
    # Control: the recommended unlock of the other block trains at once.
    locks.unlock([3], "zero_out_small_in", 0.1, seed=0)
    train_steps(model, optimizer, 1)
    assert model.layers["3"].attn.o.weight.abs().sum() > 0


def test_unlock_init_is_the_same_on_every_replica():
    a, _, la = locked_model()
    b, _, lb = locked_model()
    la.unlock([1], "zero_out_small_in", 0.1, seed=7)
    lb.unlock([1], "zero_out_small_in", 0.1, seed=7)
    for (n, p), q in zip(block_params(a, 1).items(), block_params(b, 1).values(), strict=True):
        assert torch.equal(p, q), n
    assert block_params(a, 1)["attn.o.weight"].abs().sum() == 0
    std = block_params(a, 1)["attn.q.weight"].std().item()
    assert 0.5 * 0.002 < std < 1.5 * 0.002  # 0.1 × init_std


# --- placement and schedule ----------------------------------------------------------------------


def test_interleaved_placement_leaves_every_stage_working():
    locked = locked_layers(16, 4, 0.5, "interleaved")
    assert locked == [1, 3, 5, 7, 9, 11, 13, 15]
    assert locked_layers(16, 4, 0.5, "top") == list(range(8, 16))
    assert unlock_groups(locked, 4, "bottom_up", 16, 4) == [[1, 3], [5, 7], [9, 11], [13, 15]]
    assert unlock_groups(locked, 4, "across_stages", 16, 4) == [[1, 5], [9, 13], [3, 7], [11, 15]]
    assert unlock_groups([1, 3, 5], 2, "bottom_up", 8, 2) == [[1, 3], [5]]


def test_schedule_waits_for_the_lr_warmup_then_unlocks_every_n_steps():
    s = WarmupSchedule.from_config(WarmupConfig(enabled=True, unlock_every=500), 16, 4, 2000)
    assert s.steps == [2000, 2500, 3000, 3500]
    assert s.depth([], 16) == 8 and s.depth([0, 1, 2, 3], 16) == 16
    assert s.due(2500) == [1] and s.unlocked_by(2999) == [0, 1]


def test_compute_model_charges_only_unlocked_blocks(tiny_corpus, tmp_path):
    model, _, locks = locked_model()
    shape = stage_shape(model)
    assert shape.layers == 2
    assert forward_flops(CFG, shape, 4) < forward_flops(CFG, stage_shape(init_model(CFG, 0)), 4)
    locks.unlock([1], "zero_out_small_in", 0.1, seed=0)
    assert stage_shape(model).layers == 3
    # In the simulator: the step's virtual time follows the depth.
    common = ["mesh.stages=2", "train.steps=3", "warmup.groups=2", "warmup.unlock_every=1",
              "warmup.start_step=1"]
    Trainer(tiny_config(tiny_corpus, *common, "warmup.enabled=true"), tmp_path / "w", progress=False).train()
    Trainer(tiny_config(tiny_corpus, *common), tmp_path / "b", progress=False).train()
    w = [r for r in map(json.loads, (tmp_path / "w" / "metrics.jsonl").open()) if r["kind"] == "train"]
    b = [r for r in map(json.loads, (tmp_path / "b" / "metrics.jsonl").open()) if r["kind"] == "train"]
    assert [r["active_layers"] for r in w] == [2, 3, 4]
    assert w[0]["step_sim_s"] < w[1]["step_sim_s"] < w[2]["step_sim_s"]
    assert abs(w[2]["step_sim_s"] - b[2]["step_sim_s"]) < 1e-12  # full depth: the baseline's cost


# --- runs --------------------------------------------------------------------------------------


def test_resume_across_unlocks_reproduces_an_uninterrupted_run(tiny_corpus, tmp_path):
    overrides = ["mesh.stages=2", "mesh.replicas=2", "train.steps=6", "warmup.enabled=true",
                 "warmup.groups=2", "warmup.start_step=2", "warmup.unlock_every=2",
                 "warmup.lr_ramp_steps=2"]
    Trainer(tiny_config(tiny_corpus, *overrides), tmp_path / "a", progress=False).train()
    Trainer(tiny_config(tiny_corpus, *overrides, "train.stop_at_step=3"), tmp_path / "b",
            progress=False).train()
    Trainer(tiny_config(tiny_corpus, *overrides), tmp_path / "b", resume=True, progress=False).train()

    def losses(d):
        records = map(json.loads, (d / "metrics.jsonl").open())
        return [r["train_loss"] for r in records if r["kind"] == "train"]

    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == len(b) == 6 and a == b


def test_config_is_validated_by_the_component(tiny_corpus):
    with pytest.raises(ConfigError, match="warmup.groups"):
        tiny_config(tiny_corpus, "warmup.enabled=true", "warmup.groups=0")
    with pytest.raises(ConfigError, match="warmup.unlock_init"):
        tiny_config(tiny_corpus, "warmup.enabled=true", "warmup.unlock_init=random")
    with pytest.raises(ConfigError, match="dp.name"):
        tiny_config(tiny_corpus, "warmup.enabled=true", "dp.name=powersgd", "mesh.replicas=2")
    with pytest.raises(ConfigError, match="warmup.locked_fraction"):
        tiny_config(tiny_corpus, "warmup.enabled=true", "mesh.stages=4")  # 1 block per stage
