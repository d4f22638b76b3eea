"""Stages `baseline/seq_kd` (off-policy sequence-level KD: SFT on the teachers' answers to
MOPD's own prompt stream, with MOPD's student-token budget) and `baseline/weight_avg`
(uniform parameter average of the RL experts) -> DIR/baselines/<name>/model, both on the
experts' INT4 grid unless `baselines.quantize` is off."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict
from functools import partial

from transformers import AutoTokenizer

from mopd.baselines import mopd_prompt_stream, seq_kd, weight_average
from mopd.baselines.budget import checkpoint_params, no_training_budget, seq_kd_budget
from core.config import to_dict
from mopd.distill import DistillConfig
from mopd.distill.agents import load_agents
from core.quant import QuantConfig
from pipeline.config import SeqKDSection
from pipeline.runner import Stage, StageContext
from pipeline.stages.common import Layout, Scope, Tracking, key_dir, log_metrics, log_model, log_params, seeded_name
from pipeline.stages.experts import quant_label

SEQ_KD, WEIGHT_AVG = "baseline/seq_kd", "baseline/weight_avg"


def stages(scope: Scope, mopd_cfg: DistillConfig, quant: QuantConfig,
           teachers: dict[str, str]) -> dict[str, Stage]:
    """{"seq_kd": stage, "weight_avg": stage} for the enabled baselines; `teachers`: teacher
    key -> its RL expert stage."""
    bl = scope.cfg.baselines
    q = quant if bl.quantize else None
    out = {}
    if bl.seq_kd.enabled:
        out["seq_kd"] = seq_kd_stage(scope, bl.seq_kd, mopd_cfg, q, teachers)
    if bl.weight_avg.enabled:
        rl = list(teachers.values())
        out["weight_avg"] = Stage(WEIGHT_AVG, scope.layout.hashed({"quant": asdict(q) if q else None, "teachers": rl}),
                         partial(run_weight_avg, teachers=rl, quant=q, tracking=scope.tracking),
                         deps=rl, out=scope.layout.baseline("weight_avg"),
                         shows={"model": "uniform average of the RL experts", "dtype": "float32",
                                "quant": quant_label(q)})
    return out


def seq_kd_stage(scope: Scope, sk: SeqKDSection, mopd_cfg: DistillConfig, quant: QuantConfig | None,
                 teachers: dict[str, str], share: float = 1.0, name: str = SEQ_KD,
                 seed: int | None = None) -> Stage:
    """seq-KD with `share` of MOPD's student tokens (1: the baseline; less: the warm-up of
    the warm-up-then-MOPD variant, stage `name`, folder baselines/<name's last part>).
    `seed`: the `extra_seeds` copy of the baseline, with that seed, matched to that seed's
    MOPD stage (`mopd_cfg` is its config)."""
    if seed is not None:
        sk = dataclasses.replace(sk, seed=seed)
    # The prompt stream replays MOPD's sampler: its data, mix, seed and batch shape count.
    s = {**asdict(sk), "max_new_tokens": sk.max_new_tokens or mopd_cfg.rollout.max_new_tokens,
         "prompts": {"data": to_dict(mopd_cfg.data), "seed": mopd_cfg.train.seed,
                     "prompts_per_step": mopd_cfg.train.prompts_per_step,
                     "minibatches": mopd_cfg.train.minibatches},
         "quant": asdict(quant) if quant else None}
    if sk.match == "tokens" or share != 1.0:   # the default (and the warm-up's) stays out of the older hashes
        s.pop("match")
    if mopd_cfg.agents:   # the teacher's episodes follow these (kept out of the hash of runs without agents)
        s["agents"] = {d: asdict(a) for d, a in mopd_cfg.agents.items()}
    if share != 1.0:      # kept out of the whole baseline's hash, which predates it
        s["share"] = share
    if scope.student_checkpoint:   # mopd.student: seq-KD starts where MOPD does (the base's runs keep their hash)
        s["student"] = scope.student_checkpoint
    run_name = name.split("/")[-1]
    mopd = seeded_name("mopd", seed)
    return Stage(seeded_name(name, seed), scope.layout.hashed(s),
                 partial(run_seq_kd, sk=sk, settings=s, mopd_cfg=mopd_cfg, quant=quant, teachers=teachers,
                         tracking=scope.tracking, share=share, run_name=key_dir(seeded_name(run_name, seed)),
                         mopd=mopd, student=scope.student_checkpoint),
                 deps=["data", "base", *teachers.values(), mopd],
                 out=Layout(scope.layout.seeded(seed)).baseline(run_name),
                 shows={"model": f"{scope.student_model} (SFT on the teachers' answers)", "dtype": "float32",
                        "quant": quant_label(quant), "teachers": {k: f"{st} stage" for k, st in teachers.items()}})


def run_seq_kd(ctx: StageContext, sk: SeqKDSection, settings: dict, mopd_cfg: DistillConfig,
               quant: QuantConfig | None, teachers: dict[str, str], tracking: Tracking, share: float = 1.0,
               run_name: str = "seq_kd", mopd: str = "mopd", student: str = "") -> dict:
    budget = max(1, round(share * int(ctx.inputs[mopd]["tokens"])))
    # baselines.seq_kd.match: equal student tokens or equal optimizer updates (the warm-up: tokens)
    match = settings.get("match", "tokens")
    updates = int(ctx.inputs[mopd]["steps"]) if match == "updates" else 0
    base = student or ctx.inputs["base"]["checkpoint"]   # the student's start: mopd.student, else the base
    tok = AutoTokenizer.from_pretrained(base)
    stream = mopd_prompt_stream(mopd_cfg, tok)
    agents = load_agents(mopd_cfg, tok) if mopd_cfg.agents else None
    paths = {key: ctx.inputs[st]["checkpoint"] for key, st in teachers.items()}
    with tracking.stage_run(ctx, run_name):
        log_params({k: v for k, v in settings.items() if k != "quant"})
        s = seq_kd(base, paths, stream, ctx.out, budget_tokens=budget, quant=quant,
                   agents=agents, match=match, budget_updates=updates,
                   **sk.seq_kd_kwargs(mopd_cfg.rollout.max_new_tokens))
        for i, loss in enumerate(s.pop("losses")):
            log_metrics({"loss": loss}, step=i)
        # every teacher here shares the base's shape; the mean over them, weighted by the rows
        # each answered, covers teachers of other sizes too
        rows = s["rows_per_teacher"]
        n_teacher = round(sum(checkpoint_params(paths[k]) * n for k, n in rows.items()) / max(1, sum(rows.values())))
        s["budget"] = seq_kd_budget(n_student=checkpoint_params(base), n_teacher=n_teacher, tokens=s["tokens"],
                                    rows=s["rows"])
        log_params({"match": match})
        log_metrics({"tokens": s["tokens"], "budget_tokens": s["budget_tokens"], "rows": s["rows"],
                     "steps": s["steps"], "flops": s["budget"]["flops"]})
        log_model(s["checkpoint"])
    return s


def run_weight_avg(ctx: StageContext, teachers: list[str], quant: QuantConfig | None, tracking: Tracking) -> dict:
    with tracking.stage_run(ctx, "weight_avg"):
        s = weight_average([ctx.inputs[t]["checkpoint"] for t in teachers], ctx.out / "model", quant=quant)
        log_model(s["checkpoint"])
    return {**s, "budget": no_training_budget(checkpoint_params(s["checkpoint"]))}
