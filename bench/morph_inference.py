"""Inference under morphs on a pretrained model: SmolLM2-135M served as a protocol-model pipeline
whose stages morph every N generated tokens writes the text the plain model writes (greedy).

For each prompt and morph kind, three generations of the same tokens: the plain decoder, the
protocol pipeline without morphs (``none``) and with them; every token's logits are compared with
the plain model's. Cost, side by side: generation seconds per token without morphs' own time, the
seconds and bytes of each morph (fp64 transforms across the pipeline boundaries), and the memory
the protocol model and its fp64 masters add.

    flock /tmp/meshlearn-bench.lock python bench/morph_inference.py     # → docs/results/morph_inference.*
    meshlearn sample smollm2-135m --prompt "The capital of France is" --tokens 48 --greedy \\
        --morph orthogonal --stages 5 --morph-every-tokens 8              # the same check, one prompt
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from common import markdown_table, write_results

from meshlearn.data import BPETokenizer
from meshlearn.models.llama import KVCache, generate_tokens
from meshlearn.models.pretrained import find_source, load_model
from meshlearn.protocol.inference import MorphingPipeline, untied

PROMPTS = ("The capital of France is", "To be, or not to be, that is the question:")


def plain_generation(model, ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    cache, seen = [KVCache()], []

    def forward(x, restart):
        if restart:
            cache[0] = KVCache()
        return model(x, cache[0])

    started = time.perf_counter()
    with torch.no_grad():
        out = generate_tokens(forward, model.cfg.seq_len, ids, tokens, greedy=True,
                              after_token=lambda n, logits: seen.append(logits.clone()))
    return out, seen, time.perf_counter() - started


def pipeline_generation(pipe: MorphingPipeline, ids: torch.Tensor, tokens: int):
    seen = []
    before = pipe.counters.wall_s
    started = time.perf_counter()
    out = pipe.generate(ids, tokens, greedy=True, on_logits=lambda n, logits: seen.append(logits.clone()))
    total = time.perf_counter() - started
    return out, seen, total - (pipe.counters.wall_s - before)  # generation without the morphs' own time


def worst(seen, ref) -> tuple[float, float]:
    """(max |Δ logit|, that relative to max |logit|) over every generated token."""
    diff = max(float((a - b).abs().max()) for a, b in zip(seen, ref, strict=True))
    return diff, diff / max(float(b.abs().max()) for b in ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="smollm2-135m", help="any model.init value")
    parser.add_argument("--stages", type=int, default=5, help="pipeline stages (divide the layers)")
    parser.add_argument("--every", type=int, default=8, help="generated tokens between morphs")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--kinds", default="orthogonal,lowcond", help="morph kinds (lowcond: ε 0.01)")
    parser.add_argument("--name", default="morph_inference")
    args = parser.parse_args()
    torch.set_num_threads(1)

    source = find_source(args.init)
    tokenizer = BPETokenizer(source.tokenizer())
    plain = untied(load_model(source))
    params_mb = sum(p.numel() * p.element_size() for p in plain.parameters()) / 1e6
    rows = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        ref, ref_seen, plain_s = plain_generation(plain, ids, args.tokens)
        text = tokenizer.decode(ref[0, ids.shape[1]:].tolist())
        for kind in ["none", *args.kinds.split(",")]:
            pipe = MorphingPipeline(plain, args.stages, kind, args.every, epsilon=0.01, seed=0)
            out, seen, gen_s = pipeline_generation(pipe, ids, args.tokens)
            c = pipe.counters
            abs_diff, rel_diff = worst(seen, ref_seen)
            basis_mb = sum(b.numel() * b.element_size() for s in pipe.stages for n, b in s.named_buffers()
                           if n.endswith(("basis", "_skip"))) / 1e6
            rows.append({
                "prompt": prompt, "morph": kind, "stages": args.stages, "every_tokens": args.every,
                "tokens": args.tokens, "same_text": bool(torch.equal(out, ref)),
                "text": tokenizer.decode(out[0, ids.shape[1]:].tolist()), "plain_text": text,
                "max_abs_logit_diff": abs_diff, "max_rel_logit_diff": rel_diff,
                "plain_s_per_token": plain_s / args.tokens, "pipeline_s_per_token": gen_s / args.tokens,
                "morphs": c.morphs, "s_per_morph": c.wall_s / c.morphs if c.morphs else None,
                "kb_per_morph": c.boundary_bytes / c.morphs / 1e3 if c.morphs else None,
                "transforms_per_morph": c.transforms // c.morphs if c.morphs else None,
                "basis_mb": basis_mb, "master_mb": pipe.master_bytes() / 1e6, "params_mb": params_mb,
            })
            print(rows[-1], flush=True)
            del pipe
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    columns = [("prompt", "prompt", ""), ("morph", "morph", ""), ("morphs", "morphs", "d"),
               ("same_text", "same text", ""), ("max_abs_logit_diff", "max Δ logit", ".2e"),
               ("max_rel_logit_diff", "relative", ".2e"), ("plain_s_per_token", "plain s/token", ".3f"),
               ("pipeline_s_per_token", "pipeline s/token", ".3f"), ("per_morph", "s / morph", ""),
               ("kb", "kB / morph", ""), ("basis_mb", "basis MB", ".0f"),
               ("master_mb", "fp64 master MB", ".0f")]
    table = [r | {"per_morph": "–" if r["s_per_morph"] is None else f"{r['s_per_morph']:.2f}",
                  "kb": "–" if r["kb_per_morph"] is None else f"{r['kb_per_morph']:.0f}"} for r in rows]
    texts = "\n".join(f"- {r['morph']}, “{r['prompt']}” → “{r['text'].strip()}”" for r in rows)
    markdown = (f"# Inference under morphs: {args.init}, {args.stages} stages, a morph every {args.every} "
                f"tokens, {args.tokens} greedy tokens\n\n"
                f"`python bench/morph_inference.py` (one thread; model parameters {params_mb:.0f} MB fp32; "
                f"peak RSS of the whole bench {peak_mb:.0f} MB). Logit differences are against the plain "
                f"decoder, over every generated token; s/token excludes the morphs' own time.\n\n"
                + markdown_table(table, columns) + "\n\nTexts:\n\n" + texts + "\n")
    write_results(args.name, {"args": vars(args), "peak_rss_mb": peak_mb, "rows": rows}, markdown)


if __name__ == "__main__":
    main()
