"""Why the bias ramp leaves DiLoCo unmoved (issue 32, docs/dp_robust.md): what the attack adds to
the stage's outer step, where it moves the weights, and what a move of that size costs there.

The red-team setting of ``bench/robust_dp.py`` (the demo, 4 replicas, 100 steps, warm-up 20,
DiLoCo with H = 5 and one fragment, r1s2 adding a bias to its pseudo-gradient from step 51,
``attack.bias = 2``, ``attack.ramp_steps = 8``, the mean), clean and attacked, one process each.
Measured per attacked sync of stage 2 (a hook on ``Worker.dp_contribution``): the bias's norm
against the attacker's own pseudo-gradient and the honest replicas' mean, and the component of
the honest mean along the bias direction v. At the end, on replica 0's stage 2 (honest in both
runs): the displacement d between the attacked and the clean run's weights, its cosine with v,
and against the stage's own progress over the attacked span (steps 51–100). Then the clean final
model's validation loss with stage 2 moved by d itself, by ‖d‖ along ±v, back along its own
progress, and along its last honest mean pseudo-gradient (the direction an outer step moves
against; a ×−4 attacker pushes along it): is a move of that size costly, and is the attack's
move along a costly line?

    OMP_NUM_THREADS=1 python bench/diloco_bias.py [--steps 100] [--attack-start 50]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import ROOT, demo_config, load_average

from meshlearn.compressibility.evaluate import validation_loss
from meshlearn.data import validation_batches
from meshlearn.hooks import Callback, PluginContext, StepOutput, register_plugin
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.models.split import merge_stages
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "diloco_bias"
RESULT = ROOT / "docs" / "results" / "diloco_bias.json"
ATTACKER, STAGE = WorkerId(1, 2), 2


class Syncs:
    """Stage 2's contributions per sync (``dp_contribution``): the attacker's bias and the honest
    mean, reduced to numbers as soon as a sync's four parts are in."""

    def __init__(self):
        self.parts: dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.v: torch.Tensor | None = None  # the bias direction, unit norm (fixed: one fragment)
        self.rows: list[dict] = []
        self.last_mean: torch.Tensor | None = None  # the last sync's honest mean pseudo-gradient

    def seen(self, worker: Worker, key: tuple, x: torch.Tensor, out: torch.Tensor) -> None:
        if worker.id.stage != STAGE:
            return
        parts = self.parts.setdefault(key, {})
        parts[worker.id.replica] = (x.detach().clone(), out.detach().clone())
        if len(parts) == worker.mesh.replicas:
            self._close(key, self.parts.pop(key))

    def _close(self, key: tuple, parts: dict) -> None:
        x, out = parts[ATTACKER.replica]
        bias = out - x
        if self.v is None and bias.norm() > 0:
            self.v = bias / bias.norm()
        honest = torch.stack([parts[r][0] for r in parts if r != ATTACKER.replica]).mean(0)
        self.last_mean = honest
        row = {"update": key[0], "own": x.norm().item(), "bias": bias.norm().item(),
               "honest_mean": honest.norm().item()}
        if self.v is not None:
            row["honest_mean_along_v"] = float(honest @ self.v)
            row["bias_cos_v"] = float(bias @ self.v / bias.norm().clamp_min(1e-30))
        self.rows.append(row)


class Snapshot(Callback):
    """Replica 0's stage-2 weights after step ``at`` (the attack's start: its progress from there)."""

    def __init__(self, ctx: PluginContext, at: int):
        self.worker, self.at, self.weights = ctx.workers[WorkerId(0, STAGE)], at, None

    def on_step_end(self, step: int, report) -> StepOutput:
        if step + 1 == self.at:
            self.weights = flat(self.worker.module)
        return StepOutput()


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def shifted(module: torch.nn.Module, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module's state with ``delta`` (flat, in parameter order) added to its parameters."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    offset = 0
    for name, p in module.named_parameters():
        state[name] += delta[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return state


SNAPSHOTS: list[Snapshot] = []  # one per run, in order
START = [0]  # the step after which the snapshot is taken (set by ``main``)


def snapshot_plugin(ctx: PluginContext) -> Callback:
    SNAPSHOTS.append(Snapshot(ctx, START[0]))
    return SNAPSHOTS[-1]


def run(name: str, sets: list[str], syncs: Syncs) -> tuple[Trainer, Snapshot, dict]:
    cfg = demo_config(*sets)
    original = Worker.dp_contribution

    def hooked(worker, key, x):
        out = original(worker, key, x)
        syncs.seen(worker, key, x, out)
        return out
    Worker.dp_contribution = hooked
    try:
        trainer = Trainer(cfg, OUT / name, progress=False)
        summary = trainer.train()
    finally:
        Worker.dp_contribution = original
    return trainer, SNAPSHOTS[-1], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--attack-start", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    START[0] = args.attack_start
    register_plugin("snapshot", snapshot_plugin)
    load_before, started = load_average(), time.perf_counter()
    base = ["mesh.replicas=4", f"train.steps={args.steps}", f"train.eval_every={args.steps}",
            "train.checkpoint_every=0", "train.warmup_steps=20", "dp.name=diloco", "dp.inner_steps=5",
            "dp.fragments=1"]
    attack = ["attack.kind=bias", "attack.bias=2", "attack.ramp_steps=8", f"attack.workers={ATTACKER}",
              "attack.target=dp", f"attack.start_step={args.attack_start}"]
    syncs, clean_syncs = Syncs(), Syncs()
    clean, clean_snap, clean_summary = run("clean", base, clean_syncs)
    hit, _, hit_summary = run("bias_ramp", base + attack, syncs)
    cfg = clean.cfg
    stages = [clean.workers[WorkerId(0, s)].module for s in range(cfg.mesh.stages)]
    end_clean, end_hit = flat(stages[STAGE]), flat(hit.workers[WorkerId(0, STAGE)].module)
    d, progress = end_hit - end_clean, end_clean - clean_snap.weights
    v = syncs.v
    val = validation_batches(clean.corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size,
                             cfg.model.seq_len)

    def loss_with(delta: torch.Tensor) -> float:
        states = [m.state_dict() for m in stages]
        states[STAGE] = shifted(stages[STAGE], delta)
        return validation_loss(merge_stages(cfg.model, states), val)

    size = d.norm()
    undo = clean_syncs.last_mean / clean_syncs.last_mean.norm()  # + a pseudo-gradient: undoes training
    result = {
        "val_loss": {"clean": clean_summary["final_val_loss"], "bias_ramp": hit_summary["final_val_loss"]},
        "syncs": syncs.rows,
        "stage2_params": end_clean.numel(),
        "displacement_norm": size.item(), "progress_norm": progress.norm().item(),
        "weights_norm": end_clean.norm().item(),
        "displacement_cos_v": float(d @ v / size), "displacement_cos_progress": float(d @ progress / size
                                                                                       / progress.norm()),
        "replica0_loss": {"clean": loss_with(torch.zeros_like(d)), "plus_d": loss_with(d),
                          "plus_|d|_along_v": loss_with(size * v), "minus_|d|_along_v": loss_with(-size * v),
                          "minus_|d|_along_progress": loss_with(-size * progress / progress.norm()),
                          "plus_|d|_along_last_pseudo_gradient": loss_with(size * undo)},
        "wall_s": time.perf_counter() - started, "load_before": load_before, "load_after": load_average(),
        "command": f"OMP_NUM_THREADS=1 python bench/diloco_bias.py --steps {args.steps} "
                   f"--attack-start {args.attack_start}",
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "syncs"}, indent=1))
    for row in syncs.rows:
        print(row)


if __name__ == "__main__":
    main()
