"""Morphs in the simulator, through the trainer and the plugin: training under orthogonal morphs
gives the losses of training without them (Muon), the transforms cross the links as messages."""

import json

import pytest
from tiny import tiny_config

from meshlearn.mesh.topology import WorkerId
from meshlearn.protocol import ProtocolDecoder
from meshlearn.statefile import load_state
from meshlearn.train import Trainer

# train.eval_every = protocol.every_steps: the runs without morphs drain at the same points (under
# async a drain point changes the schedule, so runs compare only with the same drains).
BASE = ["optim.name=muon", "mesh.stages=2", "train.steps=8", "protocol.every_steps=2",
        "train.eval_every=2"]


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train(corpus, run_dir, *overrides) -> Trainer:
    trainer = Trainer(tiny_config(corpus, *BASE, *overrides), run_dir, progress=False)
    trainer.train()
    return trainer


@pytest.mark.parametrize("shape", [["mesh.schedule=1f1b"],
                                   ["mesh.schedule=async", "mesh.replicas=2", "mesh.microbatches=4"]],
                         ids=["1f1b", "async-D2"])
def test_orthogonal_morphs_train_like_no_morphs(tiny_corpus, tmp_path, shape):
    plain = train(tiny_corpus, tmp_path / "none", *shape, "protocol.morph=none")
    morphed = train(tiny_corpus, tmp_path / "orth", *shape, "protocol.morph=orthogonal")
    a, b = records(tmp_path / "none", "train"), records(tmp_path / "orth", "train")
    assert len(a) == len(b) == 8
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-4, (ra["step"], ra, rb)
    ea, eb = records(tmp_path / "none", "eval"), records(tmp_path / "orth", "eval")
    assert abs(ea[-1]["val_loss"] - eb[-1]["val_loss"]) <= 1e-4
    morphs = [r for r in records(tmp_path / "orth", "event") if r["event"] == "protocol_morph"]
    assert [r["step"] for r in morphs] == [2, 4, 6, 8]
    # The same function in a different basis: the boundary stage's writers and bases differ.
    wa = plain.workers[WorkerId(0, 1)].module.state_dict()
    wb = morphed.workers[WorkerId(0, 1)].module.state_dict()
    assert isinstance(morphed.workers[WorkerId(0, 1)].module, ProtocolDecoder)
    for name in ("layers.2.attn_skip", "layers.3.mlp.down.weight"):
        assert (wa[name] - wb[name]).abs().max() > 0.5 * wa[name].abs().max(), name


def test_transforms_are_charged_on_the_pipeline_links(tiny_corpus, tmp_path):
    none = train(tiny_corpus, tmp_path / "none", "protocol.morph=none")
    orth = train(tiny_corpus, tmp_path / "orth", "protocol.morph=orthogonal")
    d, replicas, morphs = 32, 1, 4
    expected = morphs * replicas * d * d * 8  # one fp64 T per boundary, replica and morph
    summary = orth.summary()
    assert summary["protocol_morph_bytes"] == expected and summary["protocol_morphs"] == morphs

    def link_bytes(trainer):
        return sum(link["bytes"] for link in trainer.summary()["links"]
                   if link["axis"] == "pp" and link["src"] == "r0s0")

    assert link_bytes(orth) - link_bytes(none) == expected
    # ... and in the records' bytes_pp (cumulative), in the step after each morph: the morph
    # after the last step has no step after it.
    counted = records(tmp_path / "orth", "train")[-1]["bytes_pp"]
    assert counted - records(tmp_path / "none", "train")[-1]["bytes_pp"] == \
        expected * (morphs - 1) // morphs


def test_low_condition_morphs_break_the_equivalence(tiny_corpus, tmp_path):
    """The negative control: with ε = 0.5, Muon on the morphed model is no longer the morphed
    trajectory (the function is still kept at each morph; training drifts after it)."""
    train(tiny_corpus, tmp_path / "none", "protocol.morph=none")
    train(tiny_corpus, tmp_path / "lc", "protocol.morph=lowcond", "protocol.epsilon=0.5")
    a, b = records(tmp_path / "none", "train"), records(tmp_path / "lc", "train")
    assert abs(a[2]["train_loss"] - b[2]["train_loss"]) <= 1e-4  # the morph after step 2 keeps it
    assert max(abs(ra["train_loss"] - rb["train_loss"]) for ra, rb in zip(a, b, strict=True)) > 1e-4


def test_a_morphing_run_resumes_exactly(tiny_corpus, tmp_path):
    overrides = ["protocol.morph=orthogonal", "train.checkpoint_every=3", "mesh.schedule=async"]
    train(tiny_corpus, tmp_path / "a", *overrides)
    train(tiny_corpus, tmp_path / "b", *overrides, "train.stop_at_step=3")
    Trainer(tiny_config(tiny_corpus, *BASE, *overrides), tmp_path / "b", resume=True,
            progress=False).train()
    a, b = records(tmp_path / "a", "train"), records(tmp_path / "b", "train")
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    ckpt = load_state(tmp_path / "a" / "checkpoint.pt")
    assert ckpt["plugins"]["protocol"]["epoch"] == 4
