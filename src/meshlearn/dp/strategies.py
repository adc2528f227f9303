"""Which DP strategies exist: the built-in ones, and those other packages declare as plug-ins.

A plug-in is a builder ``(dp: DPConfig, worker, profile) -> DPStrategy`` (the signature of the
built-in ones in ``dp/registry.py``) declared under the entry point group ``meshlearn.dp_strategies``
of the package that holds it, e.g. in its pyproject.toml::

    [project.entry-points."meshlearn.dp_strategies"]
    every_other = "every_other_dp:build"

after which ``dp.name = every_other`` runs it under every runtime (the simulator, dist, elastic),
like a built-in one, with no edit to meshlearn. What it cannot be combined with is written in
``meshlearn.compat`` (the lists of strategies there name the built-in ones; a plug-in is refused
where they are required until it is added). A plug-in cannot take a built-in name.

Kept free of torch (the config tree asks for the names); a plug-in's module is imported only
when it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUP = "meshlearn.dp_strategies"
BUILT_IN = ("allreduce", "sparse", "powersgd", "diloco")

Builder = Callable[[Any, Any, Any], Any]
"""(DPConfig, the worker, the LinkProfile of its DP links) → its DPStrategy."""


def plugins() -> dict[str, EntryPoint]:
    """The plug-ins installed now (read afresh: a test or a user may install one at run time),
    by name, without the ones that take a built-in name."""
    return {ep.name: ep for ep in entry_points(group=GROUP) if ep.name not in BUILT_IN}


def names() -> tuple[str, ...]:
    """Every strategy ``dp.name`` may name: the built-in ones, then the plug-ins by name."""
    return (*BUILT_IN, *sorted(plugins()))


def load(name: str) -> Builder:
    """The builder of the plug-in ``name`` (its module imported now). Raises KeyError if no
    plug-in has that name, and whatever importing the plug-in raises."""
    return plugins()[name].load()
