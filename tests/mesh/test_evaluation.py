"""Pipeline evaluation (mesh/evaluation.py) without any runtime: which passes run and the field
each fills, in the order a pipeline runs them; each stage's part of a pass (the message contexts its
ends code with, evaluation or masked as a training message); and the in-process chain of those parts
against the unsplit computation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshlearn.compress.codecs import Encoded, IdentityCodec, MessageContext
from meshlearn.mesh.evaluation import (
    EvalPass,
    StageEval,
    average_modules,
    eval_context,
    evaluation_plan,
    mean_loss,
    pipeline_loss,
    run_evaluation,
    run_plan,
)
from meshlearn.models.llama import Decoder


@pytest.mark.parametrize("drifts,masks,expected", [
    (False, False, [EvalPass("val_loss")]),
    (False, True, [EvalPass("val_loss"), EvalPass("val_loss_masked", masked=True)]),
    (True, False, [EvalPass("val_loss_replica0"), EvalPass("val_loss", averaged=True)]),
    (True, True, [EvalPass("val_loss_replica0"), EvalPass("val_loss", averaged=True),
                  EvalPass("val_loss_masked", averaged=True, masked=True)]),
])
def test_the_plan_names_each_pass_its_model_and_its_field(drifts, masks, expected):
    plan = evaluation_plan(drifts, masks)
    assert plan == expected
    seen = []
    loss, fields = run_plan(plan, lambda p: seen.append(p) or float(len(seen)))
    assert seen == plan  # executed in the plan's order: a pipeline's messages follow it
    assert loss == 1.0 + plan.index(EvalPass("val_loss", averaged=drifts))
    assert set(fields) == {p.field for p in plan} - {"val_loss"}


@pytest.mark.parametrize("drifts,replicas,masks,means", [
    (False, 2, True, 0), (True, 1, True, 0), (True, 2, False, 1), (True, 2, True, 1)])
def test_an_evaluation_builds_the_replicas_mean_once_and_only_where_several_drift(drifts, replicas, masks,
                                                                                  means):
    built, passes = [], []

    def loss(weights, masked: bool) -> float:
        passes.append((weights, masked))
        return float(len(passes))

    value, fields = run_evaluation(SimpleNamespace(drifts=drifts), replicas, masks, "own",
                                   lambda: built.append(1) or "mean", loss)
    assert len(built) == means  # the mean is a collective in dist: once per evaluation at most
    model = "mean" if means else "own"
    replica0 = [("own", False)] if means else []  # val_loss_replica0 first where replicas drift
    assert passes == [*replica0, (model, False), *([(model, True)] if masks else [])]
    assert value == passes.index((model, False)) + 1.0
    assert run_evaluation(None, replicas, False, "own", lambda: 1 / 0, lambda w, m: 2.0) == (2.0, {})


def test_a_pass_codes_a_boundary_as_evaluation_or_as_batch_i_s_training_message():
    assert eval_context(3, 1, masked=False) == MessageContext.evaluation(1)
    assert eval_context(3, 1, masked=True) == MessageContext(3, 0, 1, 0)


class Recording(IdentityCodec):
    """The identity codec, noting every context it codes with, and scaling what crosses (so a
    boundary skipped would change the loss)."""

    def __init__(self):
        self.contexts = []

    def encode(self, x, kind="act", ids=None, ctx=None):
        self.contexts.append(("encode", ctx))
        return Encoded({"x": 2 * x}, x.shape, x.dtype)

    def decode(self, message, kind="act", ctx=None):
        self.contexts.append(("decode", ctx))
        return message.tensors["x"]


def stages(n: int = 3, width: int = 5) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(width, width) for _ in range(n)]


@pytest.mark.parametrize("masked_as", [None, 4])
def test_the_stages_parts_chain_into_the_pipeline_with_both_ends_on_one_context(masked_as):
    parts, codec = stages(), Recording()
    x, y = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    h = x
    for part in parts:
        h = 2 * part(h) if part is not parts[-1] else part(h)
    assert pipeline_loss(parts, codec, x, y, masked_as) == pytest.approx(Decoder.loss(h, y).item())
    boundaries = [eval_context(masked_as or 0, b, masked_as is not None) for b in range(len(parts) - 1)]
    assert codec.contexts == [(end, ctx) for ctx in boundaries for end in ("encode", "decode")]


def test_a_stage_part_knows_its_ends_and_codes_as_its_pass_says():
    codec = Recording()
    first, middle, last = (StageEval(s, 3, codec, masked=True) for s in range(3))
    assert first.is_first and not first.is_last and last.is_last and not middle.is_first
    out = torch.ones(2)
    assert torch.equal(middle.arrive(first.leave(out, None, 7), 7), 2 * out)
    assert codec.contexts == [("encode", MessageContext(7, 0, 0, 0)), ("decode", MessageContext(7, 0, 0, 0))]


def test_mean_loss_codes_batch_i_as_step_i_when_masked_and_averaging_is_the_replicas_mean():
    codec = Recording()
    batches = [(torch.randn(1, 2, 5), torch.randint(0, 5, (1, 2))) for _ in range(3)]
    mean_loss(stages(2), codec, batches, masked=True)
    assert [ctx.step for end, ctx in codec.contexts if end == "encode"] == [0, 1, 2]
    a, b = stages(1)[0], torch.nn.Linear(5, 5)
    mean = average_modules([a, b])
    assert torch.equal(mean.weight, (a.weight + b.weight) / 2) and mean is not a
