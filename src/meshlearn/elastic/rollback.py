"""What an elastic update changes before the mesh has decided whether its step commits.

An elastic step commits in every stage or in none (``CommitVote``), and one that does not commit
must leave every replica as it was. With all-reduce nothing changes before the decision (the
optimizer steps after it). A message-based strategy's rounds change its state first: PowerSGD's
error feedback and warm start at ``pre_step``; DiLoCo's outer weights and momentum, and sparse
averaging's pending rounds, at ``post_step``, whose values follow the optimizer step — so for those
updates (``DPStrategy.post_rounds``) the optimizer steps before the decision and the weights,
optimizer state (and spectral anchors) are kept here too. ``restore`` puts them back; the worker's
version and plan move on as after ``Worker.discard_update``.
"""

from __future__ import annotations

import copy

from meshlearn.mesh.worker import Worker


class Rollback:
    """A copy of what update ``u`` may change; ``weights``: also the module and optimizer."""

    def __init__(self, worker: Worker, weights: bool):
        self.dp = copy.deepcopy(worker.dp.state_dict())
        self.weights = None
        if weights:
            self.weights = {"module": {k: v.clone() for k, v in worker.module.state_dict().items()},
                            "optimizer": copy.deepcopy(worker.optimizer.state_dict()),
                            "spectral": (copy.deepcopy(worker.spectral.state_dict())
                                         if worker.spectral is not None else None)}

    def restore(self, worker: Worker) -> None:
        worker.dp.load_state_dict(self.dp)
        if self.weights is None:
            return
        worker.module.load_state_dict(self.weights["module"])
        worker.optimizer.load_state_dict(self.weights["optimizer"])
        if worker.spectral is not None:
            worker.spectral.load_state_dict(self.weights["spectral"])
