"""The report in a real browser: headless Chromium renders it with no console error, every image
loads, and a full-page screenshot is kept as a test artifact (in $MESHLEARN_TEST_ARTIFACTS if set,
else pytest's tmp path). This one test is skipped, naming the install command, where Chromium is
missing."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from browser import INSTALL_HINT, WIDTH, Chromium, find_chromium
from PIL import Image
from tiny import tiny_config

from meshlearn.report import render_report
from meshlearn.train import Trainer
from meshlearn.train.rundir import RunLock


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("MESHLEARN_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.skipif(find_chromium() is None,
                    reason=f"headless Chromium not installed; install it with: {INSTALL_HINT}")
def test_report_renders_in_chromium(tiny_corpus, make_run, tmp_path):
    # A real async run (timeline, staleness, a checkpoint to sample) beside a fake one.
    real = tmp_path / "async-2x2"
    Trainer(tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "mesh.schedule=async",
                        "train.steps=4", "train.eval_every=2", "report.timeline_steps=3"),
            real, progress=False).train()
    index = render_report([real, make_run("fake")], tmp_path / "report")
    bad = tmp_path / "bad.html"  # the check must be able to fail
    bad.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><title>bad</title></head><body>'
                   '<img src="missing.png"><script>console.error("boom")</script></body></html>')
    with Chromium(timeout_s=60) as browser:
        check = browser.check_page(index)
        broken = browser.check_page(bad)
    shot = _artifacts(tmp_path) / "report_browser.png"
    shot.write_bytes(check.screenshot)
    assert check.console_errors == []
    assert len(check.images) >= 8 and check.broken_images == []
    assert all(i["width"] > 100 and i["height"] > 100 for i in check.images)
    image = Image.open(io.BytesIO(check.screenshot))
    assert image.width == WIDTH and image.height > 2000  # the whole page, not the first screen
    assert len(image.convert("L").getcolors(maxcolors=1 << 16) or ()) > 50  # not a blank page
    assert broken.broken_images == ["missing.png"]
    assert any("boom" in e for e in broken.console_errors)
    assert any("missing.png" in e for e in broken.console_errors)  # the failed load is logged too


@pytest.mark.skipif(find_chromium() is None,
                    reason=f"headless Chromium not installed; install it with: {INSTALL_HINT}")
def test_an_unfinished_run_says_so_at_the_top_in_chromium(make_run, tmp_path):
    """A run stopped by SIGINT and one still training (its lock held): the rendered page names each
    state and the command that continues it, before the configuration."""
    stopped = make_run("stopped", name="stopped")
    summary = json.loads((stopped / "summary.json").read_text()) | {"steps": 12, "interrupted": "SIGINT"}
    (stopped / "summary.json").write_text(json.dumps(summary))
    running = make_run("running", name="running", summary=False)
    records = [json.loads(line) for line in (running / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in records if r.get("step", 0) <= 10]
    (running / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    with RunLock(running, command="meshlearn train (test)"):
        index = render_report([stopped, running], tmp_path / "report")
        with Chromium(timeout_s=60) as browser:
            check = browser.check_page(index)
    (_artifacts(tmp_path) / "report_unfinished.png").write_bytes(check.screenshot)
    assert check.console_errors == [] and check.broken_images == []
    head = check.text[:check.text.index("Configuration")]
    resume = f"continue with: meshlearn train --resume {stopped}\n"
    assert f"stopped: stopped at step 12 of 20 by SIGINT; {resume}" in head
    assert f"running: in progress (pid {os.getpid()} on " in head and "at step 10 of 20" in head
