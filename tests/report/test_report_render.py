"""End-to-end report rendering for one and several runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshlearn.report import render_report
from meshlearn.report.__main__ import main

PNGS = ["loss_vs_step.png", "loss_vs_sim_time.png", "bytes_per_token.png", "link_utilization.png"]


def _assert_report(out: Path) -> tuple[str, str]:
    for name in ["index.html", "report.md", *PNGS]:
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in PNGS)
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    return (out / "index.html").read_text(), (out / "report.md").read_text()


def test_single_run_report(make_run):
    run_dir = make_run(banned=[{"worker": "r1s1", "step": 12, "metric": "grad_cosine"}])
    index = render_report([run_dir])
    assert index == run_dir / "report" / "index.html"
    page, md = _assert_report(index.parent)
    assert "alpha" in page and "2.2000" in page
    assert "device:rtx4090" in page and "12.5%" in page
    assert "Banned workers" in page and "r1s1" in page and "grad_cosine" in md
    for png in PNGS:
        assert f'src="{png}"' in page
        assert f"]({png})" in md
    assert md.startswith("# meshlearn report")
    assert re.search(r"\| alpha \| 20 \| 81\.9k \|", md)


def test_two_run_comparison(make_run, tmp_path):
    a = make_run("run-a", name="alpha", val=2.2)
    b = make_run("run-b", name="beta<&>", val=1.9, base_loss=3.5)
    index = render_report([a, b])
    assert index == a / "report-compare" / "index.html"
    page, md = _assert_report(index.parent)
    assert "alpha" in page and "2.2000" in page
    assert "beta&lt;&amp;&gt;" in page and "beta<&>" not in page
    assert "1.9000" in page and "1.9000" in md
    assert "Banned workers" not in page  # no run banned anyone


def test_missing_summary_is_tolerated_and_said(make_run):
    run_dir = make_run(summary=False)
    page, md = _assert_report(render_report([run_dir]).parent)
    assert "no summary.json" in page and "no summary.json" in md
    # Derived from the last eval record (step 20): 4.0 - 0.09 * 20.
    assert "2.2000" in page
    assert "8.2k" in page  # sim tok/s = 81920 tokens / 10 s


def test_truncated_metrics_still_render(make_run, tmp_path):
    run_dir = make_run(summary=False)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "eval", "step": 21, "val_')
    out = render_report(run_dir, tmp_path / "out")
    assert out == tmp_path / "out" / "index.html"
    _assert_report(out.parent)


def test_duplicate_labels_are_made_unique(make_run):
    a, b = make_run("a", name="same"), make_run("b", name="same")
    page, _ = _assert_report(render_report([a, b]).parent)
    assert "same #2" in page


def test_missing_run_folder_raises_before_writing(make_run, tmp_path):
    a = make_run()
    with pytest.raises(FileNotFoundError, match="run folder not found"):
        render_report([a, tmp_path / "missing"])
    assert not (a / "report-compare").exists()


def test_module_entry_point(make_run, tmp_path, capsys):
    assert main([str(make_run()), "--out", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip().endswith("index.html")
    assert main([str(tmp_path / "missing")]) == 2


def test_run_without_records_still_renders(tmp_path):
    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    page, md = _assert_report(render_report([run_dir]).parent)
    assert "fresh" in page and "no train records" in md
