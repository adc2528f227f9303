"""The [cluster] placement: parsed from the issue's TOML shape, checked before anything starts (one
line each), ignored by the simulator, and this machine's part of it found from its interfaces."""

from __future__ import annotations

import pytest
from tiny import tiny_config

from meshlearn.cluster.placement import place
from meshlearn.config import ConfigError, load_config, save_config
from meshlearn.jsonl import read_records
from meshlearn.train import Trainer

PLACEMENT = """
[mesh]
stages = 2
replicas = 2

[cluster]
coordinator = "alice"
[cluster.hosts.alice]
address = "127.0.0.1"
port = 29500
workers = ["r0s0", "r1s1"]
[cluster.hosts.bob]
address = "127.0.0.2"
port = 29501
workers = ["r0s1", "r1s0"]
"""


def _load(tmp_path, text: str = PLACEMENT, *overrides: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_the_placement_parses_and_survives_config_toml(tmp_path):
    cfg = _load(tmp_path)
    assert cfg.cluster.enabled and cfg.cluster.coordinator == "alice"
    assert cfg.cluster.hosts["bob"].workers == ("r0s1", "r1s0") and cfg.cluster.hosts["bob"].port == 29501
    save_config(cfg, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == cfg


def test_a_config_without_cluster_is_one_machine():
    cfg = load_config(None)
    assert not cfg.cluster.enabled and cfg.cluster.hosts == {}


def test_set_reaches_a_host_by_name(tmp_path):
    cfg = _load(tmp_path, PLACEMENT, "cluster.hosts.bob.port=29600",
                "cluster.hosts.alice.workers=r0s0,r1s0", "cluster.hosts.bob.workers=r0s1, r1s1")
    assert cfg.cluster.hosts["bob"].port == 29600
    assert cfg.cluster.hosts["alice"].workers == ("r0s0", "r1s0")
    with pytest.raises(ConfigError, match="unknown key"):
        _load(tmp_path, PLACEMENT, "cluster.hosts.bob.adress=1.2.3.4")


@pytest.mark.parametrize("edit,key,hint", [
    (("r1s0", "r2s0"), "cluster.hosts.bob.workers = 'r2s0'", "not a process of this run"),
    (('["r0s1", "r1s0"]', '["r0s1", "r0s0"]'), "cluster.hosts.bob.workers = 'r0s0'",
     "placed twice (also on alice)"),
    (('["r0s1", "r1s0"]', '["r0s1"]'), "cluster.hosts = ['alice', 'bob']",
     "worker r1s0 is placed on no host"),
    (('"127.0.0.2"', '"10.0.0.300"'), "cluster.hosts.bob.address = '10.0.0.300'", "does not resolve"),
    (('"127.0.0.2"', '"not an address"'), "cluster.hosts.bob.address",
     "must be an IP address or a host name"),
    (("29501", "0"), "cluster.hosts.bob.port = 0", "[1, 65535]"),
    (("29501", "65536"), "cluster.hosts.bob.port = 65536", "[1, 65535]"),
    (('coordinator = "alice"', 'coordinator = "carol"'), "cluster.coordinator = 'carol'",
     "must name one of the hosts: ['alice', 'bob']"),
    (('["r0s0", "r1s1"]', '["verifier"]'), "cluster.hosts.alice.workers", "not a process of this run"),
    (("[cluster.hosts.bob]", "[cluster.hosts.'b b']"), "cluster.hosts.b b = 'b b'", "host names are"),
])
def test_a_bad_placement_is_one_line_naming_the_key(tmp_path, edit, key, hint):
    old, new = edit
    assert old in PLACEMENT
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, PLACEMENT.replace(old, new, 1))
    assert str(err.value).startswith(key) and hint in str(err.value) and "\n" not in str(err.value)


def test_the_coordinator_runs_a_worker_and_needs_hosts(tmp_path):
    with pytest.raises(ConfigError, match="coordinator must run at least one worker"):
        everything_on_bob = '["r0s0", "r0s1", "r1s0", "r1s1"]'
        _load(tmp_path, PLACEMENT.replace('["r0s0", "r1s1"]', "[]").replace('["r0s1", "r1s0"]',
                                                                            everything_on_bob))
    with pytest.raises(ConfigError, match="cluster.coordinator = 'alice': needs hosts"):
        load_config(None, ["cluster.coordinator=alice"])


def test_elastic_in_a_cluster_needs_control_membership_and_a_coordinator_last_stage(tmp_path):
    with pytest.raises(ConfigError, match="elastic.membership = 'torchft': with a .cluster. placement: must "
                                          "be 'control' .torchft's lighthouse"):
        _load(tmp_path, PLACEMENT, "elastic.enabled=true", "backend=dist")
    cfg = _load(tmp_path, PLACEMENT, "elastic.enabled=true", "elastic.membership=control", "backend=dist",
                "dist.links=tcp", "dist.trusted_links=false")  # no process group under control membership
    assert cfg.elastic.enabled and cfg.cluster.enabled
    first_stages = PLACEMENT.replace('["r0s0", "r1s1"]', '["r0s0", "r1s0"]').replace('["r0s1", "r1s0"]',
                                                                                     '["r0s1", "r1s1"]')
    with pytest.raises(ConfigError, match="cluster.hosts.alice.workers = .*the coordinator must run a "
                                          "last-stage worker .r0s1, r1s1.: that worker starts the run's"):
        _load(tmp_path, first_stages, "elastic.enabled=true", "elastic.membership=control", "backend=dist")
    _load(tmp_path, first_stages, "backend=dist")  # a fixed run may


def test_extras_may_be_placed_and_otherwise_run_on_the_coordinator(tmp_path):
    text = PLACEMENT.replace('["r0s1", "r1s0"]', '["r0s1", "r1s0", "verifier"]')
    trusted = ("cluster.hosts.alice.trusted=true", "cluster.hosts.bob.trusted=true")
    cfg = _load(tmp_path, text, "verify.name=sentinel", "backend=dist", *trusted)
    bob = place(cfg, "alice")  # alice is 127.0.0.1: this machine
    assert bob.hosts_of["verifier"] == "bob" and bob.world == 5
    cfg = _load(tmp_path, PLACEMENT, "verify.name=sentinel", "backend=dist", *trusted)
    assert place(cfg, "alice").processes == {"r0s0": 0, "r1s1": 3, "verifier": 4}


def test_place_gives_ranks_from_the_mesh_and_checks_this_machine_owns_the_address(tmp_path):
    cfg = _load(tmp_path)
    alice = place(cfg, "alice")
    assert alice.processes == {"r0s0": 0, "r1s1": 3}  # rank = replica · P + stage
    assert alice.interface == "lo" and alice.is_coordinator and alice.writer == "r0s0"
    assert (alice.store_address, alice.store_port) == ("127.0.0.1", 29500)
    with pytest.raises(ConfigError, match=r"--host = 'carol': not a host of \[cluster\]: "
                                          r"allowed \['alice', 'bob'\]"):
        place(cfg, "carol")
    away = _load(tmp_path, PLACEMENT.replace('"127.0.0.2"', '"192.0.2.7"'))  # TEST-NET-1: nobody's
    with pytest.raises(ConfigError, match="cluster.hosts.bob.address = '192.0.2.7': is not an address of "
                                          "this machine"):
        place(away, "bob")
    with pytest.raises(ConfigError, match="--host = 'alice': needs a"):
        place(load_config(None), "alice")


def test_the_simulator_ignores_the_placement(tmp_path, tiny_corpus):
    common = ["mesh.stages=2", "mesh.replicas=2", "train.steps=3"]
    plain = tiny_config(tiny_corpus, *common)
    placed = _load(tmp_path, PLACEMENT, *[f"data.corpus={tiny_corpus}", "model.n_layer=4", "model.d_model=32",
                                          "model.n_head=2", "model.seq_len=16", "mesh.microbatches=2",
                                          "train.batch_size=8", "train.warmup_steps=1",
                                          "train.eval_every=1000", "train.eval_batches=1",
                                          "train.checkpoint_every=0", "link.bandwidth_mbit=100",
                                          "link.latency_ms=10", *common])
    assert placed.cluster.enabled and placed.model == plain.model
    losses = []
    for name, cfg in (("plain", plain), ("placed", placed)):
        Trainer(cfg, tmp_path / name, progress=False).train()
        losses.append([r["train_loss"] for r in read_records(tmp_path / name / "metrics.jsonl")
                       if r["kind"] == "train"])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_resume_keeps_the_placement_of_workers_but_not_of_addresses(tmp_path):
    from meshlearn.config import to_dict
    from meshlearn.train.provenance import check_resumable

    cfg = _load(tmp_path)
    moved = _load(tmp_path, PLACEMENT, "cluster.hosts.bob.address=127.0.0.3")
    assert check_resumable(to_dict(cfg), to_dict(moved)) == {
        "cluster.hosts.bob.address": ["127.0.0.2", "127.0.0.3"]}
    swapped = _load(tmp_path, PLACEMENT, "cluster.hosts.alice.workers=r0s0,r1s0",
                    "cluster.hosts.bob.workers=r0s1,r1s1")
    with pytest.raises(ConfigError, match="cluster.hosts.alice.workers .* cannot change on --resume"):
        check_resumable(to_dict(cfg), to_dict(swapped))


def test_a_config_with_a_placement_hashes_and_its_hosts_still_count_for_equality(tmp_path):
    """RunConfig is hashed (the planner caches by it): a placement must not make it unhashable."""
    cfg = _load(tmp_path)
    assert hash(cfg) == hash(_load(tmp_path)) and cfg == _load(tmp_path)
    moved = _load(tmp_path, PLACEMENT.replace("127.0.0.2", "127.0.0.3"))
    assert moved != cfg


THREE_STAGES = """
[model]
n_layer = 3

[mesh]
stages = 3
replicas = 2

[cluster]
coordinator = "alice"
[cluster.hosts.alice]
address = "127.0.0.1"
workers = ["r0s0", "r0s2", "r1s0", "r1s2"]
[cluster.hosts.bob]
address = "127.0.0.2"
port = 29501
workers = ["r0s1", "r1s1"]
"""


def test_a_verified_run_keeps_its_trusted_ends_on_trusted_hosts(tmp_path):
    """Below 3 replicas SENTINEL assumes the first and last stages honest: a cluster run must put
    them on hosts the owner marks trusted; the middle stage may run anywhere."""
    verified = ("verify.name=sentinel", "backend=dist")
    with pytest.raises(ConfigError, match=r"verify.trusted_ends = 'auto': assumes the first and last stages "
                                          r"honest at 2 replicas, and host alice runs r0s0, r0s2, r1s0, r1s2 "
                                          r"without cluster.hosts.alice.trusted = true"):
        _load(tmp_path, THREE_STAGES, *verified)
    cfg = _load(tmp_path, THREE_STAGES, *verified, "cluster.hosts.alice.trusted=true")
    assert cfg.cluster.hosts["alice"].trusted and not cfg.cluster.hosts["bob"].trusted
    with pytest.raises(ConfigError, match="host bob runs r1s2 without cluster.hosts.bob.trusted = true"):
        _load(tmp_path, THREE_STAGES, *verified, "cluster.hosts.alice.trusted=true",
              "cluster.hosts.alice.workers=r0s0,r0s2,r1s0", "cluster.hosts.bob.workers=r0s1,r1s1,r1s2")
    with pytest.raises(ConfigError, match="verify.trusted_ends = 'always': assumes the first and last stages "
                                          "honest at 3 replicas"):
        _load(tmp_path, THREE_STAGES, *verified, "mesh.replicas=3", "train.batch_size=24",
              "verify.trusted_ends=always",
              "cluster.hosts.alice.workers=r0s0,r0s2,r1s0,r1s2,r2s0,r2s2",
              "cluster.hosts.bob.workers=r0s1,r1s1,r2s1")


def test_ends_verified_like_any_stage_need_no_trusted_host(tmp_path):
    """From 3 replicas (``auto``), or with ``never``, the ends are ordinary participants; without
    SENTINEL nothing is assumed of any host."""
    three = ("mesh.replicas=3", "train.batch_size=24",
             "cluster.hosts.alice.workers=r0s0,r0s2,r1s0,r1s2,r2s0,r2s2",
             "cluster.hosts.bob.workers=r0s1,r1s1,r2s1")
    assert not _load(tmp_path, THREE_STAGES, "verify.name=sentinel", "backend=dist", *three
                     ).cluster.hosts["alice"].trusted
    _load(tmp_path, THREE_STAGES, "verify.name=sentinel", "backend=dist", "verify.trusted_ends=never")
    _load(tmp_path, THREE_STAGES, "backend=dist")


def test_the_verifier_runs_on_the_coordinator_or_a_trusted_host(tmp_path):
    """The verifier bans and evicts any worker: a host that is neither the coordinator nor marked
    trusted may not run it, whoever runs the ends."""
    verified = ("verify.name=sentinel", "backend=dist", "verify.trusted_ends=never")
    on_bob = PLACEMENT.replace('["r0s1", "r1s0"]', '["r0s1", "r1s0", "verifier"]')
    with pytest.raises(ConfigError, match="verify.name = 'sentinel': host bob runs the verifier, which bans "
                                          "and evicts any worker, without cluster.hosts.bob.trusted = true"):
        _load(tmp_path, on_bob, *verified)
    assert place(_load(tmp_path, on_bob, *verified, "cluster.hosts.bob.trusted=true"), "alice").hosts_of[
        "verifier"] == "bob"
    on_alice = PLACEMENT.replace('["r0s0", "r1s1"]', '["r0s0", "r1s1", "verifier"]')
    assert place(_load(tmp_path, on_alice, *verified), "alice").hosts_of["verifier"] == "alice"
    assert place(_load(tmp_path, PLACEMENT, *verified), "alice").hosts_of["verifier"] == "alice"
