"""A test plugin that delivers a real signal at a known point of a run, without sleeps or timing.

``SIGNAL_AT = "<hook>:<step>:<SIGNAME>"`` (the environment): in every process of the run, at
``on_step_end`` of 0-based step ``step`` (``hook = step``: the step is done, its drain not yet
decided) or at ``on_drain`` after ``step`` steps (``hook = drain``: just before that drain point's
evaluation), the process sends the signal to itself; under ``--backend dist`` rank 0 also sends it
to the launcher, as a terminal's Ctrl-C reaches the whole process group.

In a process of its own: ``install()``. For a dist run, ``sitecustomize(folder)`` writes a
``sitecustomize.py`` that installs it in every interpreter started with ``folder`` on PYTHONPATH
(the launcher, its forkserver and so every worker).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from meshlearn.hooks import Callback, StepOutput, register_plugin

ENV = "SIGNAL_AT"
NAME = "test_signal_at"


class SignalAt(Callback):
    def __init__(self, hook: str, step: int, signum: int):
        self.hook, self.step, self.signum = hook, step, signum

    def on_step_end(self, step: int, report) -> StepOutput:
        if self.hook == "step" and step == self.step:
            self._send()
        return StepOutput()

    def on_drain(self, done: int) -> list[dict]:
        if self.hook == "drain" and done == self.step:
            self._send()
        return []

    def _send(self) -> None:
        if os.environ.get("RANK") == "0":
            os.kill(_launcher_pid(), self.signum)
        os.kill(os.getpid(), self.signum)


def _launcher_pid() -> int:
    """A dist worker's grandparent: the launcher started the forkserver that forked the worker."""
    stat = Path(f"/proc/{os.getppid()}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def factory(ctx) -> SignalAt | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    hook, step, name = spec.split(":")
    return SignalAt(hook, int(step), signal.Signals[name])


def install() -> None:
    register_plugin(NAME, factory)


def sitecustomize(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import os\n"
        f"if os.environ.get({ENV!r}):\n"
        "    import signal_at\n"
        "    signal_at.install()\n")
    return folder
