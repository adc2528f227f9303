"""SIGINT/SIGTERM: stop at the next drain point every process agrees on, with a checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import signal_at
from test_cli import tiny_args
from tiny import tiny_config

from meshlearn import hooks
from meshlearn.entry.cli import main
from meshlearn.train import Trainer
from meshlearn.train.signals import KEY, GracefulStop, LocalStore

ASYNC = ["mesh.stages=4", "mesh.schedule=async", "mesh.microbatches=2", "train.steps=10",
         "train.eval_every=1000", "train.checkpoint_every=0"]
FLUSH = ["mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b", "train.steps=8",
         "train.eval_every=1000", "train.checkpoint_every=0"]


def test_processes_agree_on_the_highest_claimed_step():
    store = LocalStore()
    a, b = GracefulStop(store), GracefulStop(store)
    assert not a.observe(0, 2) and not b.observe(0, 3)  # claims: a fed up to 2, b up to 3
    assert not a.observe(1, 3)
    b.request(signal.SIGTERM)
    assert b.observe(1, 4) and b.stop_after == 3  # not 4: b stops on what was claimed
    assert a.observe(2, 5) and a.stop_after == 3 and a.signum == signal.SIGTERM  # a learns it
    assert not a.observe(3, 9) and a.stop_after == 3  # latched once


class CountingStore(LocalStore):
    """A LocalStore that counts its requests (each a round trip to a remote store)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.requests += 1
        return super().compare_set(key, expected, desired)


class TCPStoreLike(CountingStore):
    """A swap of a key the store does not hold returns the value expected (torch's TCPStore)."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        assert self.requests < 10, "the same swap asked again and again"
        if key not in self.data and expected != "":
            self.requests += 1
            return expected.encode()
        return super().compare_set(key, expected, desired)


def test_a_guess_at_a_key_the_store_does_not_hold_claims_it_from_empty():
    """A process whose last-seen claim is not in the store (a store that lost it, or a new one)
    claims from the empty key: two requests, not a loop that asks the same forever."""
    store = TCPStoreLike()
    stop = GracefulStop(store)
    stop.claimed = 4
    assert not stop.observe(4, 5)
    assert stop.claimed == 5 and store.data == {KEY: b"f:5"} and store.requests == 2


def test_claiming_the_next_step_at_each_steps_end_is_one_request():
    """Two processes of a flushing run claim step t + 1 at step t's end, in either order: one
    request each (a swap that expects the value it saw last), not a read and then a swap."""
    store = CountingStore()
    a, b = GracefulStop(store), GracefulStop(store)
    assert not a.observe(0, 0) and not b.observe(0, 0)
    for t in range(6):
        first, second = (a, b) if t % 2 else (b, a)
        before = store.requests
        assert not first.observe(t, t + 1) and not second.observe(t, t + 1)
        assert store.requests - before == 2
        assert a.claimed == b.claimed == t + 1
    b.request()
    assert b.observe(6, 6) and a.observe(6, 6)  # the stop lands after the highest claimed step
    assert a.stop_after == b.stop_after == 6


def test_a_process_that_claimed_the_next_step_moves_the_stop_there():
    """The dist race of a flushing schedule: b finished step 4 and claimed step 5 before a, which
    got the signal during step 4, asked; the stop is after 5, and a learns nothing is lost."""
    store = LocalStore()
    a, b = GracefulStop(store), GracefulStop(store)
    assert not a.observe(4, 4) and not b.observe(4, 5)
    a.request(signal.SIGINT)
    assert a.observe(4, 4) and a.stop_after == 5
    assert b.observe(5, 5) and b.stop_after == 5 and b.signum == signal.SIGINT


def test_a_stop_is_never_before_the_step_being_asked_about():
    stop = GracefulStop()
    stop.request()
    assert stop.observe(5, 7) and stop.stop_after == 5


class InterruptedTrainer(Trainer):
    """The signal arrives while step ``at`` is being fed (inside the driver's run_step)."""

    at = 3

    def work(self, step):
        self.fed_max = max(getattr(self, "fed_max", -1), step)
        if step == self.at:
            self.stop.request(signal.SIGTERM)
            self.running = self.totals.step  # the step in flight when the signal came
        return super().work(step)


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["train_loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


class DrainsAt(Trainer):
    """An uninterrupted run with one extra drain point (async: a drain changes what is in flight)."""

    extra = -1

    def drains_after(self, done):
        return done == self.extra or super().drains_after(done)


def test_a_flushing_run_stops_after_the_step_in_flight_and_resumes_exactly(tiny_corpus, tmp_path):
    """1F1B feeds no step ahead: a signal while step 4 runs stops the run after step 4, and the
    resumed run is the uninterrupted one (a drain changes nothing under a flushing schedule)."""
    run = tmp_path / "run"
    trainer = InterruptedTrainer(tiny_config(tiny_corpus, *FLUSH), run, progress=False, stop=GracefulStop())
    summary = trainer.train()
    assert trainer.interrupted == "SIGTERM"
    assert trainer.running == trainer.fed_max == trainer.stop.stop_after == InterruptedTrainer.at
    assert summary["steps"] == InterruptedTrainer.at + 1 == len(losses(run))
    Trainer(tiny_config(tiny_corpus, *FLUSH), run, resume=True, progress=False).train()
    Trainer(tiny_config(tiny_corpus, *FLUSH), tmp_path / "straight", progress=False).train()
    assert losses(run) == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)


def test_an_async_run_stops_after_the_last_fed_step_and_resumes_exactly(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    trainer = InterruptedTrainer(tiny_config(tiny_corpus, *ASYNC), run, progress=False,
                                 stop=GracefulStop())
    summary = trainer.train()
    stopped = summary["steps"]
    assert trainer.interrupted == "SIGTERM" and summary["interrupted"] == "SIGTERM"
    # The drain is after the highest step already fed (microbatches of it were in flight), not
    # after the step that was running: draining earlier would strand fed work.
    assert trainer.stop.stop_after == trainer.fed_max == trainer.driver.fed == stopped - 1
    assert InterruptedTrainer.at < stopped < 10
    assert len(losses(run)) == stopped

    resumed = Trainer(tiny_config(tiny_corpus, *ASYNC), run, resume=True, progress=False)
    assert resumed.totals.step == stopped
    resumed.train()
    straight = DrainsAt(tiny_config(tiny_corpus, *ASYNC), tmp_path / "straight", progress=False)
    straight.extra = stopped
    straight.train()
    assert losses(run) == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)


def cli(*args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "meshlearn", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def train_records(run):
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()[:-1]) if r["kind"] == "train"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_checkpoint_says_how_to_resume_and_exits_128_plus_n(tiny_corpus, tmp_path,
                                                                             sig, code):
    run = tmp_path / "run"
    sets = [f"data.corpus={tiny_corpus}", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
            "model.seq_len=16", "mesh.stages=2", "mesh.replicas=1", "mesh.microbatches=2",
            "train.batch_size=4", "train.steps=100000", "train.eval_every=100000",
            "train.checkpoint_every=0", "train.eval_batches=1"]
    proc = cli("train", *(x for s in sets for x in ("--set", s)), "--out", str(run), cwd=tmp_path)
    try:
        end = time.monotonic() + 60
        while len(train_records(run)) < 3 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert f"stopped by {signal.Signals(sig).name} after step" in err
    assert f"meshlearn train --resume {run}" in err
    manifest = json.loads((run / "checkpoint.json").read_text())
    state_step = manifest["checkpoint.pt"]["step"]
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"]
    assert records[-1]["step"] == state_step >= 3  # nothing trained is lost
    assert json.loads((run / "summary.json").read_text())["interrupted"] == signal.Signals(sig).name
    assert not (run / ".lock").exists()


def signal_at_hook(monkeypatch, spec: str) -> None:
    """Deliver a real signal to this process at a known point of the next run (tests/signal_at.py)."""
    monkeypatch.setitem(hooks._PLUGINS, signal_at.NAME, signal_at.factory)
    monkeypatch.setenv(signal_at.ENV, spec)


CLI_RUN = ["--set", "train.steps=6", "--set", "train.eval_every=100"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_at_a_step_stops_the_run_after_that_step_and_it_resumes_exactly(
        capsys, monkeypatch, tiny_corpus, tmp_path, sig, code):
    """The signal comes as step 3 ends, before the trainer decides whether it drains: the stop is
    right there, before any evaluation; the resumed run equals the uninterrupted one."""
    name, run = signal.Signals(sig).name, tmp_path / "run"
    signal_at_hook(monkeypatch, f"step:2:{name}")
    assert main(["train", *tiny_args(tiny_corpus), *CLI_RUN, "--out", str(run)]) == code
    err = capsys.readouterr().err
    assert json.loads((run / "checkpoint.json").read_text())["checkpoint.pt"]["step"] == 3
    assert f"meshlearn: {name}: stopping with a checkpoint at the first drain point after the step in " in err
    assert err.rstrip().endswith(f"meshlearn: stopped by {name} after step 3 of 6 with a checkpoint "
                                 f"(no validation yet); continue with: meshlearn train --resume {run}")
    assert json.loads((run / "summary.json").read_text())["interrupted"] == name
    monkeypatch.delenv(signal_at.ENV)
    assert main(["train", "--resume", str(run)]) == 0
    assert main(["train", *tiny_args(tiny_corpus), *CLI_RUN, "--out", str(tmp_path / "straight")]) == 0
    assert losses(run) == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)


@pytest.mark.parametrize("spec,code", [("step:5:SIGINT", 130), ("drain:6:SIGTERM", 143)])
def test_a_signal_as_the_run_finishes_still_exits_128_plus_n(capsys, monkeypatch, tiny_corpus, tmp_path,
                                                            spec, code):
    """At the last step's end, or during the final evaluation: nothing is left to stop, but the
    exit code says the signal came."""
    run = tmp_path / "run"
    signal_at_hook(monkeypatch, spec)
    assert main(["train", *tiny_args(tiny_corpus), *CLI_RUN, "--out", str(run)]) == code
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert last.startswith("done: 6 steps, val loss ")
    assert last.endswith(f"({spec.split(':')[2]} came as the run finished: nothing was left to stop)")
