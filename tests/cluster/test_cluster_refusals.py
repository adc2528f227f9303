"""Each process's record of what it refused (``cluster/refusals.py``) and the run's ``refused``
block: a worker's refusals reach its host's record as they happen (a worker that ends by
``os._exit`` loses none), attributed to their senders; a file that is no record is skipped; the
summary's block adds hosts up by reason and by sender, a stranger's refusals attributed to nobody."""

from __future__ import annotations

import json
from pathlib import Path

from meshlearn.cluster.hostport import HostPort
from meshlearn.cluster.links import REFUSALS_ENV
from meshlearn.cluster.placement import Placement
from meshlearn.cluster.refusals import REFUSALS_DIR, ProcessRecord, merged, process_records
from meshlearn.cluster.security import refused_block
from meshlearn.net.counters import Counters
from meshlearn.net.keys import Credentials, create_run


def test_a_process_record_is_current_after_each_refusal_and_adds_up_with_its_hosts(tmp_path):
    counters = Counters(ProcessRecord(tmp_path / REFUSALS_DIR, "r0s0"))
    counters.add("contribution_refused", "rank 2 (host bob), sum: a frame of 99 bytes", sender="bob")
    assert process_records(tmp_path)["r0s0"]["refused"] == {"contribution_refused": 1}  # on disk already
    counters.add("hello_refused", "bob (host) claims r1s1, which alice runs", sender="bob")
    (tmp_path / REFUSALS_DIR / "r1s1.json").write_text('{"refused": {"x": "many"}, "by_sender": {}}')
    (tmp_path / REFUSALS_DIR / "junk.json").write_text("not json")
    records = process_records(tmp_path)
    assert set(records) == {"r0s0"} and records["r0s0"]["by_sender"] == {"bob": 2}
    port = Counters()
    port.add("preamble_malformed", "random bytes")  # a stranger: attributed to nobody
    port.add("authority", "host bob: may not set 'done/0'", sender="bob")
    by_reason, by_sender = merged(port, records)
    assert by_reason == {"authority": 1, "contribution_refused": 1, "hello_refused": 1,
                         "preamble_malformed": 1}
    assert by_sender == {"bob": 3}
    block = refused_block({"alice": {"refused": by_reason, "by_sender": by_sender},
                           "bob": {"refused": {"preamble_malformed": 2}}},  # a record without senders
                          "alice", ["alice", "bob"])
    assert block["total"] == 6 and block["by_sender"] == {"bob": 3}
    assert block["by_host"]["bob"] == {"preamble_malformed": 2}
    assert process_records(None) == {} and process_records(tmp_path / "nowhere") == {}


def test_a_hosts_security_record_adds_its_workers_records_to_its_ports(tmp_path):
    """What the launcher writes as security.json (``HostPort.write_record``): its own counters and
    each of its workers' records, by reason, by sender and per process."""
    placement = Placement("alice", "127.0.0.1", 0, "lo", "alice", "127.0.0.1", 0, {"r0s0": 0},
                          {"r0s0": "alice", "r0s1": "bob"}, {"r0s0": 0, "r0s1": 1}, 2, "r0s0")
    create_run(tmp_path / "keys", ["alice", "bob"], "record-test")
    port = HostPort(placement, Credentials.in_folder(tmp_path / "keys", "alice"))
    try:
        run = tmp_path / "run"
        worker = Counters(ProcessRecord(Path(port.worker_env(run)[REFUSALS_ENV]), "r0s0"))
        worker.add("contribution_refused", "rank 1 (host bob), sum: a frame of 99 bytes", sender="bob")
        port.counters.add("preamble_malformed", "random bytes")
        record = port.write_record(run)
    finally:
        port.close()
    assert record["refused"] == {"contribution_refused": 1, "preamble_malformed": 1}
    assert record["refused_total"] == 2 and record["by_sender"] == {"bob": 1}
    assert record["processes"] == {"r0s0": {"contribution_refused": 1}}
    assert json.loads((run / "security.json").read_text()) == record
    assert any("a frame of 99 bytes" in line for line in record["recent"])
