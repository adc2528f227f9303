"""run.json keeps every start; a resume may change only keys a checkpoint can continue under."""

import json

import pytest

from meshlearn.config import load_config, save_config, to_dict
from meshlearn.errors import ConfigError
from meshlearn.train.provenance import check_resumable, record_start


@pytest.mark.parametrize("override", ["model.d_model=64", "model.n_layer=8", "mesh.stages=2",
                                      "mesh.replicas=1", "data.tokenizer=bpe", "optim.name=sgd",
                                      "backend=dist", "mesh.schedule=async"])
def test_changes_that_cannot_resume_are_refused_naming_the_key(override):
    old = to_dict(load_config(None, ["mesh.replicas=2", "mesh.stages=4"]))
    new = to_dict(load_config(None, ["mesh.replicas=2", "mesh.stages=4", override]))
    key, value = override.split("=")
    with pytest.raises(ConfigError) as err:
        check_resumable(old, new)
    message = str(err.value)
    assert message.startswith(f"{key} = ") and value in message and "cannot change on --resume" in message


def test_resumable_changes_are_returned_with_old_and_new_values():
    old = to_dict(load_config(None))
    new = to_dict(load_config(None, ["codec.name=bf16", "train.steps=400", "mesh.schedule=gpipe"]))
    assert check_resumable(old, new) == {"codec.name": ["identity", "bf16"],
                                         "mesh.schedule": ["1f1b", "gpipe"], "train.steps": [300, 400]}


def test_run_json_appends_one_record_per_start_with_its_changed_keys(tmp_path):
    cfg = load_config(None)
    record_start(tmp_path, to_dict(cfg), None)
    save_config(cfg, tmp_path / "config.toml")
    record_start(tmp_path, to_dict(load_config(None, ["codec.name=bf16"])), 100)
    run = json.loads((tmp_path / "run.json").read_text())
    assert [(h["kind"], h["step"]) for h in run["history"]] == [("start", 0), ("resume", 100)]
    assert run["history"][0]["changed"] == {} and run["history"][0]["argv"]
    assert run["history"][1]["changed"] == {"codec.name": ["identity", "bf16"]}
    assert run["kind"] == "resume" and run["commit"] == run["history"][1]["commit"]  # top = latest
    record_start(tmp_path, to_dict(cfg), None)  # a fresh start (after --overwrite) starts over
    assert len(json.loads((tmp_path / "run.json").read_text())["history"]) == 1
