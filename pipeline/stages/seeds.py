"""The `extra_seeds` copies: for each seed N, stages `mopd/seedN`, `baseline/seq_kd/seedN`
and `baseline/mix_rl/seedN` (those enabled) under DIR/seeds/seedN/, each the plain stage
with its training seed set to N (seq-KD and Mix-RL replay seed N's MOPD prompt stream and
match its budget), and their evals `eval/<model>/seedN`. The report puts each method's
mean and spread over the plain run and these beside the plain table (evals.report's
`seeds` section): a method's difference from another is only worth reading against it."""
from __future__ import annotations

from experts.run import ExpertConfig
from mopd.distill import DistillConfig
from core.quant import QuantConfig
from pipeline.runner import Stage
from pipeline.stages import baselines, mix_rl, mopd
from pipeline.stages.common import Scope, seeded_name

# the methods that get seeded copies: (the model's name in the report, its stage's name)
METHODS = (("student", mopd.NAME), ("seq_kd", baselines.SEQ_KD), ("mix_rl", mix_rl.MIX_RL))


def stages(scope: Scope, mopd_cfg: DistillConfig, quant: QuantConfig, teachers: dict[str, str], rm: str | None,
           experts: dict[str, dict[str, ExpertConfig]]) -> tuple[list[Stage], dict[str, str]]:
    """(the seeded stages in run order, {seeded model name: its stage name})."""
    bl = scope.cfg.baselines
    q = quant if bl.quantize else None
    out: list[Stage] = []
    for seed in scope.cfg.extra_seeds:
        cfg = mopd.seeded_config(mopd_cfg, seed)
        out.append(mopd.stage(scope, cfg, teachers, rm, seed=seed))
        if bl.seq_kd.enabled:
            out.append(baselines.seq_kd_stage(scope, bl.seq_kd, cfg, q, teachers, seed=seed))
        if bl.mix_rl.enabled:
            out += mix_rl.stages(scope, cfg, q, experts, rm, seed=seed).values()
    names = {s.name for s in out}
    scored = {seeded_name(model, seed): seeded_name(stage, seed) for seed in scope.cfg.extra_seeds
              for model, stage in METHODS if seeded_name(stage, seed) in names}
    return out, scored


def groups(scope: Scope, scored: dict[str, str]) -> dict[str, list[str]]:
    """{method: [its model names, the plain run's first]} for the report, methods with copies only."""
    return {model: [model, *[seeded_name(model, s) for s in scope.cfg.extra_seeds if seeded_name(model, s) in scored]]
            for model, _ in METHODS if any(seeded_name(model, s) in scored for s in scope.cfg.extra_seeds)}
