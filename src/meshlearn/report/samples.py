"""Sample generations for the report: the run folder's own ``samples.txt`` if it has one, else a
short unprompted sample from the final checkpoint when the model is small enough to make that cheap
(the report must stay quick to render), else nothing, with the reason.

A generated sample is deterministic (fixed seed and temperature), so two reports of the same run show
the same text; it reads what the checkpoint's replica-0 stages, merged into one model, produce.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.report.records import RunData

SAMPLES_FILE = "samples.txt"  # e.g. written by: meshlearn sample RUN > RUN/samples.txt
MAX_PARAMS = 50_000_000  # above this, generating on a CPU would slow the report down noticeably
SAMPLE_TOKENS = 200
TEMPERATURE = 0.8
SEED = 0
MAX_CHARS = 4000  # a samples.txt is shown up to this many characters


@dataclass(frozen=True)
class Sample:
    text: str | None
    source: str  # where the text came from, or why there is none


def approx_params(config: dict) -> int | None:
    """Parameters of the decoder the config describes (matmuls, embedding and head), roughly."""
    m = config.get("model") or {}
    layers, d, vocab = m.get("n_layer"), m.get("d_model"), m.get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (layers, d, vocab)):
        return None
    ffn = m.get("ffn_hidden") or 4 * d
    return layers * (4 * d * d + 3 * d * ffn) + 2 * vocab * d


def printable(text: str) -> str:
    """Control characters (a byte-level model emits any byte) become U+FFFD; newlines and tabs stay."""
    return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd" for c in text)


def run_sample(run: RunData) -> Sample:
    own = run.path / SAMPLES_FILE
    if own.is_file():
        text = own.read_text(encoding="utf-8", errors="replace")
        cut = f" (first {MAX_CHARS} characters)" if len(text) > MAX_CHARS else ""
        return Sample(printable(text[:MAX_CHARS]), f"{SAMPLES_FILE} in the run folder{cut}")
    if not any(run.path.glob("checkpoint*")) and not any(run.path.glob("step-*")):
        return Sample(None, "no checkpoint in the run folder to sample from")
    params = approx_params(run.config)
    if params is None or params > MAX_PARAMS:
        return Sample(None, f"not generated: the model is too large to sample while rendering (limit "
                            f"{MAX_PARAMS / 1e6:.0f}M parameters); run meshlearn sample {run.path} > "
                            f"{run.path / SAMPLES_FILE}")
    from meshlearn.sample import Generation, sample_from_run  # torch and the model: only when sampling

    try:
        text = sample_from_run(run.path, "", SAMPLE_TOKENS, Generation(TEMPERATURE, SEED))
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as err:
        return Sample(None, f"could not sample from the checkpoint: {err}")
    return Sample(printable(text), f"generated from the final checkpoint: {SAMPLE_TOKENS} tokens, "
                                   f"unprompted, temperature {TEMPERATURE}, seed {SEED}")
