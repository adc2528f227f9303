"""Our dist runtime against PyTorch's own pipeline runtime, side by side, on the same shaped link.

Same work on both sides: the demo model cut into P=4 stages by ``split_model`` (one process each,
gloo, one intra-op thread), the same 4 microbatches of the same global batches, the same AdamW and
learning-rate schedule, no gradient clipping (theirs has no cross-stage clip), one loss gather per
step for logging on both. Ours: ``meshlearn train --backend dist`` with the GPipe table. Theirs:
``torch.distributed.pipelining`` — ``PipelineStage`` + ``ScheduleGPipe``.

The link (200 Mbit/s, 50 ms one-way) is emulated on both sides by the same code: our runtime paces
its senders with ``dist.shaping=sender``; theirs gets the same pacer wrapped around its
point-to-point sends (``schedules._batch_p2p`` is replaced by a version that hands each send to a
per-link thread which holds it until the link model's delivery time, exactly as our transport does;
receives are untouched, and the returned works complete when the held send has completed). So
neither runtime gets a different network; what differs is how each schedules compute around it.
Runs alternate (ours, theirs, ours, ...) so both see the same machine load.

    python bench/peer_pipelining.py [--steps 10] [--warmup 2] [--repeats 2] [--bandwidth 200]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import DEMO, demo_config, markdown_table, write_results

from meshlearn.assemble import resolve
from meshlearn.data import global_batch
from meshlearn.data.corpus import load_corpus
from meshlearn.distributed.shaping import Pacer, hold_until
from meshlearn.entry.launch import launch_local
from meshlearn.jsonl import read_records
from meshlearn.mesh.network import Network
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder
from meshlearn.models.split import init_model, split_model
from meshlearn.optim import build_optimizer
from meshlearn.optim.schedule_lr import lr_factor


def overrides(bandwidth: float, steps: int) -> list[str]:
    return ["mesh.stages=4", "mesh.replicas=1", "mesh.microbatches=4", "mesh.schedule=gpipe",
            "codec.name=identity", f"link.bandwidth_mbit={bandwidth}", "link.latency_ms=50",
            "train.grad_clip=0", f"train.steps={steps}", "train.eval_every=100000",
            "train.checkpoint_every=0", "dist.threads=1"]


# --- ours ------------------------------------------------------------------------------------


def run_ours(sets: list[str], warmup: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-peer-ours-"))
    sets = [*sets, "backend=dist"]
    argv = ["--config", str(DEMO), "--out", str(run_dir), *(x for s in sets for x in ("--set", s))]
    if launch_local(argv, demo_config(*sets), run_dir, out=io.StringIO()) != 0:
        raise SystemExit(f"our dist run failed; see {run_dir / 'logs'}")
    train = [r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"step_s": [r["step_wall_s"] for r in train][warmup:], "losses": [r["train_loss"] for r in train]}


# --- theirs: torch.distributed.pipelining with the same pacer on its sends ------------------


class _HeldSend:
    """A send Work that completes once the held message has really been sent."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        if not self.done.wait(timeout.total_seconds() if timeout else 600.0):
            raise TimeoutError("held send did not complete")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class ShapedP2P:
    """Replaces ``schedules._batch_p2p``: sends go through a per-link pacer thread, as ours do."""

    def __init__(self, rank: int, cfg):
        self.me = WorkerId(0, rank)
        self.network = Network(cfg.link, seed=cfg.seed)
        self.epoch = time.monotonic()
        self.queues: dict[int, queue.Queue] = {}

    def __call__(self, p2p_ops, desc=None):
        works = []
        for op in p2p_ops:
            if op.op is dist.isend:
                works.append(self._send(op))
            else:
                works.append(dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer))
        return works

    def _send(self, op) -> _HeldSend:
        if op.peer not in self.queues:
            self.queues[op.peer] = q = queue.Queue()
            threading.Thread(target=self._loop, args=(q,), daemon=True).start()
        pacer = Pacer(self.network.link(self.me, WorkerId(0, op.peer)), self.epoch, enabled=True)
        held = _HeldSend()
        self.queues[op.peer].put((op, pacer.release_at(op.tensor.numel() * op.tensor.element_size()), held))
        return held

    @staticmethod
    def _loop(q: queue.Queue) -> None:
        while True:
            op, release, held = q.get()
            hold_until(release)
            try:
                dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer).wait()
            except BaseException as err:  # noqa: BLE001 — handed to the schedule's wait()
                held.error = err
            held.done.set()


def their_worker(rank: int, world: int, port: int, sets: list[str], out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, schedules

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    cfg = demo_config(*sets)
    corpus = load_corpus(cfg, None)
    cfg = resolve(cfg, corpus.vocab_size)
    module = split_model(init_model(cfg.model, cfg.seed), world)[rank]
    optimizer = build_optimizer(module, cfg.optim, cfg.train.lr)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=cfg.mesh.microbatches, loss_fn=Decoder.loss)
    schedules._batch_p2p = ShapedP2P(rank, cfg)  # the same link model as our senders
    step_s, losses = [], []
    for t in range(cfg.train.steps):
        factor = lr_factor(t, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = cfg.train.lr * factor
        x, y = global_batch(corpus.splits.train, t, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
        started = time.perf_counter()
        mb_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=mb_losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.tensor([sum(v.item() for v in mb_losses) / len(mb_losses) if mb_losses else 0.0])
        dist.all_reduce(loss)  # the loss gather our runtime does too
        step_s.append(time.perf_counter() - started)
        losses.append(loss.item())
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": step_s, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


def run_theirs(sets: list[str], warmup: int) -> dict:
    world = 4
    store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True,
                          timeout=timedelta(seconds=120), wait_for_workers=False)
    out = Path(tempfile.mkdtemp(prefix="meshlearn-peer-theirs-")) / "rank0.json"
    ctx = mp.get_context("forkserver")
    procs = [ctx.Process(target=their_worker, args=(rank, world, store.port, sets, str(out)))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    if any(p.exitcode != 0 for p in procs):
        for p in procs:
            p.kill()
        raise SystemExit(f"torch.distributed.pipelining run failed: exit codes {[p.exitcode for p in procs]}")
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    return {"step_s": result["step_s"][warmup:], "losses": result["losses"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bandwidth", type=float, default=200.0, help="Mbit/s (latency 50 ms)")
    args = parser.parse_args()

    sets = overrides(args.bandwidth, args.steps)
    cfg = demo_config(*sets)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    load_before = os.getloadavg()
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(run_ours(sets, args.warmup))
        theirs.append(run_theirs(sets, args.warmup))
    ours_tps = [tokens / statistics.mean(r["step_s"]) for r in ours]
    theirs_tps = [tokens / statistics.mean(r["step_s"]) for r in theirs]
    gap = max(abs(a - b) for a, b in zip(ours[0]["losses"], theirs[0]["losses"], strict=True))
    rows = [
        {"runtime": "meshlearn dist (GPipe table, background send/receive)",
         "tokens_per_s": statistics.mean(ours_tps), "range": f"{min(ours_tps):.0f}–{max(ours_tps):.0f}"},
        {"runtime": "torch.distributed.pipelining ScheduleGPipe",
         "tokens_per_s": statistics.mean(theirs_tps),
         "range": f"{min(theirs_tps):.0f}–{max(theirs_tps):.0f}"},
    ]
    ratio = statistics.mean(ours_tps) / statistics.mean(theirs_tps)
    payload = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "tokens_per_step": tokens,
               "link": f"{args.bandwidth:g} Mbit/s, 50 ms, paced in the senders (same pacer for both)",
               "mesh": "P=4, D=1, 4 microbatches, GPipe, identity boundary, no grad clip",
               "rows": rows, "ours_over_theirs": ratio, "max_train_loss_gap": gap,
               "step_seconds": {"ours": [r["step_s"] for r in ours], "theirs": [r["step_s"] for r in theirs]},
               "cpu_count": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    table = markdown_table(rows, [("runtime", "runtime", ""), ("tokens_per_s", "wall tok/s", ".0f"),
                                  ("range", "range over repeats", "")])
    write_results("peer_pipelining", payload,
                  f"Ours vs torch.distributed.pipelining: demo model, P=4 D=1, 4 microbatches, GPipe, "
                  f"{args.bandwidth:g} Mbit/s / 50 ms paced by the same in-process shaper, "
                  f"{args.steps} steps ({args.warmup} warm-up left out) × {args.repeats} repeats, "
                  f"{os.cpu_count()} cores (load average {load_before[0]:.1f}); "
                  f"`python bench/peer_pipelining.py`\n\n{table}\n\n"
                  f"**ours ÷ theirs = {ratio:.3f}**; largest train-loss difference between the two "
                  f"runs: {gap:.2e} (same work: same init, data, optimizer)")


if __name__ == "__main__":
    main()
