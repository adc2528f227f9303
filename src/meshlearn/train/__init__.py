"""Training: assemble a run from its config, loop, log, evaluate, checkpoint."""

from meshlearn.train import restore  # noqa: F401 — registers the run-folder reader (model.init = RUN)
from meshlearn.train.trainer import Trainer, pipeline_loss

__all__ = ["Trainer", "pipeline_loss"]
