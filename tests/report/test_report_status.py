"""A report says where each run stands (finished, stopped, in progress, ended without a summary)
from the run's own files and its lock, and why a figure is missing for that run."""

from __future__ import annotations

import json

from tiny import tiny_config

from meshlearn.report import render_report
from meshlearn.report.explain import timeline_missing
from meshlearn.report.records import load_run
from meshlearn.report.status import run_status, unfinished_lines
from meshlearn.train import Trainer
from meshlearn.train.rundir import RunLock


def _set_summary(run, **fields):
    path = run / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def test_each_state_of_a_run_is_told_with_the_command_that_continues_it(make_run):
    finished = make_run("finished", name="done")
    _set_summary(finished, steps=20)
    signalled = make_run("signalled", name="sig")
    _set_summary(signalled, steps=12, interrupted="SIGTERM")
    early = make_run("early", name="early")
    _set_summary(early, steps=8)
    ended = make_run("ended", name="ended", summary=False)
    assert run_status(load_run(finished)).state == "finished"
    assert run_status(load_run(signalled)).line == (f"signalled: stopped at step 12 of 20 by SIGTERM; "
                                                    f"continue with: meshlearn train --resume {signalled}")
    assert run_status(load_run(early)).line.startswith("early: stopped at step 8 of 20 (train.stop_at_step)")
    assert run_status(load_run(ended)).line.startswith("ended: ended at step 20 of 20 without a summary")
    with RunLock(ended, command="test"):  # the same folder while a live process holds it
        assert run_status(load_run(ended)).state == "in progress"
    assert run_status(load_run(ended)).state == "ended"  # released: the holder is gone
    assert unfinished_lines([load_run(finished)]) == []


def test_a_stopped_cluster_run_is_continued_on_every_machine_with_its_host(make_run):
    run = make_run("cluster", config='[cluster]\ncoordinator = "alice"\n[cluster.hosts.alice]\n'
                                     'address = "127.0.0.1"\n')
    _set_summary(run, steps=8)
    assert not run_status(load_run(run)).line.endswith("--key FILE")  # the simulator ignores [cluster]
    (run / "config.toml").write_text('backend = "dist"\n' + (run / "config.toml").read_text())
    assert run_status(load_run(run)).line == (
        f"cluster: stopped at step 8 of 20 (train.stop_at_step); continue on every machine with: "
        f"meshlearn train --resume {run} --host NAME --key FILE")


def test_a_stopped_real_run_says_so_first_and_why_it_has_no_timeline(tiny_corpus, tmp_path):
    run = tmp_path / "stopped"
    Trainer(tiny_config(tiny_corpus, "train.steps=8", "train.stop_at_step=2", "report.timeline_steps=auto"),
            run, progress=False).train()
    index = render_report([run], tmp_path / "report")
    page = index.read_text()
    assert page.index("stopped at step 2 of 8 (train.stop_at_step)") < page.index("<h2>Configuration</h2>")
    markdown = (index.parent / "report.md").read_text()
    assert "> **Not finished:** stopped: stopped at step 2 of 8" in markdown
    assert timeline_missing([load_run(run)]) == ("stopped stopped at step 2, before step 4, the first of "
                                                 "report.timeline_steps = auto")
    assert "before step 4, the first of report.timeline_steps = auto" in page
