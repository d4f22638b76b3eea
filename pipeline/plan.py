"""The pipeline's plan: every stage's config resolved up front (errors name the key and
file before any work), and the stages in run order.

    data                      MOPD train prompts per teacher key -> DIR/data/<domain>[-<effort>]/
    base                      experts.base.build_base (recipes/base/tiny.yaml) -> DIR/base/model, or
                              base.path's checkpoint as it is
    expert/<key>/sft          the expert, SFT from the base, QAT on
    chat_rm                   (chat only) the reward model the chat expert is trained and scored with,
                              started from the chat SFT checkpoint (experts.chat_rm.init)
    expert/<key>/rl           ... then RL from the SFT checkpoint; registered as <domain>[-<effort>]-expert@teacher
    mopd                      mopd.distill: one student from the base, every expert a teacher (vLLM sampling)
    baseline/seq_kd           off-policy sequence-level KD with MOPD's student-token budget
    baseline/weight_avg       uniform parameter average of the experts
    baseline/mix_rl           joint GRPO over every single-turn domain from the base, MOPD's student samples
    baseline/cascade_rl       (baselines.cascade_rl.enabled) the same RL, the domains one after another
    baseline/warmup           seq-KD for baselines.warmup_mopd.share of MOPD's student tokens ...
    baseline/warmup_mopd      ... then MOPD from that checkpoint for the rest (the variant "warmup_mopd")
    mopd/seedN, baseline/seq_kd/seedN, baseline/mix_rl/seedN
                              (extra_seeds) the same with training seed N, under DIR/seeds/seedN/
    eval/<model>              held-out scores (evals.run) of base, each teacher, student, baselines
    report                    DIR/eval.json, DIR/report.{json,md}, DIR/retention.png, DIR/kl_curves.png,
                              DIR/budgets.png (score against FLOPs and wall-clock per method)

A teacher key is "domain" or "domain/effort" (math has low and high), the same key the
MOPD recipe's `teachers` and the eval columns use.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evals.run import EvalColumn
from experts.registry import all_domains, get as get_domain, is_agent_domain, load_domain, teacher_keys
from core.config import ConfigError
from mopd.distill import DistillConfig
from core.tracking import resolve_uri
from pipeline.config import PipelineConfig
from pipeline.runner import Stage
from pipeline.stages import (base, baselines, chat_rm, data, evals, experts, mix_rl, mopd, report, seeds,
                             warmup_mopd)
from pipeline.stages.common import Key, Layout, Scope, Tracking, find


@dataclass
class Plan:
    """Everything resolved before any work: the stage list and what it was built from."""
    root: Path
    cfg: PipelineConfig
    keys: list[Key]
    tracking_uri: str
    stages: list[Stage]
    mopd_cfg: DistillConfig
    columns: list[EvalColumn]


def build_plan(cfg: PipelineConfig, out: str | Path, dry=None) -> Plan | None:
    """Resolve every stage's config and return the stages in run order. With `dry` (a
    core.dryrun.DryRun, `mopd pipeline --dry-run`): the independent parts (the domains,
    the base, each expert recipe, the MOPD recipe, the rest) are each checked, every
    problem recorded in `dry`, and None returned when there is any."""
    root = Path(out).resolve()
    if dry is None:
        return _build(cfg, root, select(cfg, root), base.config, experts.configs)
    scope = dry.check(select, cfg, root)
    if scope is None:   # nothing else can be resolved without the domains
        return None
    n = len(dry.problems)
    base_cfg = dry.check(base.config, scope)
    cfgs = {k.key: {st: dry.check(experts.config, scope, k, st) for st in experts.STAGES} for k in scope.keys}
    if len(dry.problems) > n:   # the MOPD recipe still checked, with the experts that resolved
        ok = {k: c for k, c in cfgs.items() if None not in c.values()}
        # the MOPD recipe takes the experts' quant: the complete keys', else any stage's that resolved
        quant = dry.check(experts.common_quant, ok) if ok else \
            next((c.quant for v in cfgs.values() for c in v.values() if c is not None), None)
        if quant is not None:   # no expert stage resolved: the MOPD recipe is not checked
            dry.check(mopd.config, scope, quant)
        return None
    return dry.check(_build, cfg, root, scope, lambda _: base_cfg, lambda _: cfgs)


def _build(cfg: PipelineConfig, root: Path, scope: Scope, base_config, expert_configs) -> Plan:
    base_cfg = base_config(scope)
    expert_cfgs = expert_configs(scope)
    quant = experts.common_quant(expert_cfgs)
    mopd_cfg = mopd.config(scope, quant)
    # prompt + completion within the student's positions (the base's, which every expert
    # keeps) and the engines' max_model_len: known now, before any expert trains
    positions, label = base.positions(scope, base_cfg)
    try:
        if positions is not None:
            mopd_cfg.check_context(scope.domains, positions=positions, model=label)
    except ValueError as e:
        raise ConfigError(f"{find(cfg.mopd.recipe)}: {e}") from None
    cols = evals.columns(scope, expert_cfgs)
    teachers = {k.key: experts.name(k.key, "rl") for k in scope.keys}

    rm = chat_rm.stage(scope) if scope.chat else None
    rm_name = rm.name if rm else None
    bls = baselines.stages(scope, mopd_cfg, quant, teachers)
    bls.update(mix_rl.stages(scope, mopd_cfg, quant if cfg.baselines.quantize else None, expert_cfgs, rm_name))
    # the variant's warm-up is a step of it, not a model of the report
    warm = warmup_mopd.stages(scope, mopd_cfg, quant, teachers, rm_name)
    scored = {m: s.name for m, s in bls.items()}
    if warm:
        scored["warmup_mopd"] = warm["warmup_mopd"].name
    more, seeded = seeds.stages(scope, mopd_cfg, quant, teachers, rm_name, expert_cfgs)
    ev = evals.stages(scope, evals.models(scope, cols, teachers, scored)
                      + [(m, st, cols) for m, st in seeded.items()], rm_name)
    stages = [data.stage(scope, expert_cfgs), base.stage(scope, base_cfg), *experts.stages(scope, expert_cfgs, rm),
              mopd.stage(scope, mopd_cfg, teachers, rm_name), *warm.values(), *bls.values(), *more, *ev.values(),
              report.stage(root, cols, {m: s.name for m, s in ev.items()}, teachers, "seq_kd" in bls, scope.tracking,
                           baselines=scored, mopd_cfg=mopd_cfg, seeds=seeds.groups(scope, seeded))]
    return Plan(root=root, cfg=cfg, keys=scope.keys, tracking_uri=scope.tracking.uri, stages=stages,
                mopd_cfg=mopd_cfg, columns=cols)


def select(cfg: PipelineConfig, root: Path) -> Scope:
    """The domains and teacher keys this run trains (checked against the recipes folder),
    the run folder's layout and the MLflow store."""
    recipes_dir = find(cfg.experts.recipes)
    known = all_domains(recipes_dir)
    # Agent domains (multi-turn episodes) join when named in `domains`: their episodes make
    # every stage several times longer (the expert, MOPD's sampling, seq-KD's teacher, the
    # evals), so the default run, the README's main job, keeps to the single-turn ones.
    # A team's domain (its package's `mopd.domains` entry point, or a 'module:attribute'
    # path) joins when named, with the recipes its package ships.
    domains = [named_domain(d, known, recipes_dir) for d in cfg.domains] or \
        [d for d in known if not is_agent_domain(d)]
    if not domains:
        raise ConfigError(f"pipeline: no domains (none under {recipes_dir} and `domains` is empty)")
    for d in domains:
        load_domain(d)
    keys = [Key(k, d, e) for d in domains for k, e in teacher_keys(d)]
    names = {k.key for k in keys}
    for k in cfg.experts.domains:
        # an entry of a domain this run leaves out is fine (a preset sizes every domain it
        # covers, and `domains=[math]` runs one of them); a name that is no domain is a typo
        if k not in names and k not in domains and not _known_key(k, known):
            raise ConfigError(f"pipeline: experts.domains.{k}: not a domain or domain/effort "
                              f"(selected: {sorted(set(domains) | names)}; known: {known})")
    tracking = Tracking(uri=resolve_uri(cfg.mlflow.tracking_uri, root), experiment=cfg.mlflow.experiment)
    base_checkpoint = base.resolve(cfg, tracking.uri)
    return Scope(cfg=cfg, domains=domains, keys=keys, layout=Layout(root), tracking=tracking,
                 base_checkpoint=base_checkpoint, student_checkpoint=mopd.resolve_student(cfg, base_checkpoint,
                                                                                          tracking.uri))


def _known_key(k: str, known: list[str]) -> bool:
    """`k` names a domain under the recipes folder, or one of its domain/effort keys."""
    d = k.split("/")[0]
    return d in known and (k == d or k in {key for key, _ in teacher_keys(d)})


def named_domain(d: str, known: list[str], recipes_dir: Path) -> str:
    """A `domains` entry as the domain's name: one with recipes under `recipes_dir`, or a
    registered domain (built-in, a team's package), or a 'module:attribute' path."""
    if d in known:
        return d
    try:
        return get_domain(d).name
    except ValueError as e:
        raise ConfigError(f"pipeline: domains: {d!r} has no recipes under {recipes_dir} and is no registered "
                          f"domain ({e})") from None
