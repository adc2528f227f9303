"""The report's config section (``report.*``): what a run records for its report, and its checks."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshlearn.mesh.timeline import parse_timeline_steps


@dataclass(frozen=True)
class ReportConfig:
    """What the run records for ``meshlearn report`` beyond metrics.jsonl. Config keys under ``report.``."""

    timeline_steps: str = "auto"
    """Steps whose every compute and transfer is recorded in timeline.json for the report's pipeline
    timeline (a Gantt per worker): ``auto`` (the middle step of the run and the next), ``off``, or
    1-based step numbers such as ``5,6`` (at most 8). Recording costs nothing in other steps."""
    tensorboard: bool = False
    """Also log every numeric field of the train and eval records as TensorBoard scalars under
    RUN/tensorboard (needs the ``tensorboard`` extra: pip install 'meshlearn[tensorboard]')."""


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def validate_report(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``report.*`` run by ``config.validate``."""
    r = cfg.report
    try:
        parse_timeline_steps(r.timeline_steps, cfg.train.steps)
    except ValueError as err:
        require(False, "report.timeline_steps", r.timeline_steps, str(err))
    if r.tensorboard:
        require(tensorboard_installed(), "report.tensorboard", r.tensorboard,
                "needs the tensorboard package: pip install 'meshlearn[tensorboard]' (or set it to false)")
