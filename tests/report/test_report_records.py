"""Reading run folders: tolerant of crashes, strict about missing folders."""

from __future__ import annotations

import json
import warnings

import pytest

from meshlearn.report import load_run, read_metrics, read_summary


def test_load_run_splits_kinds_and_keeps_events(make_run):
    run = load_run(make_run())
    assert run.label == "run-a"  # the folder, not the config's name = "alpha"
    assert len(run.train_records) == 20
    assert [e["what"] for e in run.events] == ["worker_joined"]
    assert [r["step"] for r in run.eval_records] == [5, 10, 20]
    assert run.summary is not None and run.summary["final_val_loss"] == 2.2
    assert run.config["train"]["steps"] == 20


def test_label_is_the_folder_name_with_or_without_a_config_name(make_run):
    assert load_run(make_run("my-run", name=None)).label == "my-run"
    assert load_run(make_run("other", name="demo")).label == "other"


def test_truncated_last_line_is_skipped_silently(make_run):
    run_dir = make_run()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 21, "train_lo')  # crash mid-write
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_metrics(run_dir)
    assert records[-1]["step"] == 20


def test_truncated_multibyte_last_line_is_skipped(make_run):
    run_dir = make_run()
    with (run_dir / "metrics.jsonl").open("ab") as f:
        f.write('{"kind": "event", "note": "é'.encode()[:-1])
    assert read_metrics(run_dir)[-1]["step"] == 20


def test_malformed_middle_line_warns_and_keeps_the_rest(make_run):
    run_dir = make_run()
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(5, '{"kind": "train", "st{"kind": "train"}')  # resumed after partial line
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="skipped 1 malformed line"):
        records = read_metrics(run_dir)
    assert len(records) == len(lines) - 1


def test_missing_summary_gives_none(make_run):
    run_dir = make_run(summary=False)
    assert read_summary(run_dir) is None
    assert load_run(run_dir).summary is None


def test_corrupt_summary_is_treated_as_missing(make_run):
    run_dir = make_run()
    (run_dir / "summary.json").write_text('{"steps": 2')
    with pytest.warns(UserWarning, match="unreadable"):
        assert read_summary(run_dir) is None


def test_missing_run_folder_raises_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run folder not found"):
        load_run(tmp_path / "nope")


def test_missing_metrics_raises_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        load_run(tmp_path / "empty")


def test_non_object_last_line_is_ignored(make_run):
    run_dir = make_run()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(12) + "\n")
    assert read_metrics(run_dir)[-1]["step"] == 20
