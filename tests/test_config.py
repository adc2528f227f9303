"""Bad input fails before any work, naming the field, the value and what is allowed."""

import tomllib
from pathlib import Path

import pytest

from meshlearn.config import load_config, valid_keys
from meshlearn.errors import ConfigError

CONFIGS = Path(__file__).parents[1] / "configs"  # whatever the working directory


def test_defaults_and_overrides_parse_into_field_types():
    cfg = load_config(None, ["mesh.stages=2", "link.bandwidth_mbit=inf", "train.lr=1e-3",
                             "mesh.stages=1"])
    assert cfg.mesh.stages == 1  # later values win
    assert cfg.link.bandwidth_mbit == float("inf") and cfg.train.lr == 1e-3


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    for section, values in tomllib.loads(path.read_text()).items():  # the file's values arrive
        if isinstance(values, dict):
            assert all(getattr(getattr(cfg, section), k) == v for k, v in values.items()), section


@pytest.mark.parametrize("override,field,hint", [
    ("mesh.stages=3", "mesh.stages", "allowed: [1, 2, 4]"),
    ("mesh.microbatches=5", "mesh.microbatches", "per-replica batch of 16"),
    ("link.bandwidth_mbit=0", "link.bandwidth_mbit", "must be > 0"),
    ("link.bandwidth_mbit=-5", "link.bandwidth_mbit", "must be > 0"),
    ("codec.name=gzip", "codec.name",
     "allowed: ['bf16', 'fp16', 'identity', 'int4', 'int8', 'lowrank', 'mask', 'subspace', 'topk']"),
    ("mesh.schedule=zigzag", "mesh.schedule", "allowed: ['1f1b', 'async', 'gpipe']"),
    ("data.corpus=/no/such/corpus.txt", "data.corpus", "must be 'shakespeare' or an existing"),
    ("optim.name=lion", "optim.name", "allowed:"),
    ("train.batch_size=7", "train.batch_size", "mesh.replicas = 2"),
    ("model.n_head=3", "model.n_head", "must divide model.d_model = 128"),
    ("mesh.stages=two", "mesh.stages", "expected an integer"),
    ("optim.numuon_rank_schedule=linear", "optim.numuon_rank_schedule", "allowed: ['fixed', 'cosine']"),
    ("verify.fpr_target=1.5", "verify.fpr_target", "in [0, 1)"),
    ("verify.reference_update=trimmed", "verify.reference_update", "allowed: ['mean', 'median']"),
    ("data.replica_corpus=5:README.md", "data.replica_corpus", "replica 5 of 2"),
    ("data.replica_corpus=1:/no/such.txt", "data.replica_corpus", "/no/such.txt does not exist"),
    ("data.replica_corpus=one:README.md", "data.replica_corpus", "R:PATH"),
])
def test_bad_values_name_field_value_and_allowed(override, field, hint):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "demo.toml", [override])
    message = str(err.value)
    assert message.startswith(f"{field} = ") and hint in message
    assert override.split("=", 1)[1] in message


def test_shipped_configs_are_found_from_any_working_directory():
    assert (CONFIGS / "demo.toml").is_file()


def test_unknown_set_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"mesh.stage = .*unknown key.*mesh.stages"):
        load_config(None, ["mesh.stage=2"])


def test_unknown_file_key_is_rejected(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[mesh]\nstagez = 2\n")
    with pytest.raises(ConfigError, match="mesh.stagez"):
        load_config(path)


def test_every_key_is_reachable_by_set():
    keys = valid_keys()
    assert {"model.n_layer", "mesh.schedule", "link.latency_ms", "codec.name", "optim.name",
            "train.steps", "data.tokenizer", "sim.compute", "seed"} <= set(keys)


def test_the_package_license_is_an_spdx_string():
    """A TOML table for project.license makes setuptools print a deprecation banner on every install."""
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
