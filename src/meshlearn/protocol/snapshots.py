"""What a morphing run keeps for the attack commands: stage snapshots from two morph epochs and
samples of the traffic that crossed each pipeline boundary (docs/unextractable.md).

A participant who keeps rejoining collects one stage at a time, each in the basis of the epoch it
held it. To measure what such a collection is worth, the run folder keeps, for each of the last
``protocol.keep_snapshots`` morphs, replica 0's stages just before and just after it: the same
training state in two bases (the attacker's best case: no training drift between the pieces), and
with two morphs kept, two epochs ``every_steps`` steps apart as well. Each snapshot also holds, per
pipeline boundary, the activations crossing it on

- ``passive``: fresh training windows, different in every snapshot: what a passive holder of the
  next stage receives during that epoch (the covariance-alignment attack's only input);
- ``probe``: fixed windows, the same in every snapshot: the traffic of identical inputs at two
  times, which an attacker controlling the upstream input could provoke (the bridge attack).

Files: ``RUN/protocol/epoch-EEEE-step-SSSSSS.pt`` (safetensors + JSON, meshlearn/statefile.py;
no pickle), each written atomically; older ones are removed
once a newer morph's pair is on disk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from meshlearn.models.llama import DecoderConfig
from meshlearn.protocol.model import ProtocolDecoder
from meshlearn.protocol.transforms import seeded_generator
from meshlearn.statefile import load_state, save_state

SNAPSHOT_DIR = "protocol"
TRAFFIC_BATCH = 16  # windows per forward when computing traffic (bounds the activation memory)


@dataclass
class Snapshot:
    """Replica 0's stages at one time, in one epoch's basis, with their boundary traffic."""

    epoch: int  # morphs applied to these weights
    step: int  # training steps done
    model: DecoderConfig
    stages: list[dict[str, Tensor]]  # one state dict per stage
    passive: list[Tensor]  # per pipeline boundary: (tokens, d) on this snapshot's own windows
    probe: list[Tensor]  # per pipeline boundary: (tokens, d) on the probe windows (shared)

    @property
    def name(self) -> str:
        return f"{self.epoch}@{self.step}"

    def modules(self) -> list[ProtocolDecoder]:
        """The stages as modules (eval mode)."""
        return [stage_module(self.model, state, s, len(self.stages))
                for s, state in enumerate(self.stages)]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "model": dataclasses.asdict(self.model)}

    @classmethod
    def from_dict(cls, state: dict) -> Snapshot:
        return cls(**{**state, "model": DecoderConfig(**state["model"])})


def stage_module(cfg: DecoderConfig, state: dict[str, Tensor], stage: int, stages: int) -> ProtocolDecoder:
    """A protocol stage holding ``state`` (its layers read from the state's keys)."""
    ids = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    with torch.random.fork_rng(devices=[]):
        module = ProtocolDecoder(cfg, range(ids[0], ids[-1] + 1) if ids else range(0),
                                 embed=stage == 0, head=stage == stages - 1)
    module.load_state_dict(state, strict=True)
    return module.eval()


@torch.no_grad()
def boundary_traffic(stages: list[nn.Module], windows: Tensor) -> list[Tensor]:
    """The residual activations leaving each stage but the last on ``windows`` (n, T) token ids:
    one (n·T, d) tensor per pipeline boundary."""
    out: list[list[Tensor]] = [[] for _ in stages[:-1]]
    for lo in range(0, len(windows), TRAFFIC_BATCH):
        h = windows[lo:lo + TRAFFIC_BATCH]
        for s, stage in enumerate(stages[:-1]):
            h = stage(h)
            out[s].append(h.reshape(-1, h.shape[-1]).clone())
    return [torch.cat(parts) for parts in out]


def traffic_windows(tokens: np.ndarray, n_tokens: int, seq_len: int, *seed: object) -> Tensor:
    """ceil(n_tokens / seq_len) training windows at offsets drawn from ``seed`` (run seed, purpose,
    epoch, ...), so a snapshot's passive sample never repeats another's."""
    n = -(-n_tokens // seq_len)
    offsets = torch.randint(0, len(tokens) - seq_len + 1, (n,), generator=seeded_generator(*seed))
    idx = offsets.numpy()[:, None] + np.arange(seq_len)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def take_snapshot(stages: list[nn.Module], epoch: int, step: int, passive: Tensor,
                  probe: Tensor) -> Snapshot:
    """A copy of ``stages`` (replica 0, in order) and their traffic on the two sets of windows."""
    was = [m.training for m in stages]
    for m in stages:
        m.eval()
    try:
        states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in stages]
        return Snapshot(epoch, step, stages[0].cfg, states, boundary_traffic(stages, passive),
                        boundary_traffic(stages, probe))
    finally:
        for m, mode in zip(stages, was, strict=True):
            m.train(mode)


def snapshot_path(folder: Path, epoch: int, step: int) -> Path:
    return Path(folder) / f"epoch-{epoch:04d}-step-{step:06d}.pt"


def write_snapshot(folder: Path, snap: Snapshot) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return save_state(snapshot_path(folder, snap.epoch, snap.step), snap.to_dict())


def list_snapshots(folder: Path) -> list[tuple[int, int, Path]]:
    """(epoch, step, path) of every snapshot file in ``folder``, oldest first."""
    found = []
    for path in Path(folder).glob("epoch-*-step-*.pt"):
        _, epoch, _, step = path.stem.split("-")
        found.append((int(epoch), int(step), path))
    return sorted(found)


def prune_snapshots(folder: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` snapshot files."""
    for _, _, path in list_snapshots(folder)[:-keep or None]:
        path.unlink()


def load_snapshot(path: Path) -> Snapshot:
    """A snapshot file, read without pickle (meshlearn/statefile.py: the run folder may be someone
    else's); CheckpointError, one line, for anything else."""
    return Snapshot.from_dict(load_state(path, device="cpu"))
