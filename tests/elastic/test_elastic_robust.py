"""``dp.robust`` under elastic membership (``elastic.membership = "control"``, issue 32): every
member gathers every contribution of its stage's quorum and reduces the contributors' parts with
the rule, so replicas stay identical; a replica that attacks its DP contribution is outvoted and
reported; under torchft's membership the rule is refused in one line."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_helpers import deadline, kill_leftovers, launch, launch_and_signal, records, tensors  # noqa: E402
from tiny import tiny_config  # noqa: E402

from meshlearn.dp.attribution import OutlierLedger  # noqa: E402
from meshlearn.dp.robust import Robust  # noqa: E402
from meshlearn.elastic.counts import COUNTS, check_counts  # noqa: E402
from meshlearn.elastic.quorum import QuorumStep  # noqa: E402
from meshlearn.elastic.records import ElasticRecords  # noqa: E402
from meshlearn.elastic.rounds import QuorumExchange, reduce_contributions  # noqa: E402
from meshlearn.elastic.stage_reduce import StageReduce  # noqa: E402
from meshlearn.errors import ConfigError  # noqa: E402
from meshlearn.mesh.topology import MeshShape, WorkerId  # noqa: E402
from meshlearn.statefile import load_state  # noqa: E402

STEPS = 6
# D = 3 replicas of one stage (3 processes): D >= 3 leaves the ends untrusted, so r1s0 may attack.
BASE = ["backend=dist", "mesh.replicas=3", "mesh.microbatches=1", "train.batch_size=12",
        f"train.steps={STEPS}", f"train.checkpoint_every={STEPS}", "dist.timeout_s=5", "dist.dead_after_s=2",
        "elastic.enabled=true", "elastic.membership=control"]
ATTACK = ["attack.kind=scaling", "attack.scale=-4", "attack.workers=r1s0", "attack.target=dp",
          "attack.start_step=1"]
WORKERS = ("r0s0", "r1s0", "r2s0")


def honest(d: int, n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) + 0.1 * torch.randn(d, n, generator=g)


# --- the reduce every member computes ------------------------------------------------------------

@pytest.mark.parametrize("rule", ["trimmed_mean", "median", "centered_clip"])
def test_every_rule_is_the_plain_mean_when_the_contributors_agree_and_spectators_do_not_count(rule):
    x = honest(1)[0]
    parts = [x.clone(), torch.zeros_like(x), x.clone(), x.clone()]  # replica 1 spectates: zeros
    flags = [True, False, True, True]
    aggregate, scores = reduce_contributions(parts, flags, Robust(rule))
    mean, _ = reduce_contributions(parts, flags, Robust("none"))
    assert torch.allclose(aggregate, mean, rtol=0, atol=1e-6) and torch.allclose(mean, x, rtol=0, atol=1e-6)
    assert scores == [0.0, 0.0, 0.0]  # one per contributor, all on the aggregate


def test_an_outlier_among_four_is_ignored_and_scored_below_a_majority_nothing_is():
    parts = list(honest(4))
    clean = Robust("median").reduce(torch.stack(parts[:1] + parts[2:]))
    parts[1] = -4 * parts[1]
    aggregate, scores = reduce_contributions(parts, [True] * 4, Robust("median"))
    assert (aggregate - clean).norm() < 0.1 * clean.norm()
    assert max(range(4), key=scores.__getitem__) == 1 and scores[1] > 10
    _, two = reduce_contributions(parts, [True, True, False, False], Robust("median"))
    assert two is None  # two contributors: no majority, nobody is attributed


def test_a_quorum_round_with_a_robust_rule_reduces_the_gathered_contributors():
    """``QuorumExchange`` with a rule: the mean of a round is the rule's aggregate of the parts
    every member gathered (flags beside them), and the contributors' scores are handed on."""
    parts = list(honest(3))
    parts[2] = -4 * parts[2]
    flags = [1.0, 1.0, 1.0]
    seen = []

    def gather(flat: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([p, p.new_tensor([f])]) if r != 0 else flat
                for r, (p, f) in enumerate(zip(parts, flags, strict=True))]

    exchange = QuorumExchange(WorkerId(0, 0), 3, lambda flat: None, gather, Robust("median"),
                              lambda f, s: seen.append((f, s)))
    exchange.share((0, 0), parts[0], 0)
    expected, scores = reduce_contributions(parts, [True] * 3, Robust("median"))
    assert exchange.complete((0, 0)) and torch.equal(exchange.mean((0, 0)), expected)
    assert seen == [([True] * 3, scores)]


# --- the counts beside each contribution, checked against the row agreement ------------------------

B = 12
ROWS3 = ((0,), (1,), (2,))  # P = 1 × D = 3: every replica's row trains, 4 sequences each
MEMBERS3 = [WorkerId(r, 0) for r in range(3)]


def _sent(loss: float = 5.0) -> list[float]:
    """An honest trainer's counts at P = 1, one microbatch: its loss, one loss, a contribution,
    its row's share of the batch."""
    return [loss, 1.0, 1.0, B / 3]


@pytest.mark.parametrize("lie", [("sequences", 3, B / 3 + 1), ("NaN sequences", 3, math.nan),
                                 ("flag", 2, 2.0), ("loss count", 1, 2.0)])
def test_a_member_whose_counts_the_agreement_contradicts_is_a_liar_and_the_stage_still_says_yes(lie):
    _, at, value = lie
    sent = [_sent(4.0), _sent(5.0), _sent(6.0)]
    sent[1][at] = value
    checked = check_counts(sent, MEMBERS3, ROWS3, B, 1, last_stage=True)
    assert checked.liars == [WorkerId(1, 0)] and checked.contributes == [True, False, True]
    assert checked.whole and checked.loss == 5.0  # the two honest members' median


def test_a_spectator_claiming_a_share_or_a_middle_stage_sending_a_loss_is_a_liar():
    two = [5.0, 1.0, 1.0, B / 2]  # two agreed rows: 6 sequences each
    spectating = check_counts([two, two, [0.0, 1.0, 1.0, B / 2]], MEMBERS3, ((0,), (1,)), B, 1, True)
    assert spectating.liars == [WorkerId(2, 0)] and spectating.whole
    middle = [[0.0, 0.0, 1.0, 4.0], [3.0, 0.0, 1.0, 4.0], [0.0, 0.0, 1.0, 4.0]]
    checked = check_counts(middle, MEMBERS3, ((0, 0), (1, 1), (2, 2)), B, 1, last_stage=False)
    assert checked.liars == [WorkerId(1, 0)] and checked.whole and checked.loss is None


def test_a_withdrawn_member_is_no_liar_and_its_stage_says_no_a_liars_loss_moves_nothing():
    """A member of an agreed row that sends no contribution (its partner died mid-step) is honest:
    the batch is not whole, the step commits nowhere (as before). One member's loss sum cannot
    move the loss shown past an honest one's: the median of the contributors' means."""
    withdrawn = check_counts([_sent(), [0.0, 0.0, 0.0, 0.0], _sent()], MEMBERS3, ROWS3, B, 1, True)
    assert not withdrawn.whole and not withdrawn.liars and withdrawn.contributes == [True, False, True]
    loud = check_counts([_sent(4.0), _sent(1e9), _sent(6.0)], MEMBERS3, ROWS3, B, 1, True)
    assert loud.whole and not loud.liars and loud.loss == 6.0
    missing = check_counts([_sent(), _sent()], MEMBERS3[:2], ROWS3, B, 1, True)  # row 2's member absent
    assert not missing.whole


class _Quorum:
    """A stage's quorum at P = 1 × D = 3 whose gather answers ``parts``."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts

    def member_workers(self) -> list[WorkerId]:
        return MEMBERS3

    def gather(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return self.parts


def _robust_stage(parts: list[torch.Tensor]) -> StageReduce:
    """The elastic driver's stage reduce of a last stage at P = 1 × D = 3, its gather answering
    ``parts`` (r0s0's own contribution is ``parts[0]``)."""
    worker = SimpleNamespace(flat_gradients=lambda: parts[0][:-COUNTS])
    worker.set_flat_gradients = lambda flat: setattr(worker, "aggregate", flat)
    stage = StageReduce(worker, _Quorum(parts), SimpleNamespace(hold_gather=lambda *args: None),
                        WorkerId(0, 0), True, B, 1)
    stage.begin(QuorumStep(participants=3, quorum_s=0.0), ROWS3, 0, True)
    return stage


def test_a_member_lying_about_its_counts_under_a_robust_rule_cannot_stop_commits_and_is_reported():
    """r1s0 sends honest gradients and a sequence count off by one at every step. Summed, its
    counts made the stage say no at every step, unreported; checked against the agreement, the
    stage says yes, the rule reduces the two honest members' gradients, r1s0 scores ∞ and the
    attribution ledger reports it at its third step."""
    ledger, reports = OutlierLedger(threshold=3.0), []
    for step in range(3):
        grads = list(honest(3, seed=step))
        counts = [_sent(4.0 + r) for r in range(3)]
        counts[1][3] += 1
        stage = _robust_stage([torch.cat([g, g.new_tensor(c)]) for g, c in zip(grads, counts, strict=True)])
        loss = stage.robustly(counts[0], Robust("median"))
        assert stage.current.mean_ok and loss == 5.0
        expected, _ = reduce_contributions(grads, [True, False, True], Robust("median"))
        assert torch.equal(stage.worker.aggregate, expected)
        assert stage.scores == {"r1s0": math.inf}  # two honest contributors: no majority to score
        reports += ledger.observe(step, {w: [s] for w, s in stage.scores.items()})
    assert [(r["worker"], r["step"]) for r in reports] == [("r1s0", 3)]


def test_a_quorum_round_leaves_out_the_members_whose_counts_lied():
    parts = list(honest(3))
    seen = []
    exchange = QuorumExchange(WorkerId(0, 0), 3, lambda flat: None,
                              lambda flat: [torch.cat([p, p.new_tensor([1.0])]) for p in parts],
                              Robust("median"), lambda f, s: seen.append(f))
    exchange.left_out = frozenset({1})
    exchange.share((0, 0), parts[0], 0)
    expected, _ = reduce_contributions(parts, [True, False, True], Robust("median"))
    assert torch.equal(exchange.mean((0, 0)), expected) and seen == [[True, False, True]]


def test_a_report_of_a_stage_that_is_not_the_last_is_witnessed(tmp_path):
    """Only a last stage writes metrics.jsonl; a DP outlier report of another stage goes to the
    witness (the driver's membership event, workers.json) instead, other records nowhere."""
    witnessed = []
    sink = ElasticRecords(dist.HashStore(), MeshShape(3, 2), WorkerId(0, 0), lambda: (),
                          witness=witnessed.append)
    sink.attach(tmp_path / "metrics.jsonl")
    report = {"kind": "dp_outlier", "step": 4, "worker": "r1s0", "score": 9.0, "count": 3}
    sink.write(3, {"kind": "train", "step": 4})
    sink.write(3, report)
    assert witnessed == [report] and not (tmp_path / "metrics.jsonl").exists()


def test_torchft_membership_refuses_a_robust_rule_in_one_line(tiny_corpus):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *BASE, "elastic.membership=torchft", "dp.robust=median")
    assert err.value.key == "dp.robust" and "\n" not in str(err.value) and "control" in str(err.value)


# --- real processes --------------------------------------------------------------------------------

def _weights(run: Path, name: str) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"step-{STEPS:06d}"
    return load_state(folder / f"{name}.pt")["workers"][name]["module"]


def _launch(cfg, tmp_path: Path, sets: dict[str, list[str]]) -> dict[str, Path]:
    runs = {name: tmp_path / name for name in sets}
    try:
        with deadline(60 * len(runs), "the elastic runs"):
            for name, run in runs.items():
                assert launch(cfg, run, *sets[name]) == 0, name
    finally:
        for run in runs.values():
            kill_leftovers(run)
    return runs


def test_an_elastic_dp_attacker_is_outvoted_and_reported_and_the_replicas_stay_identical(tiny_corpus,
                                                                                        tmp_path):
    """3 replicas, control membership, the median: r1s0 scaling its DP contribution by −4 is
    reported (not evicted: elastic reports only) at its third attacked step (step 4: start_step 1
    is the second step), its stage's three replicas end bit-identical; in the clean run nobody is
    reported."""
    runs = _launch(tiny_config(tiny_corpus, *BASE), tmp_path,
                   {"clean": ["dp.robust=median"], "attacked": [*ATTACK, "dp.robust=median"]})
    assert all(r["committed"] for run in runs.values() for r in records(run))
    weights = {w: _weights(runs["attacked"], w) for w in WORKERS}
    for key, tensor in weights["r0s0"].items():
        assert all(torch.equal(tensor, weights[w][key]) for w in WORKERS[1:]), key
    reports = records(runs["attacked"], "dp_outlier")
    assert [(r["worker"], r["step"], r["evicted"]) for r in reports] == [("r1s0", 4, False)]
    assert not records(runs["clean"], "dp_outlier")
    assert max(r["dp_score_max"] for r in records(runs["clean"])) < 3
    assert min(r["dp_score_max"] for r in records(runs["attacked"])[1:5]) > 3


@pytest.mark.slow
def test_the_robust_rule_keeps_an_elastic_run_near_clean_and_charges_the_gather(tiny_corpus, tmp_path):
    """Four elastic runs of 3 replicas: clean and r1s0 attacking (×−4), each with the mean and
    with the median. The attack moves the mean's run far; under the median it ends near the
    clean runs. The median's DP bytes per step are the all-gather's."""
    runs = _launch(tiny_config(tiny_corpus, *BASE), tmp_path,
                   {"clean": [], "clean_median": ["dp.robust=median"], "mean": ATTACK,
                    "median": [*ATTACK, "dp.robust=median"]})
    loss = {name: records(run)[-1]["train_loss"] for name, run in runs.items()}
    gap = abs(loss["mean"] - loss["clean"])
    assert abs(loss["median"] - loss["clean_median"]) < 0.1 * gap
    assert abs(loss["median"] - loss["clean"]) < 0.1 * gap
    assert not records(runs["mean"], "dp_outlier") and "dp_score_max" not in records(runs["clean"])[0]
    # a step's bytes_dp: with the median each member sends its N bytes to the D − 1 = 2 others,
    # the link model's all-gather, instead of the ring's 2(D − 1)/D·N (each counted once)
    per_step = {name: records(runs[name])[0]["bytes_dp"] for name in ("clean", "clean_median")}
    assert 2 * per_step["clean_median"] == 3 * per_step["clean"]  # 2·N against 4/3·N


STRATEGIES = {"sparse": ["dp.name=sparse", "dp.fraction=0.5", "dp.delay=0"],
              "powersgd": ["dp.name=powersgd", "dp.rank=2"],
              "diloco": ["dp.name=diloco", "dp.inner_steps=1"]}


def _common(run: Path, strategy: str, name: str):
    """What the replicas of a stage hold alike under ``strategy``: PowerSGD's weights (every update
    applies the same aggregate), DiLoCo's outer weights; sparse averaging keeps nothing alike
    (each replica's weights drift between its slices' rounds): None."""
    state = load_state(run / "checkpoints" / f"step-{STEPS:06d}" / f"{name}.pt")["workers"][name]
    if strategy == "sparse":
        return None
    return state["module"] if strategy == "powersgd" else state["dp"]["outer"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_message_strategy_reduces_its_quorum_rounds_robustly(tiny_corpus, tmp_path, strategy):
    """Each message strategy's rounds under the median (``QuorumExchange`` gathering): r1s0,
    scaling its part of every round by −4, is reported at its third attacked step, and what the
    strategy keeps alike is bit-identical on the stage's three replicas."""
    run = _launch(tiny_config(tiny_corpus, *BASE, *STRATEGIES[strategy]), tmp_path,
                  {"attacked": [*ATTACK, "dp.robust=median"]})["attacked"]
    assert all(r["committed"] for r in records(run))
    assert [(r["worker"], r["step"]) for r in records(run, "dp_outlier")] == [("r1s0", 4)]
    common = {w: _common(run, strategy, w) for w in WORKERS}
    if common["r0s0"] is not None:
        mine = list(tensors(common["r0s0"]))
        for w in WORKERS[1:]:
            theirs = list(tensors(common[w]))
            assert len(theirs) == len(mine) > 0 and all(map(torch.equal, mine, theirs)), w


@pytest.mark.slow
def test_a_member_killed_under_a_robust_rule_leaves_and_two_go_on_unscored(tiny_corpus, tmp_path):
    """r2s0 SIGKILLed after two committed steps under the median: its stage's gather fails like the
    sum (the step commits nowhere, its batch is trained again), the two others go on, reduced by
    the rule over two contributors (their mean), and nobody is scored any more: no majority."""
    cfg = tiny_config(tiny_corpus, *BASE, "train.steps=8", "train.checkpoint_every=0", "dp.robust=median")
    run = tmp_path / "run"
    assert launch_and_signal(cfg, run, "r2s0", signal.SIGKILL, 120) == 0
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[-1]["rows"] == [0, 1]
    committed = [r for r in rows if r["committed"]]
    assert len(rows) - len(committed) <= 2 and all(math.isfinite(r["train_loss"]) for r in committed)
    assert [r["batch"] for r in committed] == list(range(len(committed)))
    three = [r for r in committed if r["rows"] == [0, 1, 2]]
    two = [r for r in committed if r["rows"] == [0, 1]]
    assert three and two and all("dp_score_max" in r for r in three)
    assert not any("dp_score_max" in r for r in two) and not records(run, "dp_outlier")
