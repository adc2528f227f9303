"""``meshlearn compress RUN`` end to end on a tiny two-stage run."""

from __future__ import annotations

import json

from meshlearn.entry.cli import main


def test_compress_writes_results_for_each_pipeline_and_keep(tiny_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    sets = [f"data.corpus={tiny_corpus}", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
            "model.seq_len=16", "mesh.stages=2", "mesh.replicas=1", "mesh.microbatches=2",
            "train.batch_size=4", "train.steps=2", "train.eval_batches=2"]
    assert main(["train", *(a for s in sets for a in ("--set", s)), "--out", str(run)]) == 0
    assert main(["compress", str(run), "--keep", "0.5,0.25", "--pipelines", "svd,svdllm",
                 "--calibration", "4"]) == 0
    out = run / "compress"
    result = json.loads((out / "compress.json").read_text())
    assert [(r["pipeline"], r["keep"]) for r in result["results"]] == [
        (p, k) for p in ("svd", "svdllm") for k in (0.5, 0.25)]
    assert all(r["account"]["total_after"] < r["account"]["total_before"] for r in result["results"])
    assert len(result["spectra"]) == 14 and result["calibration"]["sequences"] == 4
    assert "| svdllm | 0.25 |" in (out / "compress.md").read_text()
    assert (out / "spectra.png").stat().st_size > 0 and (out / "loss_vs_kept.png").stat().st_size > 0
    assert "svdllm keep 0.25" in capsys.readouterr().out


def test_compress_rejects_unknown_pipelines_and_bad_fractions(tmp_path, capsys):
    assert main(["compress", str(tmp_path), "--pipelines", "svd,fwsvd"]) == 2
    assert "fwsvd" in capsys.readouterr().err
    assert main(["compress", str(tmp_path), "--keep", "0.5,2"]) == 2
    assert "(0, 1]" in capsys.readouterr().err
    assert main(["compress", str(tmp_path)]) == 2  # no checkpoint
    assert "no checkpoint" in capsys.readouterr().err
