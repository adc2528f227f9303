"""Training: assemble a run from its config, loop, log, evaluate, checkpoint."""

from meshlearn.train.trainer import Trainer, pipeline_loss

__all__ = ["Trainer", "pipeline_loss"]
