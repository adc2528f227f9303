"""What `meshlearn train --host` accepts, and each host's one port on its configured address:port."""

from __future__ import annotations

import json
import socket

import pytest
from test_cluster_config import PLACEMENT, _load

from meshlearn.cluster.placement import host_of_command
from meshlearn.cluster.shared import KEYS, _shared_config
from meshlearn.config import ConfigError, load_config
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.entry.cli import main
from meshlearn.entry.cluster_join import received_config
from meshlearn.net.keys import create_run


def test_host_needs_dist_and_a_cluster_run_needs_host(tmp_path):
    cfg = _load(tmp_path)
    assert host_of_command(cfg, None) is None  # the simulator ignores the placement
    with pytest.raises(ConfigError, match="--host = 'alice': needs --backend dist"):
        host_of_command(cfg, "alice")
    dist_cfg = _load(tmp_path, PLACEMENT, "backend=dist")
    with pytest.raises(ConfigError, match=r"--host = None: a \[cluster\] run starts on each machine with "
                                          r"--host NAME, one of \['alice', 'bob'\]"):
        host_of_command(dist_cfg, None)
    assert host_of_command(dist_cfg, "alice").processes == {"r0s0": 0, "r1s1": 3}
    with pytest.raises(ConfigError, match="--host = 'alice': needs a"):
        host_of_command(load_config(None, ["backend=dist"]), "alice")


def test_the_cli_refuses_a_foreign_host_before_making_a_run_folder(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(PLACEMENT.replace('"127.0.0.2"', '"192.0.2.7"'))
    out = tmp_path / "run"
    assert main(["train", "--backend", "dist", "--config", str(config), "--host", "bob",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cluster.hosts.bob.address = '192.0.2.7': is not an address of this machine" in err
    assert not out.exists()


def test_the_rendezvous_listens_on_the_configured_address_and_port_only():
    with socket.socket() as probe:  # a port free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bound = BoundStore("127.0.0.1", 5.0, port=port)
    assert bound.address == f"127.0.0.1:{port}"
    assert bound._sock.getsockname() == ("127.0.0.1", port)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_host_whose_coordinator_never_answers_stops_in_one_line(tmp_path, capsys, tiny_corpus):
    config = tmp_path / "run.toml"
    port = _free_port()  # nobody listens there: the coordinator was never started
    config.write_text(PLACEMENT.replace('"127.0.0.2"', '"127.0.0.1"').replace("29500", str(port)))
    create_run(tmp_path / "keys", ["alice", "bob"], "test-run")
    assert main(["train", "--backend", "dist", "--config", str(config), "--host", "bob", "--out",
                 str(tmp_path / "run"), "--set", f"data.corpus={tiny_corpus}", "--set",
                 "dist.init_timeout_s=0.5", "--key", str(tmp_path / "keys" / "bob.key")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"meshlearn: error: cluster.coordinator = 'alice': its rendezvous at "
                          f"127.0.0.1:{port} did not answer within dist.init_timeout_s = 0.5 s")


def test_a_coordinator_whose_port_is_taken_stops_in_one_line(tmp_path, capsys, tiny_corpus):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "run.toml"
        config.write_text(PLACEMENT.replace("29500", str(port)))
        create_run(tmp_path / "keys", ["alice", "bob"], "test-run")
        assert main(["train", "--backend", "dist", "--config", str(config), "--host", "alice", "--out",
                     str(tmp_path / "run"), "--set", f"data.corpus={tiny_corpus}", "--key",
                     str(tmp_path / "keys" / "alice.key")]) == 2
    assert f"cluster.hosts.alice.port = {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "said"), [
    (["--host", "alice", "--out", "x"], "--coordinator = None: required with --join: meshlearn train --join"),
    (["--host", "alice", "--out", "x", "--coordinator", "nonsense"],
     "--coordinator = 'nonsense': must be ADDR:PORT, the coordinator's address and its one port"),
    (["--host", "alice", "--out", "x", "--coordinator", "10.0.0.1:29500", "--config", "run.toml"],
     "--config = 'run.toml': not with --join: a joiner takes the run's config from its coordinator"),
    (["--host", "alice", "--out", "x", "--coordinator", "10.0.0.1:29500"],
     "--key = None: a [cluster] run needs this host's private key"),
])
def test_a_join_is_refused_in_one_line_before_it_reaches_anyone(tmp_path, capsys, args, said):
    assert main(["train", "--join", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err, err
    assert main(["train", "--coordinator", "10.0.0.1:29500", "--out", str(tmp_path / "y")]) == 2
    assert "--coordinator = '10.0.0.1:29500': only with --join" in capsys.readouterr().err


class SharedConfig:
    """What the coordinator's control service answers for the shared config (``cluster/shared.py``)."""

    def __init__(self, cfg):
        self.tree = json.dumps(_shared_config(cfg))

    def get(self, key: str) -> bytes:
        assert key == f"{KEYS}/config"
        return self.tree.encode()


def test_a_joiner_takes_the_runs_config_only_from_its_coordinator(tmp_path):
    """The host that answers at --coordinator must be the one the shared config names there; only
    data.corpus may be set; a run that is not elastic takes no joiners."""
    elastic = _load(tmp_path, PLACEMENT, "backend=dist", "elastic.enabled=true", "elastic.membership=control")
    store = SharedConfig(elastic)
    corpus = tmp_path / "mine.txt"
    corpus.write_text("to be or not to be " * 50)
    got = received_config(store, "alice", "127.0.0.1", 29500, [f"data.corpus={corpus}"])
    assert got.cluster.coordinator == "alice" and got.data.corpus == str(corpus) and got.elastic.enabled
    with pytest.raises(ConfigError, match="bob answered there, but the run's config names alice"):
        received_config(store, "bob", "127.0.0.1", 29500, [])  # another host with a valid key
    with pytest.raises(ConfigError, match="--coordinator = '127.0.0.1:29501': alice answered there"):
        received_config(store, "alice", "127.0.0.1", 29501, [])  # not where the config says it is
    with pytest.raises(ConfigError, match="--set = 'mesh.stages=3': a joiner takes the run's config"):
        received_config(store, "alice", "127.0.0.1", 29500, ["mesh.stages=3"])
    with pytest.raises(ConfigError, match="the run is not elastic"):
        received_config(SharedConfig(_load(tmp_path, PLACEMENT, "backend=dist")), "alice", "127.0.0.1",
                        29500, [])
