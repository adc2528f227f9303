"""The ``meshlearn`` command: train, resume, config, report, sample, export, compress, plan,
attack, keys. A thin entry point over the library; every error a user can fix is one line and exit code 2.

The library (config, models, torch) is imported inside each command, so ``--version`` and ``--help``
answer without importing torch (tests/test_cli.py checks it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import meshlearn
from meshlearn.entry.arguments import add_worker_arguments
from meshlearn.errors import ConfigError

SWEEP = "25,100,400,1600"  # ``meshlearn plan``'s default bandwidths of the plot, Mbit/s


class UsageError(Exception):
    """Bad input found while setting up a run (a corpus too short for a sequence, say): one line."""


def _train(args: argparse.Namespace) -> int:
    from meshlearn.cluster.placement import host_of_command
    from meshlearn.config import load_config, to_dict
    from meshlearn.train.preflight import check_corpus, check_run
    from meshlearn.train.provenance import check_resumable, refuse_unresumable_sets
    from meshlearn.train.rundir import RunLock, default_out, start_fresh
    from meshlearn.train.signals import GracefulStop

    if args.join:
        return _join(args)
    if args.coordinator:
        raise ConfigError("--coordinator", args.coordinator, "only with --join (docs/cluster.md, 'Joining')")
    if args.address:
        raise ConfigError("--address", args.address, "only with --join, by a newcomer "
                                                     "(docs/cluster.md, 'Joining')")
    if args.backend:  # --backend is short for --set backend=...
        args.set = [*args.set, f"backend={args.backend}"]
    changed: dict = {}
    if args.resume:
        run_dir = Path(args.resume)
        if args.overwrite or args.out or args.config:
            flag = "--overwrite" if args.overwrite else "--out" if args.out else "--config"
            raise ConfigError(flag, getattr(args, flag[2:]), "not with --resume: a resumed run keeps "
                                                             "its folder and config (change keys with --set)")
        config = run_dir / "config.toml"
        if not config.is_file():
            raise ConfigError("--resume", str(run_dir), "not a run folder (no config.toml in it)")
        saved = to_dict(load_config(config))
        refuse_unresumable_sets(saved, args.set)
        cfg = load_config(config, args.set)
        changed = check_resumable(saved, to_dict(cfg))
        check_run(cfg)
        placement = host_of_command(cfg, args.host)
        credentials = _credentials(placement, args.key)
        created = False
    else:
        cfg = load_config(args.config, args.set)
        check_corpus(cfg)
        check_run(cfg)
        placement = host_of_command(cfg, args.host)
        credentials = _credentials(placement, args.key)
        run_dir = Path(args.out) if args.out else default_out(cfg.name, args.config)
        created = not args.out or not run_dir.exists()
    with RunLock(run_dir):
        if not args.resume:
            start_fresh(run_dir, args.overwrite)
        if cfg.backend == "dist":
            return _launch_dist(args, cfg, run_dir, changed, placement, credentials)
        with GracefulStop() as stop:
            trainer = _setup(cfg, run_dir, args.resume, created, stop)
            print(trainer.opening(), flush=True)
            if args.resume:
                print(_resuming(run_dir, trainer.totals.step, trainer.last_step, changed), flush=True)
            try:
                summary = trainer.train()
            except KeyboardInterrupt:
                print(f"meshlearn: stopped at once; the last checkpoint stays — continue with: "
                      f"meshlearn train --resume {run_dir}", file=sys.stderr)
                return 130
    from meshlearn.train.closing import rate

    rates = (f"{rate(summary['sim_tokens_per_s'], 'virtual')} ({summary['compute_model']}), "
             f"{rate(summary['wall_tokens_per_s'], 'wall')}")
    end = trainer.closing(summary, rates)
    print(end.line, file=sys.stderr if end.code else sys.stdout)
    return end.code


def _setup(cfg, run_dir: Path, resume: str | None, created: bool, stop):
    """The Trainer, or one line naming the bad input (and no run folder left by a fresh start)."""
    from meshlearn.entry.plugins import register_builtin_plugins
    from meshlearn.train.rundir import discard_fresh
    from meshlearn.train.trainer import Trainer

    register_builtin_plugins()
    try:
        return Trainer(cfg, run_dir, resume=bool(resume), stop=stop)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        if not resume:
            discard_fresh(run_dir, created)
        if isinstance(err, ConfigError | FileNotFoundError):
            raise
        raise UsageError(str(err)) from None


def _resuming(run_dir: Path, step: int, last: int, changed: dict) -> str:
    what = f"resuming {run_dir} from step {step}" + (f" (to step {last})" if step < last else
                                                     f": already at step {last}, nothing to train "
                                                     "(raise train.steps with --set to go on)")
    if changed:
        what += "; changed: " + ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in changed.items())
    return what


def _join(args: argparse.Namespace) -> int:
    """``--join``: one process joins a running elastic cluster run from this machine."""
    from meshlearn.entry.cluster_join import prepare_cluster_join
    from meshlearn.entry.worker import run

    for flag in ("config", "resume", "overwrite", "backend"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag}", getattr(args, flag), "not with --join: a joiner takes the run's "
                                                                "config from its coordinator")
    for flag in ("host", "out", "coordinator"):
        if not getattr(args, flag):
            raise ConfigError(f"--{flag}", None, "required with --join: meshlearn train --join --host NAME "
                                                 "--key FILE --coordinator ADDR:PORT --out RUN")
    run_dir = Path(args.out)
    cfg, own_port = prepare_cluster_join(args.host, args.key, args.coordinator, run_dir, args.set,
                                         args.address)
    try:  # a newcomer's own port receives its links while its worker runs
        return run(cfg, run_dir, False)
    finally:
        if own_port is not None:
            own_port.close()


def _credentials(placement, key: str | None):
    """``--key``: this host's checked credentials in a cluster run; refused without ``--host``."""
    from meshlearn.cluster.identity import host_credentials

    if placement is None:
        if key is not None:
            raise ConfigError("--key", key, "only with --host in a [cluster] run (docs/cluster.md)")
        return None
    return host_credentials(placement.host, key)


def _launch_dist(args: argparse.Namespace, cfg, run_dir: Path, changed: dict, placement, credentials) -> int:
    from meshlearn.checkpoint_layout import latest_complete
    from meshlearn.cluster.checkpoints import agreed_steps
    from meshlearn.entry.launch import launch_local

    if args.resume:
        folder = latest_complete(run_dir)
        step = int(folder.name.removeprefix("step-")) if folder else 0
        if placement is not None:  # the newest this folder agreed on (the coordinator picks the one)
            step = (agreed_steps(run_dir) or [0])[-1]
        print(_resuming(run_dir, step, cfg.train.steps, changed), flush=True)
    where = ["--resume", str(run_dir)] if args.resume else [
        *(["--config", args.config] if args.config else []), "--out", str(run_dir)]
    worker_argv = [*where, *(x for o in args.set for x in ("--set", o))]
    if placement is not None:
        from meshlearn.entry.cluster_launch import launch_host

        return launch_host(worker_argv, cfg, run_dir, placement, credentials)
    return launch_local(worker_argv, cfg, run_dir)


def _config(args: argparse.Namespace) -> int:
    import tomli_w

    from meshlearn.config import load_config, to_dict
    from meshlearn.train.config_help import format_keys

    if args.compat:
        from meshlearn.train.compat_help import format_compat

        print(format_compat())
        return 0
    if args.resolved is not None or args.set:
        cfg = load_config(args.resolved or None, args.set)
        text = tomli_w.dumps(to_dict(cfg))
        print(text.rstrip() if args.section is None else _section_toml(cfg, args.section))
        return 0
    print(format_keys(args.section, full=args.full))
    return 0


def _section_toml(cfg, section: str) -> str:
    import tomli_w

    from meshlearn.config import to_dict

    tree = to_dict(cfg)
    if section not in tree:
        names = ", ".join(k for k, v in tree.items() if isinstance(v, dict))
        raise ConfigError("meshlearn config", section, f"no such section; sections: {names}")
    return tomli_w.dumps({section: tree[section]}).rstrip()


def _worker(args: argparse.Namespace) -> int:
    from meshlearn.entry.worker import resolve_run, run

    return run(*resolve_run(args))


def _report(args: argparse.Namespace) -> int:
    from meshlearn.report import render_report

    index = render_report([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    print(f"report: {index}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from meshlearn.sample import Generation, sample_from_run

    if args.tokens < 1:
        raise ConfigError("--tokens", args.tokens, "must be >= 1 (tokens to generate)")
    if not (args.temperature > 0 and args.temperature < float("inf")):
        raise ConfigError("--temperature", args.temperature,
                          "must be a finite number > 0 (1: the model's distribution; lower: greedier)")
    if args.stages < 1:
        raise ConfigError("--stages", args.stages, "must be >= 1 (pipeline stages of the protocol model)")
    if args.morph_every_tokens < 1:
        raise ConfigError("--morph-every-tokens", args.morph_every_tokens, "must be >= 1")
    if not 0 < args.epsilon <= 1:
        raise ConfigError("--epsilon", args.epsilon, "in (0, 1] (lowcond: κ ≤ e^{2ε})")
    how = Generation(args.temperature, args.seed, args.greedy, args.morph, args.stages,
                     args.morph_every_tokens, args.epsilon)
    if (Path(args.run) / "config.toml").is_file():
        print(sample_from_run(Path(args.run), args.prompt, args.tokens, how))
        return 0
    from meshlearn.sample import sample_from_pretrained

    try:
        text = sample_from_pretrained(args.run, args.prompt, args.tokens, how)
    except ConfigError:
        raise  # a flag that does not fit the model (--stages)
    except ValueError as err:
        raise ConfigError("sample", args.run, f"not a run folder, and not a model: {err}") from None
    print(text)
    return 0


def _export(args: argparse.Namespace) -> int:
    from meshlearn.export import export

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError("--out", args.out, "exists and is not empty (add --overwrite to write into it)")
    try:
        export(args.source, out, args.format, args.dtype)
    except ValueError as err:
        raise ConfigError("export", args.source, str(err)) from None
    print(f"export: {out} ({args.format}, {args.dtype})")
    return 0


def _compress(args: argparse.Namespace) -> int:
    from meshlearn.compressibility import PIPELINES, CompressSettings, compress_run
    from meshlearn.compressibility.run import OUT_DIR

    try:
        keeps = tuple(float(k) for k in args.keep.split(","))
    except ValueError:
        raise ConfigError("--keep", args.keep, "comma-separated fractions, e.g. 0.75,0.5,0.25") from None
    if not all(0 < k <= 1 for k in keeps):
        raise ConfigError("--keep", args.keep, "every fraction must be in (0, 1]")
    pipelines = tuple(p.strip() for p in args.pipelines.split(","))
    unknown = [p for p in pipelines if p not in PIPELINES]
    if unknown:
        raise ConfigError("--pipelines", unknown[0], f"allowed: {sorted(PIPELINES)}")
    if args.calibration < 1:
        raise ConfigError("--calibration", args.calibration, "must be >= 1 sequence")
    out = Path(args.out) if args.out else Path(args.run) / OUT_DIR
    result = compress_run(Path(args.run), CompressSettings(keeps, pipelines, args.calibration), out)
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
    print(f"uncompressed: val loss {result['uncompressed_val_loss']:.4f}, "
          f"mean stable rank {result['stable_rank']['mean']:.2f}")
    for r in result["results"]:
        account = r["account"]
        print(f"{r['pipeline']:>7} keep {r['keep']:.2f}: val loss {r['val_loss']:.4f} "
              f"(kept {account['kept_in_compressed']:.3f} of compressed matrices, "
              f"{account['kept_total']:.3f} of all parameters)")
    print(f"compress: {out / 'compress.md'}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from meshlearn.config import load_config
    from meshlearn.plan.parallel import default_processes
    from meshlearn.plan.planner import plan
    from meshlearn.plan.presets import MODELS, preset_overrides
    from meshlearn.plan.table import format_table, write_plot

    sets = list(args.set)
    if args.model and args.model not in MODELS:
        raise ConfigError("--model", args.model, f"allowed: {sorted(MODELS)} (or any model.* key with --set)")
    if args.device:
        sets.append(f"sim.device={args.device}")
    if args.subspace_rank < 0:
        raise ConfigError("--subspace-rank", args.subspace_rank, "must be >= 1 (0: d_model / 64, at least 8)")
    keeps = _floats("--mask-keep", args.mask_keep)
    # The sweep feeds the plot: with --plot none it is simulated only when asked for (--json has it).
    sweep = () if args.sweep is None and args.plot == "none" else _floats("--sweep", args.sweep or SWEEP)
    if any(not 0 < k <= 1 for k in keeps):
        raise ConfigError("--mask-keep", args.mask_keep, "keep rates in (0, 1], e.g. 0.05,0.1")
    if args.sweep is not None and not sweep or any(b <= 0 for b in sweep):
        raise ConfigError("--sweep", args.sweep, "bandwidths in Mbit/s > 0, e.g. 25,100,400")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("--jobs", args.jobs, "processes for the simulations: >= 1")
    tied = bool(args.model and MODELS[args.model].get("tie_embeddings"))
    if args.model:  # the preset goes under --set: ``model.*`` keys given there win
        given = {s.split("=", 1)[0].strip() for s in args.set}
        preset = [p for p in preset_overrides(args.model, tied=False) if p.split("=", 1)[0] not in given]
        sets = [*preset, *sets]
    cfg = load_config(args.config, sets)
    if tied and cfg.mesh.stages == 1 and "model.tie_embeddings" not in given:
        cfg = load_config(args.config, [*sets, "model.tie_embeddings=true"])
    if cfg.model.vocab_size <= 0:
        cfg = load_config(args.config, [*sets, "model.vocab_size=256"])  # the byte tokenizer
    try:
        result = plan(cfg, args.subspace_rank, keeps, sweep, args.jobs or default_processes(), args.binds)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if tied and cfg.mesh.stages > 1:
        result["notes"].append(f"{args.model} ties its embeddings; across {cfg.mesh.stages} stages "
                               "the last stage holds its own copy (model.tie_embeddings = false)")
    if args.plot != "none":
        result["plot"] = str(write_plot(result, Path(args.plot)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
        if "plot" in result:
            print(f"plot: {result['plot']}")
    return 0


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(flag, text, "comma-separated numbers") from None


def _attack(args: argparse.Namespace) -> int:
    import json

    from meshlearn.attack_run import attack_run

    if not (Path(args.run) / "config.toml").is_file():
        raise ConfigError("attack", args.run, "not a run folder (no config.toml in it)")
    result = attack_run(Path(args.run), args.attack, args.snapshots, args.alternating,
                        Path(args.out) if args.out else None)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.attack} on snapshots {' + '.join(result['snapshots'])}: stitched (alternating) "
          f"{result['stitched_val_loss']:.4f}, best of {len(result['assignments'])} mixes "
          f"{result['best_mix_val_loss']:.4f} (stages from {' '.join(result['best_assignment'])}); "
          f"real {result['real_val_loss']:.4f}, random init {result['random_init_val_loss']:.4f}, "
          f"token counts alone {result['unigram_val_loss']:.4f} nats/token")
    for prefix, what in (("", "stitched"), ("best_mix_", "best mix")):
        print(f"{what}: recovered {result[prefix + 'recovered_fraction']:.3f} of the gap from random "
              f"init to the real model; "
              f"{'better' if result[prefix + 'recovered'] else 'no better'} than random init, "
              f"{'better' if result[prefix + 'beats_token_counts'] else 'no better'} than token counts")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from meshlearn.net.keys import KeysError, add_joiner, create_run, revoke

    given = [flag for flag in ("config", "add", "revoke") if getattr(args, flag)]
    if len(given) != 1:
        raise ConfigError("meshlearn keys", " ".join(f"--{flag}" for flag in given) or "(nothing)",
                          "exactly one of --config RUN.toml, --add NAME, --revoke NAME")
    out = Path(args.out)
    try:
        if args.config:
            hosts, run_name = _cluster_hosts(Path(args.config))
            create_run(out, hosts, run_name)
            print(f"meshlearn keys: a new CA for run {run_name!r} in {out}; credentials for "
                  f"{', '.join(hosts)}. Give each host its own {out}/<host>.key and .crt, with "
                  f"{out}/ca.crt and {out}/ca.crl; keep {out}/ca.key with the run's owner.")
        elif args.add:
            add_joiner(out, args.add)
            print(f"meshlearn keys: admitted joiner {args.add!r}: give it {out}/{args.add}.key and .crt, "
                  f"with {out}/ca.crt and {out}/ca.crl.")
        else:
            serials = revoke(out, args.revoke)
            print(f"meshlearn keys: revoked {args.revoke!r} ({len(serials)} certificate(s)); give the new "
                  f"{out}/ca.crl to the coordinator (and every host): it takes effect at their next "
                  f"handshake.")
    except KeysError as err:
        raise ConfigError(err.key, err.value, err.allowed) from None
    return 0


def _cluster_hosts(config: Path) -> tuple[list[str], str]:
    """The host names of a run config's ``[cluster]`` placement (checked as ``train`` checks it), and
    the run's name (its ``name``, else the file's stem)."""
    from meshlearn.config import load_config

    cfg = load_config(config, [])
    if not cfg.cluster.enabled:
        raise ConfigError("cluster.hosts", {}, f"{config} places no hosts: add a [cluster.hosts.NAME] "
                                               f"table for each machine")
    return list(cfg.cluster.hosts), cfg.name or config.stem


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlearn", description=meshlearn.__doc__)
    parser.add_argument("--version", action="version", version=f"meshlearn {meshlearn.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train on a simulated mesh (or resume a run)")
    train.add_argument("--config", help="TOML config file (default: built-in defaults)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set mesh.stages=2 (repeatable; later wins)")
    train.add_argument("--out", help="run folder for a fresh run; it must be new, empty, or given "
                                     "--overwrite (default: a new runs/<name>-<date>-<time>)")
    train.add_argument("--overwrite", action="store_true",
                       help="clear --out first if it holds a finished or stopped run")
    train.add_argument("--resume", metavar="RUN",
                       help="continue RUN from its last checkpoint (--set may change keys that "
                            "do not change the model, mesh, tokenizer or optimizer kind)")
    train.add_argument("--backend", choices=["sim", "dist"],
                       help="sim: one process, virtual clock; dist: one local process per worker "
                            "(short for --set backend=...; see docs/distributed.md)")
    train.add_argument("--host", metavar="NAME",
                       help="with --backend dist and a [cluster] config: run this machine's part, "
                            "as host NAME of [cluster.hosts] (docs/cluster.md)")
    train.add_argument("--key", metavar="FILE",
                       help="with --host: this host's private key, made by `meshlearn keys` (its .crt, "
                            "ca.crt and ca.crl beside it; docs/security.md)")
    train.add_argument("--join", action="store_true",
                       help="join a running elastic [cluster] run from this machine as one worker: "
                            "with --host, --key, --coordinator and --out (docs/cluster.md, 'Joining')")
    train.add_argument("--coordinator", metavar="ADDR:PORT",
                       help="with --join: the coordinator's address and port; the config, tokenizer "
                            "and a free slot come from the run")
    train.add_argument("--address", metavar="ADDR:PORT",
                       help="with --join and a newcomer's key (`meshlearn keys --add NAME`): this "
                            "machine's one inbound port, where the run's members reach its worker")
    train.set_defaults(func=_train)

    worker = sub.add_parser("worker", help="one worker process of a dist run: what torchrun starts "
                                           "(rank and rendezvous from its environment)")
    add_worker_arguments(worker)
    worker.set_defaults(func=_worker)

    report = sub.add_parser("report", help="an HTML/Markdown report of one or more runs: config, "
                                           "figures, trust, samples (docs/report.md)")
    report.add_argument("runs", nargs="+", help="run folders")
    report.add_argument("--out", help="output folder (default: RUN/report, or RUN/report-compare)")
    report.set_defaults(func=_report)

    sample = sub.add_parser("sample", help="generate text from a run's latest checkpoint, or a "
                                           "pretrained model")
    sample.add_argument("run", help="run folder, or any model.init value (smollm2-135m, a .gguf file, "
                                    "a Hugging Face folder)")
    sample.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (>= 1; default 200)")
    sample.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature (> 0): 1 samples the model's distribution, lower "
                             "is more conservative (default 0.8)")
    sample.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    sample.add_argument("--greedy", action="store_true", help="take the most likely token (no sampling)")
    sample.add_argument("--morph", choices=["off", "none", "orthogonal", "lowcond"], default="off",
                        help="serve as a protocol-model pipeline whose stages morph during generation "
                             "(docs/protocol.md; none: the pipeline without morphs; default off)")
    sample.add_argument("--stages", type=int, default=2,
                        help="pipeline stages with --morph; must divide the model's layers (default 2)")
    sample.add_argument("--morph-every-tokens", type=int, default=16,
                        help="generated tokens between morphs (default 16)")
    sample.add_argument("--epsilon", type=float, default=0.01, help="ε of --morph lowcond (default 0.01)")
    sample.set_defaults(func=_sample)

    export = sub.add_parser("export", help="write a run's model, or any model.init value, as a folder "
                                           "another framework loads")
    export.add_argument("source", help="run folder, or any model.init value (smollm2-135m, a .gguf file, "
                                       "a Hugging Face folder)")
    export.add_argument("--format", default="hf", help="hf: config.json + model.safetensors "
                                                       "(+ tokenizer.json) for transformers (default)")
    export.add_argument("--out", required=True, help="output folder (new or empty)")
    export.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16 weights")
    export.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    export.set_defaults(func=_export)

    config = sub.add_parser("config", help="every config key with its type, default and description; "
                                           "a resolved config (--resolved FILE, --set); or the refused "
                                           "combinations (--compat)")
    config.add_argument("section", nargs="?", help="one section (e.g. mesh) or key (e.g. train.lr)")
    config.add_argument("--full", action="store_true", help="whole descriptions, not first sentences")
    config.add_argument("--compat", action="store_true",
                        help="every refused combination of settings, with the error it gets")
    config.add_argument("--resolved", metavar="FILE", nargs="?", const="",
                        help="print FILE (or the defaults) with every --set applied, as TOML")
    config.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable; later wins)")
    config.set_defaults(func=_config)

    plan = sub.add_parser("plan", help="predict tokens/s, bytes per token, memory and the binding "
                                       "resource per method, from the simulator's cost model")
    plan.add_argument("--config", help="TOML config file (default: built-in defaults)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key, e.g. --set link.bandwidth_mbit=100 (repeatable)")
    plan.add_argument("--model", help="model shape preset: demo, smollm2-135m, llama-1b, llama-8b "
                                      "(over --config; model.* keys given with --set win)")
    plan.add_argument("--device", help="short for --set sim.device=... (rtx3090, rtx4090, a100, h100, l4)")
    plan.add_argument("--subspace-rank", type=int, default=0,
                      help="k of the subspace rows (default: model.subspace_rank, else d_model/64, >= 8)")
    plan.add_argument("--mask-keep", default="0.05",
                      help="keep rates of the mask rows, comma-separated (default 0.05, the paper's M95)")
    plan.add_argument("--sweep", default=None,
                      help=f"link bandwidths of the plot, Mbit/s, comma-separated (default {SWEEP}; "
                           "with --plot none: no sweep unless given)")
    plan.add_argument("--plot", default="none", help="write a PNG of tokens/s vs link bandwidth per method "
                                                     "to this file (default none: no plot, no file)")
    plan.add_argument("--jobs", type=int, default=None,
                      help="processes the simulations run on (default: the CPUs available; the numbers "
                           "do not depend on it)")
    plan.add_argument("--binds", choices=("path", "doubling"), default="path",
                      help="how each row's binding resource is found: path (default: its steady "
                           "state's critical path, split by resource, from the row's own simulation) "
                           "or doubling (each resource doubled in a simulation of its own: 4 more "
                           "simulations per row)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.set_defaults(func=_plan)

    compress = sub.add_parser("compress", help="validation loss after SVD compression, stable ranks, spectra")
    compress.add_argument("run", help="run folder (uses its checkpoint, corpus and validation batches)")
    compress.add_argument("--keep", default="0.75,0.5,0.25",
                          help="target fractions of each block matrix's parameters to keep (comma-separated)")
    compress.add_argument("--pipelines", default="svd,asvd,svdllm",
                          help="comma-separated: svd (plain truncated), asvd (α=0.5), svdllm (whitened)")
    compress.add_argument("--calibration", type=int, default=64,
                          help="train-split sequences of seq_len tokens for asvd/svdllm (default: 64)")
    compress.add_argument("--out", help="output folder (default: RUN/compress)")
    compress.set_defaults(func=_compress)

    attack = sub.add_parser("attack", help="assemble a model from the stage snapshots of a morphing "
                                           "run (protocol models; docs/unextractable.md)")
    attack.add_argument("attack", choices=["stitch", "bridge", "covariance"],
                        help="stitch: stages as collected; bridge: fit the basis change from identical "
                             "inputs at two times; covariance: align boundary covariances (passive)")
    attack.add_argument("run", help="run folder trained with protocol.morph = orthogonal or lowcond")
    attack.add_argument("--snapshots", metavar="E@S,E@S",
                        help="the two snapshots to combine, EPOCH@STEP (default: the two newest)")
    attack.add_argument("--alternating", action="store_true",
                        help="only stages from a, b, a, ... (default: every mix of the two)")
    attack.add_argument("--json", action="store_true", help="print the whole result as JSON")
    attack.add_argument("--out", help="output folder (default: RUN/attack)")
    attack.set_defaults(func=_attack)

    keys = sub.add_parser("keys", help="a run's credentials: its own CA and one key per host of "
                                       "[cluster.hosts]; admit a joiner or revoke one (docs/security.md)")
    keys.add_argument("--config", help="the run's TOML file: a new CA in --out and a key per host of "
                                       "its [cluster.hosts]")
    keys.add_argument("--add", metavar="NAME", help="issue a joiner's credential under the CA in --out")
    keys.add_argument("--revoke", metavar="NAME", help="revoke NAME's credentials (rewrites --out/ca.crl)")
    keys.add_argument("--out", required=True, metavar="DIR", help="the folder of the run's credentials")
    keys.set_defaults(func=_keys)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, UsageError) as err:
        print(f"meshlearn: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
