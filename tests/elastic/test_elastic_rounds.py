"""A DP strategy's rounds over an elastic quorum, without processes: the quorum's sum is played by
threads meeting at a barrier (``Quorum``), one per replica. The mean is over the contributors (a
spectator adds nothing and dilutes nothing); an update that does not commit is rolled back, and
its retry over the next quorum is exactly the round without the replica that left."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from meshlearn.dp.diloco import StreamingDiLoCo
from meshlearn.dp.powersgd import PowerSGD
from meshlearn.elastic.rollback import Rollback
from meshlearn.elastic.rounds import QuorumExchange
from meshlearn.mesh.topology import WorkerId


class Quorum:
    """The members' flat tensors summed in member order, in place, in every member's thread."""

    def __init__(self, members: list[int]):
        self.members = members
        self.parts: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(len(members))

    def reduce_for(self, member: int):
        def reduce(flat: torch.Tensor) -> None:
            self.parts[member] = flat.clone()
            self.barrier.wait()
            total = torch.stack([self.parts[m] for m in self.members]).sum(0)
            self.barrier.wait()
            flat.copy_(total)
        return reduce


def in_threads(jobs) -> None:
    errors = []

    def run(job):
        try:
            job()
        except Exception as e:  # noqa: BLE001 — re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a replica never reached the quorum's sum"


def replica(r: int, strategy: str, seed: int = 0) -> SimpleNamespace:
    """One stage replica: a small module (the same start everywhere), its optimizer, its strategy."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    me = WorkerId(r, 0)
    dp = (StreamingDiLoCo(me, 3, module, inner_steps=1, fragments=1, overlap=0, outer_lr=0.7,
                          outer_momentum=0.9, merge_weight=0.5, deadline_s=None, compress="none")
          if strategy == "diloco" else PowerSGD(me, 3, module, rank=2, seed=0))
    return SimpleNamespace(module=module, optimizer=optimizer, dp=dp, spectral=None, r=r)


def attach(worker, quorum: Quorum, contributes: bool = True) -> None:
    worker.dp.exchange = QuorumExchange(worker.dp.me, 3, quorum.reduce_for(worker.r))
    worker.dp.exchange.contributes = contributes


def backward(worker, u: int) -> None:
    """This replica's own data: a different gradient per replica and update."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * u + worker.r))
    worker.module(x).pow(2).sum().backward()


def update(worker, u: int, trains: bool = True) -> None:
    """One elastic update as ``ElasticDriver.update`` executes its actions (all stages committing)."""
    if trains:
        backward(worker, u)
    else:
        for p in worker.module.parameters():
            p.grad = torch.zeros_like(p)
    assert worker.dp.pre_step(u) == [] and worker.dp.pre_ready(u)
    if any(bool(p.grad.abs().sum()) for p in worker.module.parameters()):
        worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    assert worker.dp.post_step(u) == [] and worker.dp.post_wait(u) is None
    worker.dp.apply(u)
    if not trains:
        worker.dp.reset_local()


def state(worker) -> list[torch.Tensor]:
    dp = worker.dp
    extra = dp.outer + dp.momentum if isinstance(dp, StreamingDiLoCo) else list(dp.compressor.q.values())
    return [p.detach().clone() for p in worker.module.parameters()] + [t.clone() for t in extra]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("strategy", ["diloco", "powersgd"])
def test_a_spectator_takes_the_stage_update_and_dilutes_nothing(strategy):
    """Replica 0 trains; replica 1 spectates (healed: reset_local). Both end with the stage's state
    of a quorum of replica 0 alone: the same outer weights and momentum (DiLoCo) or the same
    weights and warm start (PowerSGD), and the spectator keeps no error feedback of its own."""
    alone = replica(0, strategy)
    attach(alone, Quorum([0]))
    for u in range(3):
        update(alone, u)
    pair = [replica(0, strategy), replica(1, strategy)]
    pair[1].dp.reset_local()
    quorum = Quorum([0, 1])
    attach(pair[0], quorum)
    attach(pair[1], quorum, contributes=False)
    in_threads([lambda w=w: [update(w, u, trains=w.r == 0) for u in range(3)] for w in pair])
    assert equal(state(pair[0]), state(alone))
    dp0, dp1 = pair[0].dp, pair[1].dp
    if strategy == "diloco":
        assert equal(dp1.outer + dp1.momentum, dp0.outer + dp0.momentum)
        assert equal([p.detach() for p in pair[1].module.parameters()], dp1.outer)  # θ_local = θ_outer
    else:
        assert equal(state(pair[1]), state(pair[0]))  # the same Ĝ every update: identical replicas
        assert dp0.compressor.error and dp1.compressor.error == {}


@pytest.mark.parametrize("strategy", ["diloco", "powersgd"])
def test_a_rolled_back_update_retried_without_the_dead_replica_is_the_survivors_round(strategy):
    """Update 1 runs over {0, 1} and does not commit (replica 1 died in it); replica 0 rolls back
    and runs update 1 again over {0}: bit for bit what a quorum of {0} alone gives from the same
    start — the dead replica is out of that round."""
    quorum = Quorum([0, 1])
    pair = [replica(0, strategy), replica(1, strategy)]
    for w in pair:
        attach(w, quorum)
    in_threads([lambda w=w: update(w, 0) for w in pair])
    survivor = pair[0]
    reference = replica(0, strategy)  # a copy (state_dicts alias the live tensors)
    reference.module.load_state_dict(survivor.module.state_dict())
    reference.optimizer.load_state_dict(copy.deepcopy(survivor.optimizer.state_dict()))
    reference.dp.load_state_dict(copy.deepcopy(survivor.dp.state_dict()))
    reference_before = state(reference)
    rollback = Rollback(survivor, weights=True)
    in_threads([lambda w=w: update(w, 1) for w in pair])
    assert not equal(state(survivor), reference_before)  # the failed attempt changed everything
    rollback.restore(survivor)
    assert equal(state(survivor), reference_before)
    attach(survivor, Quorum([0]))
    attach(reference, Quorum([0]))
    update(survivor, 1)
    update(reference, 1)
    assert equal(state(survivor), state(reference))
    assert survivor.dp.rounds == reference.dp.rounds


def test_a_round_is_the_sum_over_the_quorum_divided_by_its_contributors():
    exchange = QuorumExchange(WorkerId(0, 0), 3, lambda flat: flat.add_(torch.tensor([3.0, 5.0, 1.0])))
    exchange.share((0, 0), torch.tensor([1.0, 1.0]), 1)
    assert exchange.complete((0, 0)) and torch.equal(exchange.mean((0, 0)), torch.tensor([2.0, 3.0]))
    exchange.contributes = False  # a spectator: its part is not in the sum
    exchange.share((1, 0), torch.tensor([100.0, 100.0]), 2)
    assert torch.equal(exchange.mean((1, 0)), torch.tensor([3.0, 5.0]))
    assert exchange.open_keys() == [] and not exchange.means
