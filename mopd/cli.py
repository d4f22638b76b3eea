"""`mopd` command line: one subcommand per stage."""
from __future__ import annotations

import argparse
import json
import sys


def _distill(args):
    from mopd.config import load_config
    from mopd.train import DistillConfig, run

    cfg = load_config(DistillConfig, args.config, args.overrides)
    run(cfg, args.out)


def _toy(args):
    from mopd.toy import run_toy

    summary = run_toy(args.out, overrides=args.overrides, rollout_backend=args.rollout_backend)
    print(json.dumps(summary, indent=1))


def _teachers_validate(args):
    from mopd.config import load_config
    from mopd.train import DistillConfig
    from teachers.resolve import TeacherError, check_fit, resolve_ref
    from transformers import AutoTokenizer

    cfg = load_config(DistillConfig, args.config, args.overrides)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    bad = 0
    for key, spec in sorted(cfg.teachers.items()):
        try:
            path = resolve_ref(spec.path)
            fit = check_fit(tok, path)
            status = "ok" if fit.ok else "MISMATCH: " + "; ".join(fit.problems)
            bad += not fit.ok
        except TeacherError as e:
            path, status, bad = "-", f"ERROR: {e}", bad + 1
        print(f"{key:24s} {spec.path}  ->  {path}  [{status}]")
    return 1 if bad else 0


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="mopd", description="Multi-teacher on-policy distillation")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("distill", help="run the MOPD loop in this process "
                       "(for several processes: accelerate launch -m mopd.train)")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=10")
    p.set_defaults(fn=_distill)

    p = sub.add_parser("toy", help="self-contained demo: tiny base, two teachers, MOPD, evals")
    p.add_argument("--out", default="runs/toy")
    p.add_argument("--rollout-backend", default="vllm", choices=["vllm", "hf"])
    p.add_argument("overrides", nargs="*", help="key=value overrides for recipes/mopd/toy.yaml")
    p.set_defaults(fn=_toy)

    p = sub.add_parser("teachers", help="teacher checkpoints")
    tsub = p.add_subparsers(dest="tcmd", required=True)
    v = tsub.add_parser("validate", help="resolve each domain's teacher and check it fits the student")
    v.add_argument("--config", required=True)
    v.add_argument("overrides", nargs="*")
    v.set_defaults(fn=_teachers_validate)

    from mopd.export import add_export_parser
    add_export_parser(sub)

    args = ap.parse_args(argv)
    from mopd.config import ConfigError
    from teachers.resolve import TeacherError

    try:
        rc = args.fn(args)
    except (ConfigError, TeacherError) as e:
        print(f"mopd: error: {e}", file=sys.stderr)
        return 2
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
