"""Stage `data`: MOPD's train prompts, `mopd.n_prompts` per teacher key, from each
domain's generator with its RL expert's seed and difficulty, or the first n rows of the
RL expert's data.files.train when it reads files -> DIR/data/<domain>[-<effort>]/."""
from __future__ import annotations

from functools import partial

from experts.files import load_rows
from experts.registry import data_module
from pipeline.runner import Stage, StageContext
from pipeline.stages.common import Scope, Tracking, log_params


def stage(scope: Scope, experts: dict) -> Stage:
    """`experts`: {key: {"sft": ExpertConfig, "rl": ExpertConfig}}."""
    plan = {}
    for k in scope.keys:
        rl = experts[k.key]["rl"]
        plan[k.key] = {"n": scope.cfg.mopd.n_prompts, "seed": rl.data.seed, "difficulty": rl.data.difficulty,
                       "effort": k.effort, "path": str(scope.layout.data(k.key))}
        if rl.data.dataset == "files":   # the RL expert's training prompts (kept out of procedural runs' hashes)
            plan[k.key].update(files=dict(rl.data.files), columns=dict(rl.data.columns))
    domains = {k.key: k.domain for k in scope.keys}
    return Stage("data", scope.layout.hashed(plan), partial(run, plan=plan, domains=domains, tracking=scope.tracking),
                 out=scope.layout.root / "data")


def run(ctx: StageContext, plan: dict[str, dict], domains: dict[str, str], tracking: Tracking) -> dict:
    with tracking.stage_run(ctx, "data"):
        for key, s in plan.items():
            d = domains[key]
            kw = {"effort": s["effort"]} if s["effort"] else {}
            if "files" in s:
                ds = load_rows(s["files"], s["columns"], "train", domain=d, effort=s["effort"], stage="rl",
                               data_module=data_module(d), n=s["n"])
            else:
                ds = data_module(d).make_dataset("train", s["n"], seed=s["seed"], difficulty=s["difficulty"], **kw)
            for col in ("domain",) + (("effort",) if s["effort"] else ()):
                if col not in ds.column_names:
                    raise ValueError(f"domain {d!r}: make_dataset of {data_module(d).__name__} gives no {col!r} column")
            ds.save_to_disk(s["path"])
        log_params({f"n/{k}": v["n"] for k, v in plan.items()})
    return {"paths": {k: s["path"] for k, s in plan.items()}}
