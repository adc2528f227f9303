"""The driver contract (mesh/driver.py): the simulator answers it and offers exactly its
capabilities; the plugins' services are the trainer's own data and the driver's clock and
channel."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config

from meshlearn.compress.codecs import Encoded
from meshlearn.data import global_batch
from meshlearn.mesh.driver import (
    ControlChannel,
    DataPlan,
    Driver,
    Membership,
    MessageMonitors,
    TimeModels,
)
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer
from meshlearn.verify.capabilities import Evictor, RemoteVerdicts


@pytest.fixture
def trainer(tiny_corpus, tmp_path) -> Trainer:
    return Trainer(tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2"), tmp_path, progress=False)


def test_the_simulator_answers_the_contract_with_its_own_capabilities_only(trainer):
    driver = trainer.driver
    assert isinstance(driver, Driver)
    offered = {cap.__name__ for cap in (ControlChannel, DataPlan, Membership, MessageMonitors, TimeModels,
                                        RemoteVerdicts, Evictor) if isinstance(driver, cap)}
    assert offered == {"ControlChannel", "MessageMonitors", "TimeModels"}
    assert not isinstance(object(), Driver)  # the check looks at members, not at everything


def test_plugins_get_the_trainers_batches_and_the_drivers_clock_and_channel(trainer):
    ctx = trainer._plugin_context(None)
    cfg, train = trainer.cfg, trainer.corpus.splits.train
    x, y = ctx.data.batch(2)
    ex, ey = global_batch(train, 2, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
    assert torch.equal(x, ex) and torch.equal(y, ey)
    assert ctx.data.batch(-1, 3)[0].shape == (3, cfg.model.seq_len)  # a probe batch of its own size
    work = trainer.work(2)
    for r in range(cfg.mesh.replicas):  # replica r's microbatches, exactly as the trainer hands them out
        handed = work[WorkerId(r, 0)].tokens
        assert all(torch.equal(a, mx) for a, (mx, _) in zip(handed, ctx.data.microbatches_of(2, 2, r),
                                                            strict=True))
    assert ctx.clock is trainer.driver.clock and ctx.clock.virtual
    assert ctx.control is trainer.driver and ctx.time_models is trainer.driver


def test_a_control_message_crosses_its_link_and_a_missing_one_is_named(trainer):
    driver, src, dst = trainer.driver, WorkerId(0, 0), WorkerId(0, 1)
    payload = Encoded({"transform": torch.eye(4, dtype=torch.float64)}, (4, 4), torch.float64)
    sent = Message("morph", 0, 0, src, dst, payload)
    driver.send_control(sent)
    assert driver.clock.worker_s(dst) > driver.clock.worker_s(src)  # it waited for the arrival
    assert driver.receive_control(src, "morph", "the boundary transform") is sent
    with pytest.raises(RuntimeError, match="waited for the boundary transform from r0s0 at a drain point"):
        driver.receive_control(src, "morph", "the boundary transform")
