"""Is the masked gradient the dense gradient plus zero-mean noise? Measured on the pretrained demo model.

The method note's theory assumes g_mask = ∇F + ε with E[ε] = 0 (the mask depends only on a key, so
the masking noise "has zero mean"), and the spectral correction denoises ε with the anchor's clean
geometry. That holds for E[h ⊙ m] = keep · h, not for the gradient of a nonlinear network whose
boundary activations are masked. This script measures it on the model that ``bench/adaptation.py``
adapts (demo model pretrained densely for 150 steps), on one training batch of 16 × 128 tokens:

- the loss with the mask at every boundary (as the fast circuit trains) against the dense loss;
- the cosine between the gradient of all block matrices under one mask and the dense gradient, and
  between the *mean over ``--masks`` masks* and the dense gradient: if masking were zero-mean noise
  the mean's cosine would approach 1; if it stays where one mask's is, the masked gradient is
  biased (another objective), and no variance filter can repair it;
- the spectral filter (basis: the dense gradient of another batch, as an anchor would send) applied
  to one mask's gradient: the cosine of α·G + (1 − α)·G_filt (α = 0.3) with the dense gradient.

Rows: keep 0.05 / 0.1 / 0.5, rescale off / on, the boundaries of P = 4 (after layers 0, 1, 2) and of
P = 2 (after layer 1).

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/mask_bias.py [--masks 16]

Needs bench/out/adaptation/pretrain (``bench/adaptation.py`` trains it); writes
docs/results/mask_bias.{json,md}.
"""

from __future__ import annotations

import argparse
import time

import torch
from adaptation import OUT as ADAPTATION_OUT
from common import markdown_table, write_results

from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.mask import MaskCodec
from meshlearn.data import global_batch
from meshlearn.data.corpus import load_corpus
from meshlearn.models.llama import Decoder
from meshlearn.optim.spectral import AnchorBasis, filter_gradient
from meshlearn.train.restore import load_run_model

CASES = [(0.05, False, (0, 1, 2)), (0.05, True, (0, 1, 2)), (0.1, False, (0, 1, 2)), (0.1, True, (0, 1, 2)),
         (0.5, False, (0, 1, 2)), (0.05, False, (1,)), (0.05, True, (1,)), (0.5, False, (1,))]
ALPHA = 0.3


def block_matrices(model: Decoder) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]


def gradient(model: Decoder, x, y, codec: MaskCodec | None, key: int, layers: tuple[int, ...]):
    """(per-matrix gradients, loss) with ``codec``'s mask (context step ``key``) after ``layers``."""
    handles = [] if codec is None else [
        model.layers[str(layer)].register_forward_hook(
            lambda _m, _a, out, b=b: out * codec.mask(tuple(out.shape), MessageContext(key, 0, b, 0))
            * codec.scale)
        for b, layer in enumerate(layers)]
    model.zero_grad(set_to_none=True)
    loss = Decoder.loss(model(x), y)
    loss.backward()
    for handle in handles:
        handle.remove()
    return {n: p.grad.detach().clone() for n, p in block_matrices(model)}, loss.item()


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--masks", type=int, default=16)
    args = parser.parse_args()
    started = time.perf_counter()
    model, cfg, _ = load_run_model(ADAPTATION_OUT / "pretrain")
    train = load_corpus(cfg, None).splits.train
    x, y = global_batch(train, 2000, 16, cfg.model.seq_len, 0)
    anchor_x, anchor_y = global_batch(train, 1000, 16, cfg.model.seq_len, 0)
    dense, dense_loss = gradient(model, x, y, None, 0, ())
    anchor, _ = gradient(model, anchor_x, anchor_y, None, 0, ())
    bases = {n: AnchorBasis.of(g) for n, g in anchor.items()}
    table = []
    for keep, rescale, layers in CASES:
        codec = MaskCodec(cfg.model.d_model, keep, rescale=rescale)
        draws = [gradient(model, x, y, codec, k, layers) for k in range(args.masks)]
        ones = [flat(g) for g, _ in draws]
        mean = torch.stack(ones).mean(0)
        first = draws[0][0]
        blended = flat({n: ALPHA * g + (1 - ALPHA) * filter_gradient(g, bases[n], 1e-3)
                        for n, g in first.items()})
        table.append({
            "case": f"keep {keep}, rescale {'on' if rescale else 'off'}, P = {len(layers) + 1}",
            "keep": keep, "rescale": rescale, "boundary_layers": list(layers),
            "dense_loss": dense_loss, "masked_loss": sum(loss for _, loss in draws) / len(draws),
            "cos_one": sum(cosine(g, flat(dense)) for g in ones) / len(ones),
            "cos_mean": cosine(mean, flat(dense)), "norm_ratio": float(mean.norm() / flat(dense).norm()),
            "cos_filtered": cosine(blended, flat(dense)),
        })
        print(table[-1], flush=True)
    columns = [("case", "case", ""), ("dense_loss", "dense loss", ".3f"),
               ("masked_loss", "masked loss", ".3f"),
               ("cos_one", "cos(one mask, dense)", ".3f"),
               ("cos_mean", f"cos(mean of {args.masks} masks, dense)", ".3f"),
               ("norm_ratio", "‖mean‖ ÷ ‖dense‖", ".1f"),
               ("cos_filtered", "cos(α·G + (1−α)·G_filt, dense)", ".3f")]
    wall = time.perf_counter() - started
    markdown = "\n".join([
        "# Is the masked gradient unbiased? (pretrained demo model)",
        "",
        f"`python bench/mask_bias.py --masks {args.masks}`; {wall:.0f} s. One training batch "
        "(16 × 128 byte tokens) of the demo model pretrained densely for 150 steps "
        "(bench/out/adaptation/pretrain); gradients of all block matrices; the filter's basis is the "
        "dense gradient of another batch, τ = 1e-3 absolute, α = 0.3.",
        "",
        markdown_table(table, columns),
    ])
    write_results("mask_bias", {"args": vars(args), "rows": table, "wall_s": wall}, markdown)


if __name__ == "__main__":
    main()
