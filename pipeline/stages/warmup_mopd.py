"""Stages `baseline/warmup` and `baseline/warmup_mopd`: the "warm-up then MOPD" recipe
(Qwen3; Thinking Machines' on-policy distillation after SFT). The student first trains
off-policy on the teachers' answers (seq-KD, the baseline's own code and settings,
`baselines.seq_kd`) for `baselines.warmup_mopd.share` of plain MOPD's student tokens,
then MOPD (the `mopd` stage's config) continues from that checkpoint for the rest.

Matching plain MOPD's student tokens T (the `mopd` stage's, over its S steps):

    warm-up    seq-KD with budget_tokens = round(share x T); it trains on T_w tokens
               (whole batches of rows: off the target by at most half a batch's tokens)
    MOPD part  stops once it has trained on T - T_w student tokens (train.max_tokens),
               or after the plain run's S steps, whichever comes first. Its lr schedule
               is laid over S steps, so a part that ends on tokens stops before its lr
               has fully decayed. (The plain run's steps left after its first T_w
               tokens, S - k with k from its history.json, are logged as the expected
               length.)

The total overshoots T by less than one step's tokens, unless the warm-started student's
answers are so much shorter than the plain student's that S steps do not reach T - T_w
(the cap: never more MOPD steps than plain MOPD took). The summary records the target,
both parts and the relative error of the total (`budget_match`).

The MOPD part samples MOPD's prompt stream from its start, as the plain run does (the
warm-up's prompts are that stream's first draws), with the plain run's recipe, its
learning-rate schedule stretched over the part's steps."""
from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

from evals.report import on_policy_tokens_from_history
from mopd.baselines.budget import budget, checkpoint_params, mopd_budget
from mopd.distill import DistillConfig
from core.quant import QuantConfig
from pipeline.runner import Stage, StageContext, say
from pipeline.stages import mopd as mopd_stage
from pipeline.stages.baselines import seq_kd_stage
from pipeline.stages.common import Scope, settings

WARMUP, WARMUP_MOPD = "baseline/warmup", "baseline/warmup_mopd"


def stages(scope: Scope, mopd_cfg: DistillConfig, quant: QuantConfig, teachers: dict[str, str],
           rm: str | None) -> dict[str, Stage]:
    """{"warmup": seq-KD stage, "warmup_mopd": MOPD stage} when enabled; `teachers`: teacher
    key -> its RL expert stage; `rm`: the chat RM stage, if any."""
    bl = scope.cfg.baselines
    wm = bl.warmup_mopd
    if not wm.enabled:
        return {}
    warm = seq_kd_stage(scope, bl.seq_kd, mopd_cfg, quant if bl.quantize else None, teachers,
                        share=wm.share, name=WARMUP)
    cfg = dataclasses.replace(mopd_cfg, mlflow=dataclasses.replace(
        mopd_cfg.mlflow, run_name="warmup_mopd", registered_name=f"{scope.layout.root.name}-warmup-mopd"))
    s = settings(cfg)
    s["train"].pop("resume", None)
    s["train"].pop("accept_config_change", None)
    # the start and the step count are the upstream stages' (their run ids are in the hash)
    s["model"]["path"] = "$WARMUP"
    s["train"]["max_steps"] = "$PLAIN_MOPD_STEPS"
    s["train"]["max_tokens"] = "$PLAIN_MOPD_TOKENS_LEFT"
    s["share"] = wm.share
    deps = [WARMUP, "mopd", *([rm] if rm and mopd_stage.uses_chat_rm(scope, cfg) else [])]
    part = Stage(WARMUP_MOPD, scope.layout.hashed(s),
                 partial(run, cfg=cfg, share=wm.share, teachers=teachers), deps=[*deps, *teachers.values()],
                 out=scope.layout.baseline("warmup_mopd"), resumable=True,
                 shows={**mopd_stage.shows(cfg), "model": f"the {WARMUP} checkpoint"})
    return {"warmup": warm, "warmup_mopd": part}


def rest_steps(history: list[dict], steps: int, tokens: int, warm_tokens: int) -> tuple[int, int]:
    """(steps, their tokens) of the plain MOPD run left after its first `warm_tokens`
    student tokens: the step whose cumulative tokens land closest to `warm_tokens` ends the
    part the warm-up replaces (ties: the later one). Per-step tokens from `history`; a
    history without them spreads `tokens` evenly over `steps`. At least one step."""
    per = [float(h["tokens"]) for h in history if "tokens" in h]
    if len(per) != steps:
        per = [tokens / steps] * steps
    cum, best = 0.0, (abs(warm_tokens), 0)
    for i, t in enumerate(per, 1):
        cum += t
        best = min(best, (abs(cum - warm_tokens), -i))
    k = min(-best[1], steps - 1)
    return steps - k, int(round(sum(per[k:])))


def run(ctx: StageContext, cfg: DistillConfig, share: float, teachers: dict[str, str]) -> dict:
    plain, warm = ctx.inputs["mopd"], ctx.inputs[WARMUP]
    target, plain_steps = int(plain["tokens"]), int(plain["steps"])
    # `mopd baseline warmup` given budget_* instead of a MOPD run has no history ("")
    hist_path = Path(plain["history"]) if plain.get("history") else None
    plain_hist = json.loads(hist_path.read_text()) if hist_path and hist_path.is_file() else []
    steps, planned = rest_steps(plain_hist, plain_steps, target, int(warm["tokens"]))
    say(f"warmup_mopd: the warm-up trained on {int(warm['tokens']):,} of plain MOPD's {target:,} student tokens; "
        f"MOPD from its checkpoint until {target - int(warm['tokens']):,} more student tokens (the plain run "
        f"took {steps} of its {plain_steps} steps, ~{planned:,} tokens, for them; at most {plain_steps} steps)")
    # the token budget ends the part; plain MOPD's step count caps it and is its lr schedule's length
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=warm["checkpoint"]),
                              train=dataclasses.replace(cfg.train, max_steps=plain_steps,
                                                        max_tokens=max(1, target - int(warm["tokens"]))))
    out = mopd_stage.run(ctx, cfg)
    hist = json.loads(Path(out["history"]).read_text())
    n_student = checkpoint_params(warm["checkpoint"])
    paths = [ctx.inputs[st]["checkpoint"] for st in teachers.values()]
    n_teacher = round(sum(checkpoint_params(p) for p in paths) / len(paths))
    part = mopd_budget(n_student=n_student, n_teacher=n_teacher, tokens=out["tokens"],
                       on_policy_tokens=on_policy_tokens_from_history(hist),
                       samples=_samples(cfg, out["steps"]))
    b = combine(warm["budget"], part)
    total = b["student_tokens"]
    match = {"target_tokens": target, "warmup_tokens": int(warm["tokens"]), "mopd_tokens": int(out["tokens"]),
             "mopd_tokens_planned": planned, "total_tokens": total, "mopd_steps": out["steps"],
             "plain_mopd_steps": plain_steps, "share": share,
             "warmup_share_actual": round(int(warm["tokens"]) / max(1, total), 4),
             "relative_error": round((total - target) / max(1, target), 4)}
    say(f"warmup_mopd: {total:,} student tokens in all (warm-up {match['warmup_tokens']:,} + MOPD "
        f"{match['mopd_tokens']:,}) vs plain MOPD's {target:,}: {match['relative_error']:+.1%}")
    return {**out, "warmup_checkpoint": warm["checkpoint"], "budget": b, "budget_match": match,
            "budget_stages": [WARMUP, WARMUP_MOPD]}


def _samples(cfg: DistillConfig, steps: int) -> int:
    t = cfg.train
    return -(-steps // t.minibatches) * t.prompts_per_step * cfg.rollout.samples_per_prompt


def combine(*parts: dict) -> dict:
    """One budget (mopd.baselines.budget's dict) of methods run one after another: the
    token counts, samples and FLOPs terms summed; the parameter counts the first part's."""
    terms = {k: sum(p["flops_terms"].get(k, 0.0) for p in parts) for k in parts[0]["flops_terms"]}
    p0 = parts[0]["params"]
    out = budget(n_student=p0["student"], n_teacher=max(p["params"]["teacher"] for p in parts),
                 student_tokens=sum(p["student_tokens"] for p in parts),
                 student_sampled=sum(p["student_tokens_sampled"] for p in parts),
                 teacher_generated=sum(p["teacher_tokens_generated"] for p in parts),
                 teacher_scored=sum(p["teacher_tokens_scored"] for p in parts),
                 samples=sum(p.get("student_samples") or 0 for p in parts))
    return {**out, "flops": sum(terms.values()), "flops_terms": terms}
