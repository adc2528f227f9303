"""The built-in methods that plug into the trainer (see ``meshlearn.hooks``), in the order their
callbacks run. A new method adds one registration here."""

from meshlearn.anchor.plugin import anchor_plugin
from meshlearn.curvature.plugin import curvature_plugin
from meshlearn.hooks import register_plugin
from meshlearn.mesh.basis_updates import basis_update_plugin
from meshlearn.protocol.plugin import protocol_plugin
from meshlearn.report.plugins import tensorboard_plugin, timeline_plugin
from meshlearn.verify.plugin import trust_plugin, wire_rejects_plugin
from meshlearn.warmup.plugin import warmup_plugin

register_plugin("warmup", warmup_plugin)  # first: it changes the optimizers' parameter groups
register_plugin("subspace_update", basis_update_plugin)
register_plugin("trust", trust_plugin)
register_plugin("wire", wire_rejects_plugin)
register_plugin("curvature", curvature_plugin)  # after warm-up's unlocks at the same drain point
register_plugin("protocol", protocol_plugin)  # at a drain point, morphs just before evaluation
register_plugin("anchor", anchor_plugin)  # at step ends: reads the clocks, feeds the correction
register_plugin("timeline", timeline_plugin)  # records nothing itself: arms the driver's recorder
register_plugin("tensorboard", tensorboard_plugin)  # off by default; sees the records as logged
