"""The simulator keeps its last two checkpoints, verifies them on load and falls back."""

import json

import pytest
from tiny import tiny_config

from meshlearn.checkpoint_layout import CHECKPOINT, PREVIOUS, SINGLE_MANIFEST
from meshlearn.statefile import CheckpointError, save_state
from meshlearn.train import Trainer
from meshlearn.train.checkpoint import load_run_state, load_verified


@pytest.fixture
def run(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_corpus, "mesh.stages=2", "train.steps=3", "train.checkpoint_every=1"),
            run, progress=False).train()
    return run


def test_the_last_two_checkpoints_are_kept_with_size_and_checksum(run):
    manifest = json.loads((run / SINGLE_MANIFEST).read_text())
    assert manifest[CHECKPOINT]["step"] == 3 and manifest[PREVIOUS]["step"] == 2
    for name in (CHECKPOINT, PREVIOUS):
        assert manifest[name]["size"] == (run / name).stat().st_size
        assert len(manifest[name]["sha256"]) == 64
    assert load_verified(run)["totals"]["step"] == 3


def test_a_truncated_checkpoint_falls_back_to_the_previous_with_a_warning(run, tiny_corpus):
    data = (run / CHECKPOINT).read_bytes()
    (run / CHECKPOINT).write_bytes(data[: len(data) // 2])
    warnings = []
    state = load_verified(run, warn=warnings.append)
    assert state["totals"]["step"] == 2
    assert len(warnings) == 1 and "truncated" in warnings[0] and "step 2" in warnings[0]
    # and a resume continues from there
    trainer = Trainer(tiny_config(tiny_corpus, "mesh.stages=2", "train.steps=3",
                                  "train.checkpoint_every=1"), run, resume=True, progress=False)
    assert trainer.totals.step == 2


def test_a_changed_byte_is_caught_by_the_checksum(run):
    data = bytearray((run / CHECKPOINT).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run / CHECKPOINT).write_bytes(bytes(data))
    warnings = []
    assert load_verified(run, warn=warnings.append)["totals"]["step"] == 2
    assert "checksum mismatch" in warnings[0]


def test_a_crash_mid_rotation_leaves_a_usable_checkpoint(run):
    (run / CHECKPOINT).replace(run / PREVIOUS)  # the old newest moved, the new one not yet in
    assert load_verified(run, warn=lambda _: None)["totals"]["step"] == 3


def test_foreign_or_destroyed_checkpoints_are_one_line_errors(run, tmp_path):
    (run / PREVIOUS).write_bytes(b"not a zip")
    (run / CHECKPOINT).write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        load_run_state(run)
    assert "no usable checkpoint" in str(err.value) and "\n" not in str(err.value)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    save_state(foreign / CHECKPOINT, {"model": {}})
    with pytest.raises(CheckpointError, match=r"not a meshlearn checkpoint \(it holds \['model'\]"):
        load_run_state(foreign)
