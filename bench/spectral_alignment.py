"""Why the spectral correction makes the masked SmolLM2-135M rows worse: one step, measured (issue 12).

``bench/adaptation_smollm2.py`` measured M95 + anchor (α 0.3, τ 1e-3 absolute) 0.08 nats *worse*
than M95 alone. Full rows cost 6–8 min each; this script looks at one step instead, at the bench's
shape (P = 6: boundaries after layers 4, 9, 14, 19, 24; D = 2 replicas × M = 2 microbatches of one
64-token sequence; the fixed mask with the codec's keys, bf16 on the wire both ways), on the
replicas' own shares (the filter runs on each replica's local gradient under DiLoCo, mode B).

For each state of the weights — ``start`` (the pretrained model) and ``drifted`` (after
``--drift-steps`` masked AdamW steps, what the fast circuit holds when the first anchor share
arrives at step K) — and each measured share (training batch ``--eval-step``, replica r < ``--shares``):

- g_d: the dense gradient of the replica's share, g_m: its masked gradient (M95, M90), over the
  targeted matrices (q, k, v, o, gate, up, down of all 30 blocks);
- three anchor bases: ``stale``, the SVD of the dense gradient of batch 0's replica-0 share on the
  start weights (what the run installs first: the pass handed step 0's ids, used from step K);
  ``stale r64``, its top-64 factors in bf16, re-orthonormalized (the default ``anchor.send =
  factors``); ``fresh``, the mean dense gradient of batches 0..3 (all 4 sequences) on the current
  weights (a cleaner, current basis: is it staleness or noise?);
- candidates G = α·g_m + (1 − α)·filt(g_m) for α ∈ {0, 0.3, 0.7}, τ absolute {1e-4, 1e-3, 1e-2} and
  relative {0.01, 0.1}, and the raw g_m (α = 1);
- per candidate: cos(G, g_d) (all targets, and per matrix kind), ‖G‖ ÷ ‖g_m‖ and
  ‖G − g_m‖ ÷ ‖g_m‖; the AdamW step u it produces (β = 0.9, 0.95, ε = 1e-8: at ``start`` the
  first step, u = G/(|G| + ε), sign-like; at ``drifted`` the next step from the drift's moments,
  momentum included) and cos(u, g_d); the first-order predicted change −lr·⟨g, u⟩ of the dense and
  of the masked loss of the share; and the *actual* losses after θ − lr·u on the targets (dense on
  the share, dense on a held-out validation batch, masked on the share).

Also per basis: how much of g_d and g_m lies in the basis's span (‖UᵀGV‖² ÷ ‖G‖²), and how many
singular values pass each τ (d = s/(s + τ) > 0.5).

    flock /tmp/meshlearn-bench.lock env PYTHONPATH=src OMP_NUM_THREADS=1 python bench/spectral_alignment.py
    PYTHONPATH=src python bench/spectral_alignment.py --no-run     # the Markdown again, from the JSON

Writes docs/results/spectral_alignment.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from common import RESULTS, markdown_table, write_results

from meshlearn.anchor.factors import basis_on_wire
from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.mask import MaskCodec
from meshlearn.config import load_config
from meshlearn.data import global_batch
from meshlearn.data.batches import validation_batches
from meshlearn.data.corpus import load_corpus
from meshlearn.models.llama import Decoder
from meshlearn.models.pretrained import find_source, load_model
from meshlearn.models.split import stage_layer_ranges
from meshlearn.optim.factory import ADAMW_BETAS, decay_groups
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.optim.spectral import TARGETS, AnchorBasis, SpectralConfig, effective_tau, filter_gradient

KEEPS = {"M95": 0.05, "M90": 0.1}
ALPHAS = (0.0, 0.3, 0.7)
TAUS = (("absolute", 1e-4), ("absolute", 1e-3), ("absolute", 1e-2), ("relative", 0.01), ("relative", 0.1))
EPS = 1e-8
STARTED = time.perf_counter()
Grads = dict[str, torch.Tensor]


class Boundary(torch.autograd.Function):
    """What crosses a fast-circuit boundary: h ⊙ m forward and g ⊙ m backward, each rounded to
    the bf16 wire (the codec's default), as the split pipeline computes them."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        return (h * mask).to(torch.bfloat16).to(h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return (grad * mask).to(torch.bfloat16).to(grad.dtype), None


@dataclass
class Bench:
    """The model, its targeted matrices, the boundaries and the data of the SmolLM2 row shape."""

    model: Decoder
    targets: dict[str, torch.nn.Parameter]
    ends: list[int]
    train: object
    val: tuple[torch.Tensor, torch.Tensor]
    args: argparse.Namespace

    def batch(self, step: int, replica: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s global batch, or replica ``replica``'s share of it."""
        x, y = global_batch(self.train, step, self.args.batch_size, self.args.seq_len, self.args.seed)
        if replica is None:
            return x, y
        rows = self.args.batch_size // self.args.replicas
        return x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]

    def masks(self, codec: MaskCodec, step: int, replica: int | None = None) -> list[torch.Tensor]:
        """Per boundary, the masks of the batch's rows as the fast circuit draws them: one per
        (replica, microbatch) with its context (rows in replica-major, microbatch-minor order)."""
        a = self.args
        rows = a.batch_size // (a.replicas * a.microbatches)
        replicas = range(a.replicas) if replica is None else [replica]
        return [torch.cat([codec.mask((rows, a.seq_len, codec.d_model), MessageContext(step, m, b, r)).float()
                           for r in replicas for m in range(a.microbatches)]) for b in range(len(self.ends))]

    def loss(self, x, y, masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        handles = [self.model.layers[str(layer)].register_forward_hook(
            lambda _m, _a, out, mask=mask: Boundary.apply(out, mask))
            for layer, mask in zip(self.ends, masks or [], strict=False)]
        try:
            return Decoder.loss(self.model(x), y)
        finally:
            for handle in handles:
                handle.remove()

    def gradient(self, x, y, masks: list[torch.Tensor] | None = None) -> tuple[Grads, float]:
        """The targeted matrices' gradients (every parameter's .grad is left set) and the loss."""
        self.model.zero_grad(set_to_none=True)
        loss = self.loss(x, y, masks)
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in self.targets.items()}, loss.item()

    @torch.no_grad()
    def value(self, x, y, masks: list[torch.Tensor] | None = None) -> float:
        return self.loss(x, y, masks).item()


def setup(args) -> Bench:
    cfg = load_config(None, ["model.init=smollm2-135m", "model.tie_embeddings=false",
                             "data.corpus=shakespeare", f"model.seq_len={args.seq_len}",
                             f"train.batch_size={args.batch_size}", f"mesh.stages={args.stages}",
                             f"mesh.replicas={args.replicas}", f"mesh.microbatches={args.microbatches}",
                             f"seed={args.seed}"])
    corpus = load_corpus(cfg, None)
    model = load_model(find_source(cfg.model.init), seq_len=args.seq_len, tie_embeddings=False).train()
    targets = {n: p for n, p in model.named_parameters()
               if p.ndim == 2 and n.startswith("layers.") and n.split(".")[-2] in TARGETS}
    ends = [r[-1] for r in stage_layer_ranges(cfg.model.n_layer, args.stages)[:-1]]
    val = validation_batches(corpus.splits.val, 1, args.batch_size, args.seq_len)[0]
    return Bench(model, targets, ends, corpus.splits.train, val, args)


# --- anchor bases and candidates -----------------------------------------------------------


def bases_of(grads: Grads) -> dict[str, AnchorBasis]:
    """Thin SVDs of an anchor EMA (as ``anchor.send = gradients`` installs them)."""
    return {name: AnchorBasis.of(g) for name, g in grads.items()}


def factors_of(bases: dict[str, AnchorBasis], rank: int) -> dict[str, AnchorBasis]:
    """Their top-r factors as a fast worker installs them (``anchor.send = factors``: bf16 on the
    wire, re-orthonormalized)."""
    return {name: basis_on_wire(b.top(rank), torch.bfloat16).orthonormalized() for name, b in bases.items()}


def candidates(g_m: Grads, bases: dict[str, AnchorBasis]) -> Iterator[tuple[float, str, float, Grads]]:
    """(α, τ mode, τ, α·g_m + (1 − α)·filt(g_m)) for every setting of the grid (one filter per τ)."""
    for mode, tau in TAUS:
        cfg = SpectralConfig(tau=tau, tau_mode=mode)
        filtered = {n: filter_gradient(g, bases[n], effective_tau(cfg, bases[n])) for n, g in g_m.items()}
        for alpha in ALPHAS:
            yield alpha, mode, tau, {n: torch.lerp(f, g_m[n], alpha) for n, f in filtered.items()}


def kind(name: str) -> str:
    return name.split(".")[-2]


def basis_stats(bases: dict[str, AnchorBasis], g_d: Grads, g_m: Grads) -> dict:
    """Share of ‖g_d‖² and ‖g_m‖² inside the basis's span, and of the singular values passing τ."""
    inside = defaultdict(float)
    passing = defaultdict(float)
    total = 0
    for name, b in bases.items():
        for label, g in (("g_d", g_d[name]), ("g_m", g_m[name])):
            core = b.u.T @ g @ b.vh.T
            inside[label] += float(core.square().sum())
            inside[label + "_total"] += float(g.square().sum())
        total += b.s.numel()
        for mode, tau in TAUS:
            t = effective_tau(SpectralConfig(tau=tau, tau_mode=mode), b)
            passing[f"{mode} {tau:g}"] += int((b.s > t).sum())  # d = s/(s + τ) > 0.5
    return {"energy_g_d": inside["g_d"] / inside["g_d_total"],
            "energy_g_m": inside["g_m"] / inside["g_m_total"],
            "directions": total, "pass_tau": {k: v / total for k, v in passing.items()},
            "s_max_median": float(torch.tensor([float(b.s[0]) for b in bases.values()]).median())}


# --- one candidate's measures --------------------------------------------------------------


def adam_step(g: torch.Tensor, state: dict | None) -> torch.Tensor:
    """The AdamW direction (lr 1, no decay) of the next step fed ``g``, from ``state``'s moments."""
    b1, b2 = ADAMW_BETAS
    if state is None:
        return g / (g.abs() + EPS)  # first step: m̂ = g, v̂ = g²
    k = state["step"] + 1
    m = state["exp_avg"] * b1 + g * (1 - b1)
    v = state["exp_avg_sq"] * b2 + g.square() * (1 - b2)
    return (m / (1 - b1**k)) / ((v / (1 - b2**k)).sqrt() + EPS)


def cosine(dots: dict[str, float], kind_: str, what: str) -> float:
    """cos(``what``, g_d) over the matrices of one kind, from the accumulated dot products."""
    norms = dots[f"{kind_}|{what}.{what}"] * dots[f"{kind_}|gd.gd"]
    return dots[f"{kind_}|{what}.gd"] / max(norms, 1e-300) ** 0.5


class Item:
    """One (weights, batch share) point: its dense and masked gradients and the references."""

    def __init__(self, bench: Bench, step: int, replica: int, codec: MaskCodec, lr: float,
                 adam: dict[str, dict] | None):
        self.bench, self.lr, self.adam = bench, lr, adam
        self.x, self.y = bench.batch(step, replica)
        self.masks = bench.masks(codec, step, replica)
        self.g_d, self.dense_loss = bench.gradient(self.x, self.y)
        self.g_m, self.masked_loss = bench.gradient(self.x, self.y, self.masks)
        self.val_loss = bench.value(*bench.val)
        self.origin = {n: p.detach().clone() for n, p in bench.targets.items()}

    def measure(self, g: Grads) -> dict:
        dots = defaultdict(float)
        steps = {}
        for name, grad in g.items():
            k = kind(name)
            gd, gm = self.g_d[name], self.g_m[name]
            u = steps[name] = adam_step(grad, None if self.adam is None else self.adam[name])
            dg = grad - gm
            for key, a, b in (("g.gd", grad, gd), ("g.g", grad, grad), ("gd.gd", gd, gd), ("gm.gm", gm, gm),
                              ("dg.dg", dg, dg), ("u.gd", u, gd), ("u.u", u, u), ("u.gm", u, gm)):
                value = float((a * b).sum())
                dots[key] += value
                dots[f"{k}|{key}"] += value
        out = {"cos": dots["g.gd"] / (dots["g.g"] * dots["gd.gd"]) ** 0.5,
               "norm_ratio": (dots["g.g"] / dots["gm.gm"]) ** 0.5,
               "rel_change": (dots["dg.dg"] / dots["gm.gm"]) ** 0.5,
               "cos_adam": dots["u.gd"] / (dots["u.u"] * dots["gd.gd"]) ** 0.5,
               "pred_dense": -self.lr * dots["u.gd"], "pred_masked": -self.lr * dots["u.gm"],
               "cos_by_kind": {k: cosine(dots, k, "g") for k in TARGETS},
               "cos_adam_by_kind": {k: cosine(dots, k, "u") for k in TARGETS}}
        return out | self.after_step(steps)

    @torch.no_grad()
    def after_step(self, steps: Grads) -> dict:
        """The actual losses after θ − lr·u on the targets (the other parameters unchanged)."""
        for name, p in self.bench.targets.items():
            p.copy_(self.origin[name] - self.lr * steps[name])
        out = {"dense_after": self.bench.value(self.x, self.y) - self.dense_loss,
               "val_after": self.bench.value(*self.bench.val) - self.val_loss,
               "masked_after": self.bench.value(self.x, self.y, self.masks) - self.masked_loss}
        for name, p in self.bench.targets.items():
            p.copy_(self.origin[name])
        return out


# --- the states ------------------------------------------------------------------------------


def drift(bench: Bench, codec: MaskCodec, steps: int) -> dict[str, dict] | None:
    """``steps`` masked AdamW steps from the current weights (the whole model, clip 1.0, the row's
    warm-up and cosine lr), as the fast circuit runs before the first anchor share arrives; returns
    the targets' AdamW moments (None for zero steps)."""
    if steps == 0:
        return None
    a = bench.args
    opt = torch.optim.AdamW(decay_groups(bench.model, 0.1), lr=a.lr, betas=ADAMW_BETAS, eps=EPS,
                            foreach=False)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = a.lr * lr_factor(step, max(1, a.run_steps // 10), a.run_steps, 0.1)
        bench.gradient(*bench.batch(step), bench.masks(codec, step))
        torch.nn.utils.clip_grad_norm_(bench.model.parameters(), 1.0)
        opt.step()
    state = {n: {"step": int(opt.state[p]["step"]), "exp_avg": opt.state[p]["exp_avg"].clone(),
                 "exp_avg_sq": opt.state[p]["exp_avg_sq"].clone()} for n, p in bench.targets.items()}
    bench.model.zero_grad(set_to_none=True)
    return state


def fresh_bases(bench: Bench) -> dict[str, AnchorBasis]:
    """The basis of the mean dense gradient of batches 0..n−1 on the current weights."""
    mean: Grads = {}
    for step in range(bench.args.anchor_batches):
        g, _ = bench.gradient(*bench.batch(step))
        mean = {n: mean.get(n, 0) + v / bench.args.anchor_batches for n, v in g.items()}
    return bases_of(mean)


def run_state(bench: Bench, label: str, keep_name: str, all_bases: dict[str, dict[str, AnchorBasis]],
              adam: dict | None) -> tuple[list[dict], list[dict]]:
    """Every candidate's measures on the measured replicas' shares at the current weights, and the
    bases' statistics."""
    a = bench.args
    codec = MaskCodec(bench.model.cfg.d_model, KEEPS[keep_name], seed=a.codec_seed)
    lr = a.lr * lr_factor(a.eval_step, max(1, a.run_steps // 10), a.run_steps, 0.1)
    rows, stats = [], []
    for replica in range(a.shares):
        item = Item(bench, a.eval_step, replica, codec, lr, adam)
        where = {"state": label, "keep": keep_name, "replica": replica, "lr": lr,
                 "dense_loss": item.dense_loss, "masked_loss": item.masked_loss}
        raw = item.measure(item.g_m)
        rows.append(where | {"basis": "—", "alpha": 1.0, "tau_mode": "—", "tau": 0.0} | raw)
        rows.append(where | {"basis": "dense g_d (reference)", "alpha": 1.0, "tau_mode": "—", "tau": 0.0}
                    | item.measure(item.g_d))
        for basis_name, bases in all_bases.items():
            stats.append({"state": label, "keep": keep_name, "replica": replica, "basis": basis_name}
                         | basis_stats(bases, item.g_d, item.g_m))
            for alpha, mode, tau, g in candidates(item.g_m, bases):
                rows.append(where | {"basis": basis_name, "alpha": alpha, "tau_mode": mode, "tau": tau}
                            | item.measure(g))
        print(f"{label} {keep_name} replica {replica}: dense {item.dense_loss:.3f} masked "
              f"{item.masked_loss:.3f}, raw cos {raw['cos']:+.4f}, AdamW cos {raw['cos_adam']:+.4f}, "
              f"{time.perf_counter() - STARTED:.0f} s", flush=True)
    return rows, stats


# --- the report ------------------------------------------------------------------------------


def averaged(rows: list[dict]) -> list[dict]:
    """The replicas' rows averaged per (state, keep, basis, α, τ)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["state"], r["keep"], r["basis"], r["alpha"], r["tau_mode"], r["tau"])].append(r)
    out = []
    for (state, keep, basis, alpha, mode, tau), rs in groups.items():
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in
                ("cos", "norm_ratio", "rel_change", "cos_adam", "pred_dense", "pred_masked", "dense_after",
                 "val_after", "masked_after", "dense_loss", "masked_loss")}
        setting = "raw g_m (α = 1)" if basis == "—" else (basis if alpha == 1.0 else
                                                           f"{basis}, α {alpha:g}, τ {tau:g} {mode[:3]}")
        out.append({"state": state, "keep": keep, "basis": basis, "alpha": alpha, "tau_mode": mode,
                    "tau": tau, "setting": setting} | mean)
    return out


COLUMNS = [("state", "weights", ""), ("keep", "mask", ""), ("setting", "update", ""),
           ("cos", "cos(G, g_d)", "+.4f"), ("norm_ratio", "‖G‖÷‖g_m‖", ".3f"),
           ("rel_change", "‖G−g_m‖÷‖g_m‖", ".3f"), ("cos_adam", "cos(AdamW step, g_d)", "+.4f"),
           ("pred_dense", "pred. Δ dense", "+.4f"), ("dense_after", "Δ dense (share)", "+.4f"),
           ("val_after", "Δ dense (val batch)", "+.4f"), ("pred_masked", "pred. Δ masked", "+.3f"),
           ("masked_after", "Δ masked (share)", "+.3f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--run-steps", type=int, default=20, help="the row's train.steps (its lr schedule)")
    parser.add_argument("--drift-steps", type=int, default=4, help="masked steps before 'drifted' (= K)")
    parser.add_argument("--eval-step", type=int, default=4, help="the training batch measured")
    parser.add_argument("--anchor-batches", type=int, default=4, help="batches of the 'fresh' basis")
    parser.add_argument("--keeps", default="M95,M90")
    parser.add_argument("--shares", type=int, default=1, help="replicas' shares measured (averaged)")
    parser.add_argument("--rank", type=int, default=64, help="anchor.rank of the factors basis")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codec-seed", type=int, default=0)
    parser.add_argument("--no-run", action="store_true",
                        help="measure nothing: rewrite the Markdown from the stored JSON")
    args = parser.parse_args()
    if args.no_run:
        payload = json.loads((RESULTS / "spectral_alignment.json").read_text())
        write_results("spectral_alignment", payload, report(payload))
        return
    torch.manual_seed(args.seed)
    bench = setup(args)
    start = {n: p.detach().clone() for n, p in bench.model.state_dict().items()}
    # The first anchor share: batch 0's replica-0 share, dense, on the start weights.
    g0, _ = bench.gradient(*bench.batch(0, replica=0))
    stale = bases_of(g0)
    anchor = {"stale": stale, "stale r64": factors_of(stale, args.rank), "fresh": fresh_bases(bench)}
    del g0
    rows, stats = [], []
    for label, steps in (("start", 0), (f"after {args.drift_steps} masked steps", args.drift_steps)):
        for keep_name in args.keeps.split(","):
            codec = MaskCodec(bench.model.cfg.d_model, KEEPS[keep_name], seed=args.codec_seed)
            bench.model.load_state_dict(start)
            adam = drift(bench, codec, steps)
            if steps:
                anchor["fresh"] = None  # free it before the next one
                anchor["fresh"] = fresh_bases(bench)
            state_rows, state_stats = run_state(bench, label, keep_name, anchor, adam)
            rows, stats = rows + state_rows, stats + state_stats
    payload = {"args": vars(args), "boundaries_after_layers": bench.ends, "rows": averaged(rows),
               "bases": stats, "per_replica": rows, "wall_s": time.perf_counter() - STARTED}
    write_results("spectral_alignment", payload, report(payload))


SHOWN = {(0.3, "absolute", 1e-3), (0.0, "absolute", 1e-3), (0.3, "absolute", 1e-4), (0.7, "relative", 0.01),
         (0.3, "relative", 0.1), (0.0, "relative", 0.1)}
"""The grid settings the Markdown shows: the run's default (α 0.3, τ 1e-3 absolute) and its neighbours."""
BY_KIND = {("—", 1.0, "—", 0.0), ("stale r64", 0.3, "absolute", 1e-3), ("stale r64", 0.0, "relative", 0.1)}
"""Rows whose cosines the Markdown splits by matrix kind: raw, the run's default, the strongest filter."""


def report(payload: dict) -> str:
    """The Markdown of a run's (or a stored run's) measures."""
    args, table = payload["args"], payload["rows"]
    shown = [r for r in table if r["basis"] in ("—", "dense g_d (reference)")
             or (r["alpha"], r["tau_mode"], r["tau"]) in SHOWN]
    kinds = [r | {f"cos {k}": r["cos_by_kind"][k] for k in TARGETS}
             | {f"adam {k}": r["cos_adam_by_kind"][k] for k in TARGETS}
             for r in payload["per_replica"] if (r["basis"], r["alpha"], r["tau_mode"], r["tau"]) in BY_KIND]
    return "\n".join([
        "# Spectral correction on SmolLM2-135M: one step, measured",
        "",
        f"`python bench/spectral_alignment.py`; {payload['wall_s'] / 60:.1f} min on shared CPU cores. "
        f"P = {args['stages']} (boundaries after layers {payload['boundaries_after_layers']}), "
        f"D = {args['replicas']} × M = {args['microbatches']}, "
        f"{args['batch_size']} × {args['seq_len']} tokens a step; training batch {args['eval_step']}, "
        f"the share of replicas {list(range(args['shares']))} "
        f"(averaged); lr {args['lr']:g} × the row's schedule at step {args['eval_step']}. "
        "G: what the optimizer is fed; the AdamW step: sign-like G/(|G| + ε) at the start weights, the "
        "next step from the drift's moments otherwise; Δ: loss after θ − lr·step on the targeted matrices "
        "minus before (negative = better); pred.: −lr·⟨g, step⟩. The full grid (α × τ × basis) is in the "
        "JSON; shown here: raw, the dense reference, and a few settings.",
        "",
        markdown_table(shown, COLUMNS),
        "",
        "## By matrix kind",
        "",
        "cos(G, g_d) and cos(AdamW step, g_d) over each kind's 30 matrices: raw, the run's default (stale "
        "r64, α 0.3, τ 1e-3 absolute) and the strongest filter (stale r64, α 0, τ 0.1 relative).",
        "",
        markdown_table(kinds, [("state", "weights", ""), ("keep", "mask", ""), ("basis", "basis", ""),
                               ("alpha", "α", "g")] + [(f"cos {k}", f"cos {k}", "+.3f") for k in TARGETS]
                       + [(f"adam {k}", f"AdamW {k}", "+.4f") for k in TARGETS]),
        "",
        "## The bases",
        "",
        "Share of ‖g‖² inside span(U)⊗span(V), and share of singular values with d = s/(s + τ) > 0.5.",
        "",
        markdown_table([s | {f"pass {k}": v for k, v in s["pass_tau"].items()} for s in payload["bases"]],
                       [("state", "weights", ""), ("keep", "mask", ""), ("replica", "replica", "d"),
                        ("basis", "basis", ""), ("energy_g_d", "g_d in span", ".3f"),
                        ("energy_g_m", "g_m in span", ".3f"), ("s_max_median", "median s_max", ".2e")]
                       + [(f"pass {m} {t:g}", f"d>½ at τ {t:g} {m[:3]}", ".3f") for m, t in TAUS]),
    ])


if __name__ == "__main__":
    main()
