"""Trainer hooks: how a method plugs into the training loop without the trainer naming it.

A method registers a *plugin factory* under a name (``register_plugin``); for each run the trainer
asks every factory for a ``Callback`` (a factory returns None when its method is off in the config).
The trainer then calls the callbacks at fixed points:

- ``drains_after(done)``: does the method need a drain point after ``done`` steps? (The async
  schedule keeps microbatches in flight across steps; a drain point empties the pipeline so that
  weights are settled, e.g. for a basis change or a morph.)
- ``on_step_end(step, report)``: after every step; returns fields for the step's train record and
  extra records (events) for metrics.jsonl.
- ``on_drain(done)``: at a drain point, before evaluation and checkpoint; returns event records.
- ``on_record(record)``: every record the writing process logs (train, eval, events), as it goes
  to metrics.jsonl; for loggers that mirror it elsewhere (TensorBoard). It must not change it.
- ``basis_state(worker)``: state the callback keeps in the basis of that worker's parameters
  (``meshlearn.basis``), for a plugin that changes the basis (a protocol model's morph, which
  sees the callbacks registered before it in ``PluginContext.callbacks``).
- ``state_dict`` / ``load_state_dict``: saved in checkpoints under the plugin's name.
- ``summary``: fields merged into summary.json. ``close``: at the end of the loop.

The built-in plugins are listed in ``meshlearn.entry.plugins``, which the entry points register
before they build a Trainer, so adding a method means one line there, not an edit of the trainer.
This module imports no method: the registry sits below everything that registers in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the registry imports nothing that registers in it
    from meshlearn.config import RunConfig
    from meshlearn.data.run_data import RunData
    from meshlearn.mesh.driver import Clock, ControlChannel, Driver, TimeModels
    from meshlearn.mesh.topology import WorkerId
    from meshlearn.mesh.worker import Worker


@dataclass
class PluginContext:
    """What a plugin factory may use to build its callback: the run's config and folder, this
    process's workers, and the services of the run. A plugin takes data, time and control
    messages from here, never by probing the driver or reading the corpus itself; what only some
    runtimes offer is None elsewhere, and a plugin that needs it says so in its settings'
    refusals."""

    cfg: RunConfig  # the resolved config
    run_dir: Path
    workers: dict[WorkerId, Worker]  # this process's workers
    driver: Driver  # the run's driver (its declared members only; see mesh/driver.py)
    resume_step: int | None  # the step a resumed run continues from; None for a fresh run
    writer: bool  # whether this process writes the run's files
    data: RunData  # the training data as the trainer cuts it (batches, the train tokens)
    clock: Clock  # the run's clock: virtual in the simulator, wall in a real run
    control: ControlChannel | None = None  # control messages at drain points (sim, dist)
    time_models: TimeModels | None = None  # the simulator's link and compute models
    callbacks: dict[str, Callback] = field(default_factory=dict)  # built so far (registration order)


@dataclass
class StepOutput:
    """A callback's contribution to one step's logs."""

    fields: dict = field(default_factory=dict)  # merged into the step's train record
    records: list[dict] = field(default_factory=list)  # extra metrics.jsonl records (events)


class Callback:
    """Base class with do-nothing defaults; a plugin overrides what it needs."""

    def drains_after(self, done: int) -> bool:
        return False

    def on_step_end(self, step: int, report: Any) -> StepOutput:
        return StepOutput()

    def on_drain(self, done: int) -> list[dict]:
        return []

    def on_record(self, record: dict) -> None:
        """See a record the run just logged (only in the process that writes the run's files)."""

    def basis_state(self, worker: Any) -> dict:
        """``{key: BasisTensor}``: what this callback keeps in the basis of ``worker``'s (a
        WorkerId's) parameters; a morph transforms it in place. Default: nothing."""
        return {}

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what ``state_dict`` returned."""

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        """Release files the callback holds."""


PluginFactory = Callable[[PluginContext], Callback | None]
_PLUGINS: dict[str, PluginFactory] = {}


def register_plugin(name: str, factory: PluginFactory) -> None:
    """Make ``factory`` part of every run (it returns None when its method is off)."""
    if name in _PLUGINS and _PLUGINS[name] is not factory:
        raise ValueError(f"plugin {name!r} is registered twice")
    _PLUGINS[name] = factory


def build_callbacks(ctx: PluginContext) -> dict[str, Callback]:
    """The callbacks of this run, in registration order."""
    if not _PLUGINS:  # a run without its methods would silently ignore their config sections
        raise RuntimeError("no trainer plugins are registered: call meshlearn.entry.plugins."
                           "register_builtin_plugins() before building a Trainer (the entry points do)")
    callbacks = ctx.callbacks
    for name, factory in _PLUGINS.items():
        callback = factory(ctx)
        if callback is not None:
            callbacks[name] = callback
    return dict(callbacks)
