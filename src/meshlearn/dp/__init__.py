"""Data-parallel synchronization as a pluggable, sans-IO strategy (``dp.*``; docs/asyncmesh.md).

``dp.settings`` (the config section), ``dp.base`` (the ``DPStrategy`` interface and the message
exchange), one module per strategy, ``dp.registry.build_strategy``; ``dp.strategies`` lists them,
plug-ins of other packages included (the entry point group ``meshlearn.dp_strategies``).
"""
