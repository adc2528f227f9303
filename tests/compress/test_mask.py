"""The mask codec: both ends derive one mask from the message, only kept values travel, and the
pipeline's backward is autograd's through h ↦ h ⊙ m (an unsplit model with the mask as a hook is
the oracle)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config

from meshlearn.compress import CodecConfig, MaskCodec, MessageContext, build_codec
from meshlearn.compress.prf import grid32, key32, mix32, mul32
from meshlearn.data import global_batch, shard_batch
from meshlearn.errors import ConfigError
from meshlearn.jsonl import read_records
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, DecoderConfig, init_model, merge_stages
from meshlearn.optim import build_optimizer
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.train import Trainer

B, T, D = 3, 8, 40
CTX = MessageContext(step=7, microbatch=2, boundary=1, replica=1)


def mask_codec(keep: float = 0.25, **options) -> MaskCodec:
    return build_codec(CodecConfig(name="mask", keep=keep, **options), DecoderConfig(vocab_size=8, d_model=D))


@pytest.fixture
def x():
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))


def test_the_prf_is_exact_32_bit_arithmetic_on_ints_and_tensors():
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 2**32, (1000,), generator=gen, dtype=torch.int64)
    c = 0x85EBCA6B
    assert torch.equal(mul32(a, c), torch.tensor([v * c % 2**32 for v in a.tolist()]))
    assert [mix32(v) for v in a[:20].tolist()] == mix32(a[:20]).tolist()  # one function, two kinds
    assert key32(1, 0) != key32(1) and key32(2**40) != key32(0)  # word count and high words count
    u = grid32(key32(3), (2, 4, D))
    assert u.dtype == torch.int64 and u.min() >= 0 and u.max() < 2**32
    assert (u.sort(dim=-1).values.diff(dim=-1) > 0).all()  # distinct per token: ranking never ties


def test_both_ends_regenerate_the_mask_and_only_kept_values_travel(x):
    sender, receiver = mask_codec(), mask_codec()  # two instances: nothing shared but the config
    message = sender.encode(x, "act", ctx=CTX)
    assert list(message.tensors) == ["values"]  # no indices on the wire
    assert message.tensors["values"].shape == (B, T, 10) and message.tensors["values"].dtype == torch.bfloat16
    out = receiver.decode(message, "act", ctx=CTX)
    m = sender.mask(x.shape, CTX)
    assert torch.equal(m, receiver.mask(x.shape, CTX))
    assert torch.equal(out, (x * m).to(torch.bfloat16).float())  # scatter(gather(h)) = h ⊙ m
    assert torch.equal(out != 0, m)


def test_fixed_form_keeps_exactly_round_keep_d_channels_per_token_and_costs_exactly_them(x):
    for keep, kept in [(0.1, 4), (0.05, 2), (0.25, 10), (1.0, 40)]:
        codec = mask_codec(keep, wire_dtype="fp16")
        assert (codec.mask(x.shape, CTX).sum(-1) == kept).all()
        assert codec.encode(x, "act", ctx=CTX).wire_bytes == B * T * kept * 2
        assert codec.encode(x, "grad", ctx=CTX).wire_bytes == B * T * kept * 2


def test_bernoulli_form_keeps_each_channel_with_probability_keep():
    codec = mask_codec(0.1, mask="bernoulli")
    shape = (16, 64, D)
    m = codec.mask(shape, CTX)
    n, p = m.numel(), 0.1
    assert abs(m.sum().item() - n * p) <= 4 * (n * p * (1 - p)) ** 0.5
    per_token = m.sum(-1)
    assert per_token.min() < per_token.max()  # counts vary: no fixed budget in this form
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    message = codec.encode(x, "act", ctx=CTX)
    assert message.wire_bytes == 2 * int(m.sum())
    assert torch.equal(codec.decode(message, "act", ctx=CTX), (x * m).to(torch.bfloat16).float())


def test_channels_are_kept_uniformly():
    m = mask_codec(0.25).mask((64, 64, D), CTX).float()
    rate = m.mean(dim=(0, 1))  # per channel, over 4096 tokens
    sd = (0.25 * 0.75 / 4096) ** 0.5
    assert (rate - 0.25).abs().max() <= 5 * sd


@pytest.mark.parametrize("field", ["step", "microbatch", "boundary", "replica"])
def test_every_key_field_changes_the_mask(field):
    codec = mask_codec()
    base = codec.mask((B, T, D), CTX)
    other = MessageContext(**{**CTX.__dict__, field: getattr(CTX, field) + 1})
    changed = codec.mask((B, T, D), other)
    # Independent masks of keep 1/4 differ on 2·(1/4)·(3/4) of the entries; allow a wide margin.
    assert 0.25 < (base != changed).float().mean() < 0.5


def test_rows_positions_and_the_seed_change_the_mask():
    m = mask_codec().mask((4, 16, D), CTX)
    rows = (m[0] != m[1]).float().mean()
    positions = (m[:, 0] != m[:, 1]).float().mean()
    assert rows > 0.2 and positions > 0.2
    assert not torch.equal(m, mask_codec(seed=1).mask((4, 16, D), CTX))


def test_the_backward_is_masked_with_the_forwards_mask(x):
    """The receiver sends back the kept entries of ∂L/∂h̃ under the same context; the sender
    scatters them: m ⊙ ∂L/∂h̃, which is autograd's gradient through h ↦ h ⊙ m."""
    codec = mask_codec(wire_dtype="fp32")
    h = x.clone().requires_grad_(True)
    m = codec.mask(x.shape, CTX)
    weights = torch.randn(D, generator=torch.Generator().manual_seed(3))
    ((h * m) * weights).pow(2).sum().backward()
    received = codec.decode(codec.encode(x, "act", ctx=CTX), "act", ctx=CTX).requires_grad_(True)
    (received * weights).pow(2).sum().backward()
    back = codec.decode(codec.encode(received.grad, "grad", ctx=CTX), "grad", ctx=CTX)
    assert torch.equal(back, h.grad)
    assert torch.equal(back != 0, m & (received.grad != 0))


def test_rescale_multiplies_both_directions_by_d_over_k(x):
    codec = mask_codec(0.25, wire_dtype="fp32", rescale=True)
    m = codec.mask(x.shape, CTX)
    for kind in ("act", "grad"):
        assert torch.allclose(codec.decode(codec.encode(x, kind, ctx=CTX), kind, ctx=CTX), x * m * 4.0)


def test_a_codec_derives_each_mask_once_for_both_directions(x, monkeypatch):
    """The forward's encode and the backward's decode of one message share one derivation."""
    import meshlearn.compress.mask as mask_module

    calls = []
    real = mask_module.grid32
    monkeypatch.setattr(mask_module, "grid32", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    codec = mask_codec()
    codec.decode(codec.encode(x, "act", ctx=CTX), "grad", ctx=CTX)
    assert len(calls) == 1
    codec.encode(x, "act", ctx=MessageContext(**{**CTX.__dict__, "microbatch": 0}))
    assert len(calls) == 2 and calls[0] != calls[1]


def test_masking_is_off_for_evaluation_messages(x):
    codec = mask_codec(wire_dtype="fp32")
    ctx = MessageContext.evaluation(boundary=1)
    message = codec.encode(x, "act", ctx=ctx)
    assert message.wire_bytes == x.numel() * 4 and torch.equal(codec.decode(message, "act", ctx=ctx), x)


def test_a_message_without_its_context_is_refused(x):
    with pytest.raises(ValueError, match="needs its MessageContext"):
        mask_codec().encode(x, "act")


def test_decoded_values_land_on_the_contexts_device(x):
    codec = mask_codec()
    message = codec.encode(x, "act", ctx=CTX)
    ctx = MessageContext(**{**CTX.__dict__, "device": torch.device("meta")})
    assert codec.decode(message, "act", ctx=ctx).device.type == "meta"


@pytest.mark.parametrize(("override", "hint"), [
    ("codec.keep=0", "codec.keep = 0.0: a fraction of the channels in (0, 1]"),
    ("codec.keep=1.5", "codec.keep = 1.5: a fraction of the channels in (0, 1]"),
    ("codec.keep=0.01", "codec.keep = 0.01: keeps round(0.01 * model.d_model = 32) = 0 channels"),
    ("codec.mask=topk", "codec.mask = 'topk': allowed: ['fixed', 'bernoulli']"),
])
def test_bad_mask_settings_are_refused_with_one_line(tiny_corpus, override, hint):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, "codec.name=mask", override)
    assert str(err.value).startswith(hint) and "\n" not in str(err.value)


# --- in the mesh -------------------------------------------------------------------------------

MESH = ["mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b", "codec.name=mask", "codec.keep=0.25",
        "codec.wire_dtype=fp32", "codec.seed=5"]


def masked_reference(trainer: Trainer, steps: int,
                     gradient_only: bool = False) -> tuple[list[float], Decoder]:
    """The unsplit model, each microbatch's boundary activation multiplied by the mask of its
    (step, microbatch, boundary 0, replica) as a forward hook: autograd does the masked backward.
    ``gradient_only``: the activation passes unchanged and only its gradient is multiplied by the
    mask (and the codec's rescale factor) of ``codec.backward``."""
    cfg = trainer.cfg
    codec = build_codec(cfg.codec, cfg.model)
    model = init_model(cfg.model, cfg.seed)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr, cfg.train.steps)
    boundary_layer = model.layers[str(cfg.model.n_layer // cfg.mesh.stages - 1)]
    current: list[MessageContext] = []

    def gradient_mask(out: torch.Tensor) -> torch.Tensor:
        back, ctx = codec.backward, current[0]
        out.register_hook(lambda grad: grad * back.mask(grad.shape, ctx) * back.scale)
        return out

    boundary_layer.register_forward_hook(lambda mod, args, out: gradient_mask(out) if gradient_only
                                         else out * codec.mask(out.shape, current[0]))
    losses = []
    for t in range(steps):
        x, y = global_batch(trainer.corpus.splits.train, t, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
        shards = shard_batch(x, y, cfg.mesh.replicas, cfg.mesh.microbatches)
        step_losses = []
        for r, micro in enumerate(shards):
            for m, (xm, ym) in enumerate(micro):
                current[:] = [MessageContext(t, m, 0, r)]
                loss = Decoder.loss(model(xm), ym)
                (loss / (cfg.mesh.replicas * cfg.mesh.microbatches)).backward()
                step_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=False)
        factor = lr_factor(t, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / len(step_losses))
    return losses, model


def test_the_masked_pipeline_equals_the_unsplit_model_with_the_mask_as_a_hook(tiny_corpus, tmp_path):
    """Forward and backward both: the same losses and, after 3 steps, the same weights."""
    trainer = Trainer(tiny_config(tiny_corpus, *MESH), tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = masked_reference(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    states = [trainer.workers[WorkerId(1, s)].module.state_dict() for s in range(2)]
    merged = merge_stages(trainer.cfg.model, states).state_dict()
    reference = ref_model.state_dict()
    assert max((merged[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5


@pytest.mark.parametrize("form", ["fixed", "bernoulli"])
def test_a_backward_only_mask_equals_the_unsplit_model_with_the_mask_on_the_gradient(tiny_corpus, tmp_path,
                                                                                    form):
    """codec.backward.name = mask under codec.name = identity: activations cross whole, gradients
    masked and rescaled; the mesh equals the unsplit model whose boundary gradient is multiplied by
    (d/K)·m (a gradient hook), to 1e-5 in losses and weights after 3 steps."""
    mesh = [*MESH, "codec.name=identity", "codec.backward.name=mask", "codec.backward.keep=0.25",
            f"codec.backward.mask={form}"]
    trainer = Trainer(tiny_config(tiny_corpus, *mesh), tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = masked_reference(trainer, 3, gradient_only=True)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    states = [trainer.workers[WorkerId(1, s)].module.state_dict() for s in range(2)]
    merged = merge_stages(trainer.cfg.model, states).state_dict()
    reference = ref_model.state_dict()
    assert max((merged[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5
    cfg = trainer.cfg
    micro, per_token = cfg.train.batch_size // 2 // cfg.mesh.microbatches, cfg.model.d_model * 4  # fp32
    messages = 3 * 2 * cfg.mesh.microbatches * micro * cfg.model.seq_len  # steps × replicas × tokens
    if form == "fixed":  # whole activations one way, exactly K = d/4 values a token back
        assert trainer.totals.bytes_pp == messages * (per_token + per_token // 4)


def test_the_simulator_charges_exactly_the_kept_values(tiny_corpus, tmp_path):
    """bytes_pp = steps × replicas × boundaries × microbatches × 2 directions × b·T·K·2 (bf16)."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=4", "mesh.replicas=2", "codec.name=mask",
                      "codec.keep=0.25", "train.steps=2")
    trainer = Trainer(cfg, tmp_path, progress=False)
    trainer.train()
    micro = cfg.train.batch_size // 2 // cfg.mesh.microbatches
    per_message = micro * cfg.model.seq_len * round(0.25 * cfg.model.d_model) * 2
    assert trainer.totals.bytes_pp == 2 * 2 * 3 * cfg.mesh.microbatches * 2 * per_message


def test_evaluation_is_unmasked(tiny_corpus, tmp_path):
    """The validation loss of a mask-codec run is the unsplit model's, on the run's own weights; its
    eval record's ``val_loss_masked`` is that model with validation batch i's boundary masked as
    microbatch 0 of step i on replica 0 (open detail 7); a bf16 run's record has no such field."""
    cfg = tiny_config(tiny_corpus, *MESH, "train.steps=2", "train.eval_every=2")
    trainer = Trainer(cfg, tmp_path / "mask", progress=False)
    trainer.train()
    states = [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(2)]
    merged = merge_stages(trainer.cfg.model, states)
    codec = build_codec(cfg.codec, cfg.model)
    with torch.no_grad():
        dense = [Decoder.loss(merged(x), y).item() for x, y in trainer.val_batches]
        batch = [0]
        merged.layers[str(cfg.model.n_layer // 2 - 1)].register_forward_hook(
            lambda mod, args, out: out * codec.mask(out.shape, MessageContext(batch[0], 0, 0, 0)))
        masked = []
        for i, (x, y) in enumerate(trainer.val_batches):
            batch[0] = i
            masked.append(Decoder.loss(merged(x), y).item())
    assert abs(trainer.last_val_loss - sum(dense) / len(dense)) <= 1e-6
    record = [r for r in read_records(tmp_path / "mask" / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert abs(record["val_loss_masked"] - sum(masked) / len(masked)) <= 1e-5
    assert abs(record["val_loss_masked"] - record["val_loss"]) > 1e-3
    bf16 = Trainer(tiny_config(tiny_corpus, *MESH, "codec.name=bf16"), tmp_path / "bf16", progress=False)
    bf16.evaluate()
    assert "val_loss_masked" not in read_records(tmp_path / "bf16" / "metrics.jsonl")[-1]


@pytest.mark.parametrize("options", ["codec.mask=fixed", "codec.mask=bernoulli", "codec.rescale=true"])
def test_keep_one_is_the_dense_bf16_run_exactly(tiny_corpus, tmp_path, options):
    """keep = 1 masks nothing: every loss and every weight of an async P = 4, D = 2 run equal
    those of the bf16 codec's run bit for bit (a dropped channel or a scale ≠ 1 would show)."""
    mesh = ["mesh.stages=4", "mesh.replicas=2", "mesh.schedule=async", "train.steps=3"]
    runs = {}
    for name, sets in {"bf16": ["codec.name=bf16"],
                       "mask": ["codec.name=mask", "codec.keep=1.0", options]}.items():
        trainer = Trainer(tiny_config(tiny_corpus, *mesh, *sets), tmp_path / name, progress=False)
        losses = [trainer.step() for _ in range(3)]
        weights = [trainer.workers[WorkerId(r, s)].module.state_dict() for r in range(2) for s in range(4)]
        runs[name] = losses, weights
    (dense_losses, dense_weights), (mask_losses, mask_weights) = runs["bf16"], runs["mask"]
    assert mask_losses == dense_losses
    assert all(torch.equal(a[k], b[k]) for a, b in zip(dense_weights, mask_weights, strict=True) for k in a)
