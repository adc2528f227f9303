"""The run's training data as the trainer cuts it, for the trainer and the plugins: the corpus
is read and tokenized once, and a plugin that needs batches (a probe batch, the anchor's
microbatches, a morph snapshot's traffic) takes them from here (``PluginContext.data``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshlearn.data.batches import Batch, global_batch, shard_batch


@dataclass(frozen=True)
class RunData:
    train: np.ndarray  # the train split's tokens
    batch_size: int  # train.batch_size: sequences per global batch
    seq_len: int
    seed: int
    microbatches: int  # mesh.microbatches: per replica and step

    def batch(self, index: int, batch_size: int | None = None) -> Batch:
        """Global batch ``index`` (``batch_size`` sequences, default the run's): a pure function of
        the tokens, the seed and the index (``data.batches.global_batch``)."""
        return global_batch(self.train, index, batch_size or self.batch_size, self.seq_len, self.seed)

    def microbatches_of(self, index: int, rows: int, row: int) -> list[Batch]:
        """Row ``row``'s microbatches of global batch ``index`` split over ``rows`` rows, exactly as
        the trainer hands them out."""
        x, y = self.batch(index)
        return shard_batch(x, y, rows, self.microbatches)[row]
