"""Locked blocks: which ones, in which unlock groups, and how a block is locked and unlocked.

A locked pre-norm block has every weight matrix at zero (its norm gains keep their values), so both
branches add exactly 0 and the block is the identity with Jacobian I. It is then also skipped
(``Block.locked``): skipping gives the same output bitwise and costs no compute. Its parameters sit
outside the optimizer (no state, no weight decay, no gradient, nothing to all-reduce).

Unlocking must break the symmetry: from all zeros, the attention output and every weight gradient of
the block are exactly 0 (silu(0)·0 = 0 in the MLP) and Adam's update of a zero gradient is 0, so the
block never trains (``literal_zero``, kept for the negative test). The default keeps the output
projections W_o, W_down at 0 — the function and the Jacobian are unchanged at the unlock — and draws
the input side (q, k, v, gate, up) from the model's init scaled by 0.1, so ∂L/∂W_o ≠ 0 at once and
the Jacobian grows smoothly.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlearn.models.llama import Block, Decoder, DecoderConfig
from meshlearn.models.split import stage_layer_ranges
from meshlearn.optim.param_sets import add_parameters, remove_parameters

OUTPUT_PROJECTIONS = ("attn.o.weight", "mlp.down.weight")
"""A block's residual writers: kept at zero by the ``zero_out_*`` unlocks."""


def locked_layers(n_layer: int, stages: int, fraction: float, placement: str) -> list[int]:
    """The blocks locked at the start, ascending. ``interleaved``: in each stage of
    ``n_layer / stages`` blocks, round(fraction · per_stage) blocks spread evenly with the stage's
    first block kept (fraction 0.5: positions 1, 3, 5, ...). ``top``: the top
    round(fraction · n_layer) blocks of the network."""
    if placement == "top":
        k = round(fraction * n_layer)
        return list(range(n_layer - k, n_layer))
    if placement != "interleaved":
        raise ValueError(f"placement {placement!r}: allowed 'interleaved', 'top'")
    locked = []
    for layers in stage_layer_ranges(n_layer, stages):
        per_stage = len(layers)
        k = min(round(fraction * per_stage), per_stage - 1)
        locked += [layers[int((i + 0.5) * per_stage / k)] for i in range(k)] if k else []
    return sorted(locked)


def unlock_groups(locked: list[int], groups: int, order: str, n_layer: int, stages: int) -> list[list[int]]:
    """Split the locked blocks into ``groups`` unlock groups (sizes differ by at most one, larger
    first). ``bottom_up``: consecutive blocks from the bottom; ``across_stages``: round-robin over
    the stages (the i-th locked block of every stage before the (i+1)-th of any), so each unlock
    deepens the stages evenly."""
    if order == "across_stages":
        per_stage = n_layer // stages
        by_stage = [[b for b in sorted(locked) if b // per_stage == s] for s in range(stages)]
        depth = max(len(col) for col in by_stage)
        locked = [col[i] for i in range(depth) for col in by_stage if i < len(col)]
    elif order != "bottom_up":
        raise ValueError(f"order {order!r}: allowed 'bottom_up', 'across_stages'")
    else:
        locked = sorted(locked)
    size, extra = divmod(len(locked), groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(locked[start:end])
        start = end
    return [g for g in out if g]


def lock_block(block: Block) -> list[nn.Parameter]:
    """Zero the block's matrices (gains keep their values), freeze all its parameters and skip it.
    Returns its parameters (to take out of the optimizer)."""
    params = list(block.parameters())
    with torch.no_grad():
        for p in params:
            if p.dim() >= 2:
                p.zero_()
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    block.locked = True
    return params


@torch.no_grad()
def init_unlocked(block: Block, cfg: DecoderConfig, how: str, scale: float,
                  generator: torch.Generator) -> None:
    """The symmetry-breaking initialisation of a block about to be unlocked (see the module
    docstring). Draws from ``generator`` only, so every replica of the stage draws the same values
    and the global random stream is untouched."""
    if how == "literal_zero":
        return
    factor = {"zero_out_small_in": scale, "zero_out_std_in": 1.0}[how]
    for name, p in block.named_parameters():
        if p.dim() < 2 or name in OUTPUT_PROJECTIONS:
            continue  # gains keep their values; residual writers stay exactly 0
        p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)
                * (cfg.init_std * factor))


def unlock_block(block: Block) -> None:
    """Let the block compute and train again (its parameters then need an optimizer)."""
    for p in block.parameters():
        p.requires_grad_(True)
    block.locked = False


def unlock_generator(seed: int, layer: int) -> torch.Generator:
    """The unlock init's random stream of one block: a function of (run seed, layer) alone."""
    return torch.Generator().manual_seed((seed * 1_000_003 + 7919 * (layer + 1)) & 0xFFFF_FFFF_FFFF)


class BlockLocks:
    """The locked blocks of one stage module and its optimizer."""

    def __init__(self, module: Decoder, optimizer: torch.optim.Optimizer):
        self.module = module
        self.optimizer = optimizer

    def held(self, layers: list[int]) -> list[int]:
        return [i for i in layers if str(i) in self.module.layers]

    def lock(self, layers: list[int]) -> list[int]:
        """Lock the blocks of ``layers`` this stage holds; returns them."""
        mine = self.held(layers)
        for i in mine:
            params = lock_block(self.module.layers[str(i)])
            remove_parameters(self.optimizer, params)
        return mine

    def unlock(self, layers: list[int], how: str, scale: float, seed: int) -> list[dict]:
        """Initialise, unlock and hand to the optimizer (fresh state) the blocks of ``layers`` this
        stage holds; returns the optimizer groups added."""
        cfg = self.module.cfg
        named = []
        for i in self.held(layers):
            block = self.module.layers[str(i)]
            init_unlocked(block, cfg, how, scale, unlock_generator(seed, i))
            unlock_block(block)
            named += [(f"layers.{i}.{n}", p) for n, p in block.named_parameters()]
        return add_parameters(self.optimizer, named) if named else []

    @property
    def active_layers(self) -> int:
        return sum(1 for block in self.module.layers.values() if not block.locked)
