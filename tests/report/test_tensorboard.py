"""Optional TensorBoard logging: the same scalars as the train and eval records."""

from __future__ import annotations

import pytest
from tiny import tiny_config

from meshlearn.errors import ConfigError
from meshlearn.report.plugins import scalars
from meshlearn.report.settings import tensorboard_installed
from meshlearn.train import Trainer


def test_scalars_of_a_record():
    record = {"kind": "train", "step": 3, "train_loss": 2.5, "lr": 1e-3, "staleness": [1.0, 0.0],
              "grad_norm": float("nan"), "verify_flags": 2, "interrupted": True, "note": "x"}
    assert scalars(record) == [("train/train_loss", 2.5), ("train/lr", 1e-3), ("train/staleness/s0", 1.0),
                               ("train/staleness/s1", 0.0), ("train/verify_flags", 2.0)]
    assert scalars({"kind": "ban", "step": 3, "strikes": 3}) == []


@pytest.mark.skipif(tensorboard_installed(), reason="tensorboard is installed: the option is allowed")
def test_asking_for_it_without_the_package_says_how_to_install_it(tiny_corpus):
    with pytest.raises(ConfigError, match=r"report.tensorboard = True: needs the tensorboard package"):
        tiny_config(tiny_corpus, "report.tensorboard=true")


def test_the_run_writes_the_records_scalars(tiny_corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    Trainer(tiny_config(tiny_corpus, "report.tensorboard=true", "train.eval_every=3"), run,
            progress=False).train()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/train_loss", "train/lr", "train/grad_norm", "eval/val_loss"} <= set(tags)
    assert [e.step for e in events.Scalars("train/train_loss")] == [1, 2, 3]
