"""Morphs: fold a fresh transform into both sides of every boundary, on fp64 master copies.

A boundary is any place the residual stream changes hands: embedding → first layer, attention →
MLP inside a layer (T_int), layer → layer (inside a stage, or across a pipeline boundary), last
layer → head. For a transform T at a boundary (row-vector convention of the method note; torch
``Linear`` weights are (out, in), so W·T there is Tᵀ·W here):

| side | what it folds |
|---|---|
| exit of a layer (its output basis B ← B·T) | W_down ← Tᵀ·W_down, S₂ ← S₂·T |
| entry of a layer (its input basis A ← A·T) | R₁ ← T⁻¹·R₁, S₁ ← T⁻¹·S₁ |
| inside a layer (C ← C·T) | W_o ← Tᵀ·W_o, S₁ ← S₁·T, R₂ ← T⁻¹·R₂, S₂ ← T⁻¹·S₂ |
| exit of the embedding | B_emb ← B_emb·T |
| entry of the head | R_f ← T⁻¹·R_f |

Only W_o and W_down among the trainable matrices change; their Muon momentum follows the
gradient's map (G ↦ T⁻¹·G here, G·T^{−T} in the note): M ← T⁻¹·M, which for orthogonal T is the
weight's own map, so Muon on the morphed model is the morphed Muon trajectory. Every other piece
of state kept in a writer's basis follows the same way, by its kind (``meshlearn.basis``): the
worker's DP strategy (PowerSGD error feedback, DiLoCo's outer weights and momentum) and plugins'
state (the curvature tracker's warm-start vectors) are listed to the morph as ``holders``.

Every fold happens on a :class:`MasterCopy` (fp64 by default) and is then cast back into the
working tensors, so the error stays at one rounding of the master however many morphs there are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from meshlearn.basis import BasisTensor
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.protocol.transforms import Transform, draw, seeded_generator

WRITERS = ("attn.o.weight", "mlp.down.weight")
"""The trainable matrices a morph multiplies (each layer's residual writers)."""
BASES = ("emb_basis", ".basis", "_skip")
"""Name endings of the non-trainable basis matrices (B_emb, every R, every S)."""

Holder = Callable[[], Mapping[str, BasisTensor]]
"""Lists some state kept in parameters' bases (called at every morph: tensors may be replaced)."""


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Holder:
    """The optimizer's first moment of every parameter (``momentum_buffer``: Muon, NuMuon), a
    gradient sum. (Morphs refuse optimizers with elementwise second moments.)"""
    def listing() -> dict[str, BasisTensor]:
        out = {}
        for name, p in module.named_parameters():
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            if "momentum_buffer" in state:  # absent before the first optimizer step
                out[name] = BasisTensor(name, "gradient", state["momentum_buffer"])
        return out
    return listing


class MasterCopy:
    """High-precision copies of every tensor a morph multiplies in one stage module: the basis
    buffers, the residual writers and all state kept in a writer's basis (``holders``: the
    optimizer's momentum, the DP strategy's buffers, plugins' vectors).

    ``open`` brings the masters up to date: a tensor seen for the first time is copied; one
    changed since the last ``close`` has that change added (master += working − cast(master)), so
    training between morphs is kept exactly and, without training, the master is untouched.
    ``close`` casts the masters back into the working tensors, in place.
    ``dtype = working dtype`` is folding without a master (the drift control of the tests).
    """

    def __init__(self, module: nn.Module, holders: Mapping[str, Holder],
                 dtype: torch.dtype = torch.float64):
        self.module = module
        self.holders = dict(holders)
        self.dtype = dtype
        self.tensors: dict[str, Tensor] = {}
        self.state_of: dict[str, list[tuple[str, str]]] = {}  # writer → [(master key, kind)]

    def working(self) -> dict[str, Tensor]:
        """Name → the live tensor (parameter data, buffer, state); also fills ``state_of``."""
        out = {name: buf for name, buf in self.module.named_buffers() if name.endswith(BASES)}
        writers = [name for name, _ in self.module.named_parameters() if name.endswith(WRITERS)]
        out |= {name: p.data for name, p in self.module.named_parameters() if name in writers}
        self.state_of = {name: [] for name in writers}
        for holder, listing in self.holders.items():
            for key, state in listing().items():
                if state.param in self.state_of:
                    master_key = f"{state.param}#{holder}:{key}"
                    out[master_key] = state.tensor
                    self.state_of[state.param].append((master_key, state.kind))
        return out

    def open(self) -> dict[str, Tensor]:
        for name, live in self.working().items():
            master = self.tensors.get(name)
            if master is None or master.shape != live.shape:
                self.tensors[name] = live.detach().to(self.dtype, copy=True)
            else:
                master += live.detach().to(self.dtype) - master.to(live.dtype).to(self.dtype)
        return self.tensors

    def close(self) -> None:
        for name, live in self.working().items():
            live.copy_(self.tensors[name])

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.tensors = {name: t.to(self.dtype) for name, t in state.items()}


class StageMorph:
    """The folds of one worker's stage module (see the module docstring's table)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 master_dtype: torch.dtype = torch.float64, holders: Mapping[str, Holder] | None = None):
        self.module = module
        holders = {"optimizer": optimizer_state(module, optimizer), **(holders or {})}
        self.master = MasterCopy(module, holders, master_dtype)
        self.layers = sorted(module.layers, key=int)
        self._m: dict[str, Tensor] = {}

    @property
    def internal_slots(self) -> int:
        """Transforms the stage draws for its own boundaries: one inside each layer, one between
        consecutive layers, one after the embedding and one before the head where held."""
        return (2 * len(self.layers) - 1 + (self.module.tok_emb is not None)
                + (self.module.head is not None))

    def open(self) -> None:
        self._m = self.master.open()

    def close(self) -> None:
        self.master.close()
        self._m = {}

    # --- the folds, on the masters ------------------------------------------------------------

    def _right(self, name: str, t: Tensor) -> None:
        master = self._m[name]
        self._m[name] = master @ t.to(master.dtype)

    def _left(self, name: str, t: Tensor) -> None:
        master = self._m[name]
        self._m[name] = t.to(master.dtype) @ master

    def _writer(self, name: str, t: Transform) -> None:
        """W ← Tᵀ·W; state in W's basis by its kind: weights as W, gradients by T⁻¹ (= Tᵀ when
        orthogonal)."""
        self._left(name, t.matrix.T)
        for key, kind in self.master.state_of[name]:
            self._left(key, t.matrix.T if kind == "weight" else t.inverse)

    def _layer_exit(self, key: str, t: Transform) -> None:
        self._writer(f"layers.{key}.mlp.down.weight", t)
        self._right(f"layers.{key}.mlp_skip", t.matrix)

    def _layer_entry(self, key: str, inverse: Tensor) -> None:
        self._left(f"layers.{key}.attn_norm.basis", inverse)
        self._left(f"layers.{key}.attn_skip", inverse)

    def fold_exit(self, t: Transform) -> None:
        """This stage's exit side of the pipeline boundary below it."""
        self._layer_exit(self.layers[-1], t)

    def fold_entry(self, matrix: Tensor, orthogonal: bool) -> None:
        """This stage's entry side of the pipeline boundary above it, from the T it received (it
        inverts T itself: Tᵀ when orthogonal, else an fp64 inverse)."""
        inverse = matrix.T if orthogonal else torch.linalg.inv(matrix)
        self._layer_entry(self.layers[0], inverse)

    def fold_internal(self, transforms: Iterator[Transform]) -> None:
        """Every boundary inside the stage, in a fixed order (``internal_slots`` transforms)."""
        if self.module.tok_emb is not None:
            t = next(transforms)
            self._right("emb_basis", t.matrix)
            self._layer_entry(self.layers[0], t.inverse)
        for i, key in enumerate(self.layers):
            t = next(transforms)  # T_int between attention and MLP
            self._writer(f"layers.{key}.attn.o.weight", t)
            self._right(f"layers.{key}.attn_skip", t.matrix)
            self._left(f"layers.{key}.mlp_norm.basis", t.inverse)
            self._left(f"layers.{key}.mlp_skip", t.inverse)
            if i + 1 < len(self.layers):
                t = next(transforms)
                self._layer_exit(key, t)
                self._layer_entry(self.layers[i + 1], t.inverse)
        if self.module.head is not None:
            t = next(transforms)
            self._layer_exit(self.layers[-1], t)
            self._left("norm.basis", t.inverse)


@dataclass
class MorphStats:
    transforms: int = 0  # transforms drawn (each one folded on every replica of its stage)
    boundary_bytes: int = 0  # bytes of the transforms sent across pipeline boundaries


Send = Callable[[WorkerId, WorkerId, Transform], tuple[Tensor, bool]]
"""(sender, receiver, T) → what the receiver got: (T, orthogonal). The plugin sends a message."""


def direct(src: WorkerId, dst: WorkerId, t: Transform) -> tuple[Tensor, bool]:
    return t.matrix, t.orthogonal


def stage_transforms(kind: str, d: int, epsilon: float, seed: int, stage: int, epoch: int,
                     slots: int, boundary: bool) -> tuple[list[Transform], Transform | None]:
    """Stage ``stage``'s transforms of epoch ``epoch``: its ``slots`` internal ones, then (with
    ``boundary``) the one of the boundary below it, all from the stage's own generator (``seed``,
    stage, epoch), so every replica of the stage, in any process, draws the same ones."""
    generator = seeded_generator(seed, "protocol-morph", stage, epoch)
    internal = [draw(kind, d, epsilon, generator) for _ in range(slots)]
    return internal, draw(kind, d, epsilon, generator) if boundary else None


def morph_mesh(morphs: dict[WorkerId, StageMorph], mesh: MeshShape, kind: str, epsilon: float,
               seed: int, epoch: int, send: Send = direct,
               boundaries: dict[int, Transform] | None = None) -> MorphStats:
    """One morph epoch over every worker in ``morphs`` (all of them: the simulator). Stage s draws
    its internal transforms and the transform of the boundary below it (``stage_transforms``), so
    all its replicas fold the same ones; each replica of stage s sends its boundary transform to
    the same replica of stage s + 1, which folds the inverse. ``boundaries`` (stage → T): a
    transform the sending stage chose from its own traffic instead (a whitening morph)."""
    stats = MorphStats()
    for morph in morphs.values():
        morph.open()
    for s in range(mesh.stages):
        replicas = [morphs[w] for w in mesh.stage_replicas(s)]
        internal, boundary = stage_transforms(kind, replicas[0].module.cfg.d_model, epsilon, seed, s,
                                              epoch, replicas[0].internal_slots, s + 1 < mesh.stages)
        for morph in replicas:
            morph.fold_internal(iter(internal))
        stats.transforms += len(internal) + (boundary is not None)
        if boundary is None:
            continue
        boundary = (boundaries or {}).get(s, boundary)
        for src in mesh.stage_replicas(s):
            dst = WorkerId(src.replica, s + 1)
            morphs[src].fold_exit(boundary)
            matrix, orthogonal = send(src, dst, boundary)
            stats.boundary_bytes += matrix.numel() * matrix.element_size()
            morphs[dst].fold_entry(matrix, orthogonal)
    for morph in morphs.values():
        morph.close()
    return stats


def morph_worker(morph: StageMorph, me: WorkerId, mesh: MeshShape, kind: str, epsilon: float, seed: int,
                 epoch: int, send: Callable[[WorkerId, WorkerId, Transform], None],
                 receive: Callable[[WorkerId, WorkerId], tuple[Tensor, bool]]) -> MorphStats:
    """One worker's part of a morph epoch, in a process that holds only it (the distributed
    driver): the transforms ``morph_mesh`` draws for its stage, folded in its order (the entry
    side first, so the masters are bitwise the simulator's). The previous stage's boundary
    transform comes in by ``receive(src, me)``; this stage's goes to replica ``me.replica`` of the
    next stage by ``send``. So the stages morph in a chain, and a process draws only its own
    stage's transforms and sees only the one of the boundary above it."""
    stats = MorphStats()
    morph.open()
    if me.stage > 0:
        morph.fold_entry(*receive(WorkerId(me.replica, me.stage - 1), me))
    internal, boundary = stage_transforms(kind, morph.module.cfg.d_model, epsilon, seed, me.stage, epoch,
                                          morph.internal_slots, me.stage + 1 < mesh.stages)
    morph.fold_internal(iter(internal))
    stats.transforms = len(internal) + (boundary is not None)
    if boundary is not None:
        morph.fold_exit(boundary)
        send(me, WorkerId(me.replica, me.stage + 1), boundary)
        stats.boundary_bytes = boundary.matrix.numel() * boundary.matrix.element_size()
    morph.close()
    return stats


def epoch_stats(mesh: MeshShape, stage_layers: list[int], d: int) -> MorphStats:
    """What one epoch over the whole mesh draws and sends (``morph_mesh``'s stats), from the
    shape alone: a process that morphs only its own worker reports the mesh's totals with it."""
    slots = [2 * n - 1 + (s == 0) + (s == mesh.stages - 1) for s, n in enumerate(stage_layers)]
    return MorphStats(sum(slots) + mesh.stages - 1, (mesh.stages - 1) * mesh.replicas * d * d * 8)
