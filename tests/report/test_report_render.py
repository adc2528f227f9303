"""End-to-end report rendering for one and several runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from meshlearn.report import render_report
from meshlearn.report.__main__ import main
from meshlearn.report.figures import FIGURES, FigureSpec, register_figure

# Figures the fake runs have data for; the timeline, staleness and flags need what they lack.
PNGS = ["loss_vs_step.png", "loss_vs_sim_time.png", "lr_grad_norm.png", "throughput.png",
        "bytes_per_token.png", "link_bytes.png"]
MESH = '[mesh]\nstages = 4\nreplicas = 2\nschedule = "1f1b"\nmicrobatches = 4\n'


def _assert_report(out: Path) -> tuple[str, str]:
    for name in ["index.html", "report.md", *PNGS]:
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in PNGS)
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    return (out / "index.html").read_text(), (out / "report.md").read_text()


def test_single_run_report(make_run):
    run_dir = make_run(banned=[{"worker": "r1s1", "step": 12, "metric": "grad_cosine"}], config=MESH)
    index = render_report([run_dir])
    assert index == run_dir / "report" / "index.html"
    page, md = _assert_report(index.parent)
    assert "run-a" in page and "alpha" not in page  # labelled by folder, not by config name
    assert "2.2000" in page and "device:rtx4090" in page
    assert "12.5%" in page  # the idle fraction
    assert "42.9%" in page  # 1f1b's bubble at P = 4, M = 4: 3/7
    assert "Banned workers" in page and "r1s1" in page and "grad_cosine" in md
    for png in PNGS:
        assert f'src="{png}"' in page
        assert f"]({png})" in md
    for absent in ("Pipeline timeline", "Staleness", "Verifier flags per worker"):
        assert re.search(rf"<h3>{absent}</h3>\s*<p class=\"missing\">Not shown: ", page), absent
    assert "no asynchronous run" in md
    assert md.startswith("# meshlearn report")
    assert re.search(r"\| run-a \| 20 \| 81\.9k \|", md)
    assert "no checkpoint in the run folder" in page  # samples: said why there is none


def test_every_figure_but_the_missing_ones_gets_a_note(make_run):
    page, _ = _assert_report(render_report([make_run(config=MESH)]).parent)
    assert page.count('<figcaption class="note">') == len(PNGS)


def test_two_run_comparison_marks_what_differs(make_run):
    a = make_run("run-a", val=2.2, config=MESH)
    b = make_run("run-b<&>", val=1.9, base_loss=3.5, config=MESH.replace("1f1b", "gpipe"))
    index = render_report([a, b])
    assert index == a / "report-compare" / "index.html"
    page, md = _assert_report(index.parent)
    assert "run-b&lt;&amp;&gt;" in page and "run-b<&>" not in page
    assert "1.9000" in page and "1.9000" in md
    assert '<tr class="differs"><td>schedule</td>' in page
    assert "| **schedule** | 1f1b, M = 4 | gpipe, M = 4 |" in md
    assert '<tr><td>P × D (stages × replicas)</td><td>4 × 2</td><td>4 × 2</td></tr>' in page
    assert "Banned workers" not in page  # no run banned anyone


def test_bans_are_marked_on_the_loss_curve(make_run):
    ban = {"kind": "ban", "step": 12, "worker": "r1s2", "sim_time_s": 6.0}
    page, _ = _assert_report(render_report([make_run(events=[ban])]).parent)
    assert "Dashed vertical lines: a worker banned" in page


def test_missing_summary_is_tolerated_and_said(make_run):
    run_dir = make_run(summary=False)
    out = render_report([run_dir]).parent
    page = (out / "index.html").read_text()
    assert "no summary.json" in page and "no summary.json" in (out / "report.md").read_text()
    # Derived from the last eval record (step 20): 4.0 - 0.09 * 20.
    assert "2.2000" in page
    assert "8.2k" in page  # sim tok/s = 81920 tokens / 10 s
    assert not (out / "link_bytes.png").exists() and "no run has per-link counters" in page


def test_truncated_metrics_still_render(make_run, tmp_path):
    run_dir = make_run()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "eval", "step": 21, "val_')
    out = render_report(run_dir, tmp_path / "out")
    assert out == tmp_path / "out" / "index.html"
    _assert_report(out.parent)


def test_same_folder_names_are_told_apart_by_their_parents(make_run):
    a, b = make_run("x/demo"), make_run("y/demo")
    page, _ = _assert_report(render_report([a, b]).parent)
    assert "x/demo" in page and "y/demo" in page and "demo #2" not in page


def test_the_same_folder_twice_gets_a_number(make_run):
    a = make_run("demo")
    page, _ = _assert_report(render_report([a, a]).parent)
    assert "demo #2" in page


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
    out = render_report([run_dir]).parent
    page, md = (out / "index.html").read_text(), (out / "report.md").read_text()
    assert "fresh" in page and "no train records" in md
    assert (out / "loss_vs_step.png").is_file() and not (out / "throughput.png").exists()


def test_a_registered_figure_is_drawn_after_the_one_named(make_run, monkeypatch):
    monkeypatch.setattr("meshlearn.report.figures.FIGURES", list(FIGURES))

    def draw(runs, path):
        path.write_bytes(b"\x89PNG fake")
        return path

    register_figure(FigureSpec("extra", "An extra figure", draw, lambda runs: "beside the loss"),
                    after="loss_vs_step")
    with pytest.raises(ValueError, match="registered twice"):
        register_figure(FigureSpec("extra", "again", draw))
    page, _ = _assert_report(render_report([make_run()]).parent)
    assert page.index("Loss by step") < page.index("An extra figure") < page.index("Loss by virtual time")
    assert "beside the loss" in page


def _with_trust(run_dir: Path, verify: str) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["trust"] = {
        "verify": verify,
        "messages": {"all": {"precision": 0.25, "recall": 1.0, "fpr": 0.01}},
        "workers": {"tp": 1, "fp": 0, "fn": 0, "precision": 1.0, "recall": 1.0},
        "bans": 1,
        "attackers": [{"worker": "r1s2", "attack": "zeros", "start_step": 41}],
        "flags_per_worker": {"r0s2": {"scored": 200, "flags": 2, "malicious": False},
                             "r1s2": {"scored": 100, "flags": 8, "malicious": True}},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_verifier_trust_against_ground_truth(make_run):
    verified = _with_trust(make_run("verified", banned=[{"worker": "r1s2", "step": 41}]), "sentinel")
    out = render_report([verified, _with_trust(make_run("unverified"), "none")]).parent
    page = (out / "index.html").read_text()
    assert (out / "verifier_flags.png").is_file()
    row = ("<tr><td>verified</td><td>sentinel</td><td>r1s2 (zeros from step 41)</td>"
           '<td class="num">0.250</td><td class="num">1.000</td><td class="num">0.010</td>'
           '<td class="num">1.000</td><td class="num">1.000</td><td class="num">1</td>'
           '<td class="num">0</td></tr>')
    assert row in page
    assert "ground truth from the attack harness (verified, unverified)" in page


def test_no_flags_figure_when_nothing_was_verified(make_run):
    out = render_report([_with_trust(make_run("unverified"), "none")]).parent
    assert not (out / "verifier_flags.png").exists()
    assert "no run verified its messages" in (out / "index.html").read_text()
