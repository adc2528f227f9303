"""Watching local worker processes: forward signals to them, echo a log, stop them, say how they ended.

Shared by the dist launcher (``meshlearn.entry.launch``) and the elastic one's watch
(``meshlearn.elastic.membership``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from meshlearn.distributed.health import EXIT_PEER_FAILURE


def forward_signals(procs: list, stopping: str) -> dict:
    """SIGINT/SIGTERM here: the first is passed on to every worker (they stop together at the first
    drain point after the step in flight, agreed through the store, with a checkpoint: ``stopping``
    says so to the user); a second one stops them at once."""
    state: dict = {"signum": None}

    def forward(signum: int, frame: object) -> None:
        if state["signum"] is not None:
            raise KeyboardInterrupt
        state["signum"] = signum
        for p in procs:
            if p.exitcode is None and p.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)
        print(f"\nmeshlearn: {signal.Signals(signum).name}: workers are {stopping} (again to stop at "
              "once)", file=sys.stderr, flush=True)

    if threading.current_thread() is not threading.main_thread():  # a caller's thread: no handlers
        state["restore"] = lambda: None
        return state
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    state["restore"] = lambda: [signal.signal(sig, h) for sig, h in previous.items()]
    return state


def echo(path: Path, position: int, out: TextIO) -> int:
    """Copy what ``path`` (a worker's log) gained since byte ``position`` to ``out``; the new position."""
    try:
        with path.open("rb") as f:
            f.seek(position)
            data = f.read()
    except FileNotFoundError:
        return position
    if data:
        out.write(data.decode(errors="replace"))
        out.flush()
    return position + len(data)


def stop(procs: list, sig: int, wait_s: float) -> None:
    """Send ``sig`` to every process still running, then wait for them (``wait_s`` in all)."""
    for p in procs:
        if p.exitcode is None and p.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
    end = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))


def describe_exit(code: int | str) -> str:
    """A process's exit status in words (a string is already a description)."""
    if isinstance(code, str):
        return code
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == EXIT_PEER_FAILURE:
        return "stopped: a peer failed"
    return f"exit code {code}"


def stop_at_once(procs: list, err: BaseException, stopping: dict, resume: str) -> int:
    """After a second Ctrl-C (or a caller's timeout) while watching: never leave workers behind.
    A KeyboardInterrupt ends with the resume command (``resume``) and 128 + the signal; anything
    else is raised again once the workers are gone."""
    stop(procs, signal.SIGTERM, wait_s=5.0)
    stop(procs, signal.SIGKILL, wait_s=5.0)
    if not isinstance(err, KeyboardInterrupt):
        raise err
    print(f"meshlearn: stopped at once; workers killed — continue from the last complete checkpoint "
          f"with: {resume}", file=sys.stderr)
    return 128 + (stopping.get("signum") or signal.SIGINT)

