"""The built-in methods that plug into the trainer (see ``meshlearn.hooks``), in the order their
callbacks run. A new method adds one line here.

The entry points (``meshlearn`` and ``meshlearn worker``) register them before they build a
Trainer; a script or test that builds one itself calls ``register_builtin_plugins()`` first.
"""

from meshlearn.anchor.plugin import anchor_plugin as sim_anchor_plugin
from meshlearn.curvature.plugin import curvature_plugin
from meshlearn.dp.attribution import attribution_plugin
from meshlearn.hooks import Callback, PluginContext, PluginFactory, register_plugin
from meshlearn.mesh.basis_updates import basis_update_plugin
from meshlearn.protocol.plugin import protocol_plugin
from meshlearn.report.plugins import tensorboard_plugin, timeline_plugin
from meshlearn.verify.plugin import trust_plugin, wire_rejects_plugin
from meshlearn.warmup.plugin import warmup_plugin


def anchor_plugin(ctx: PluginContext) -> Callback | None:
    """The anchor circuit: simulated, or under dist its summary over the anchor stages' processes
    (the runtime's own callback: the method does not know the runtimes)."""
    if ctx.cfg.backend == "dist":
        from meshlearn.distributed.anchor import dist_anchor_plugin  # torch.distributed: dist runs only

        return dist_anchor_plugin(ctx)
    return sim_anchor_plugin(ctx)


BUILTIN_PLUGINS: dict[str, PluginFactory] = {
    "warmup": warmup_plugin,  # first: it changes the optimizers' parameter groups
    "subspace_update": basis_update_plugin,
    "trust": trust_plugin,
    "wire": wire_rejects_plugin,
    "dp_outliers": attribution_plugin,  # reads each step's DP outlier scores (dp.robust)
    "curvature": curvature_plugin,  # after warm-up's unlocks at the same drain point
    "protocol": protocol_plugin,  # at a drain point, morphs just before evaluation
    "anchor": anchor_plugin,  # at step ends: reads the clocks, feeds the correction
    "timeline": timeline_plugin,  # records nothing itself: arms the driver's recorder
    "tensorboard": tensorboard_plugin,  # off by default; sees the records as logged
}


def register_builtin_plugins() -> None:
    """Make the built-in methods part of every run built from now on (again: no effect)."""
    for name, factory in BUILTIN_PLUGINS.items():
        register_plugin(name, factory)
