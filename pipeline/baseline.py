"""`mopd baseline seq-kd | mix-rl | warmup --config R --out DIR [key=value ...] [--dry-run]`:
one baseline of the report as a command of its own, matched to a MOPD recipe (its student,
teachers, prompt stream, mix and seed) and to that recipe's finished run (`mopd_run`: its
history gives the student tokens and steps the baseline's budget equals).

The pipeline's own stage functions do the work (pipeline/stages/baselines.py
`run_seq_kd`, pipeline/stages/mix_rl.py `run`, pipeline/stages/warmup_mopd.py `run`):
this module only builds the StageContext they read (the MOPD run as the `mopd` input,
each teacher's checkpoint as a stage of its own), so a baseline trained here and one
trained inside `mopd pipeline` are the same computation.

Under `accelerate launch` (core/ranks.py): rank 0 holds the lock, opens the MLflow run,
writes the checkpoint and summary.json; seq-KD's SFT splits each global batch over the
ranks (core/sft.py), Mix-RL's GRPO shards its prompts (TRL), the warm-up's MOPD part is
`mopd distill`'s loop."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from core import ranks
from core.config import ConfigError, in_range, load_config, option
from pipeline.config import MixRLSection, SeqKDSection

KINDS = ("seq-kd", "mix-rl", "warmup")


@dataclass
class BaselineConfig:
    mopd: str = option("the MOPD recipe the baseline is matched to (its model.path is the start, its teachers, "
                       "data, mix, seed and rollout.max_new_tokens are the baseline's); read from the working "
                       "directory, else beside this file", "")
    mopd_overrides: list[str] = option("key=value overrides for that recipe", factory=list)
    mopd_run: str = option("a finished `mopd distill --out` of that recipe: its history.json gives the student "
                           "tokens and steps the budget equals; empty: budget_tokens and budget_steps", "")
    budget_tokens: int = option("student tokens MOPD trained on (without mopd_run)", 0)
    budget_steps: int = option("MOPD's optimizer steps (without mopd_run)", 0)
    seq_kd: SeqKDSection = option("seq-KD's settings (also the warm-up's)", factory=SeqKDSection)
    mix_rl: MixRLSection = option("Mix-RL's settings; a null one takes the experts' RL default", factory=MixRLSection)
    rewards: dict[str, str] = option("Mix-RL: domain -> 'module:function' reward; a domain not named: the MOPD "
                                     "recipe's `rewards`, else the registered domain's", factory=dict)
    warmup_share: float = option("warm-up: the share of MOPD's student tokens trained by seq-KD first", 0.3)

    def validate(self):
        if not self.mopd:
            raise ConfigError("mopd: required (the MOPD recipe this baseline is matched to)")
        in_range("budget_tokens", self.budget_tokens, 0)
        in_range("budget_steps", self.budget_steps, 0)
        in_range("warmup_share", self.warmup_share, 0, 1, low_open=True, high_open=True)


def mopd_recipe(cfg: BaselineConfig, recipe: str | Path | None):
    """The MOPD recipe (DistillConfig) with its overrides."""
    from mopd.distill.config import DistillConfig

    p = Path(cfg.mopd)
    if not p.exists() and recipe is not None and not p.is_absolute() and (Path(recipe).parent / p).exists():
        p = Path(recipe).parent / p
    return load_config(DistillConfig, p, cfg.mopd_overrides)


def budget(cfg: BaselineConfig) -> dict:
    """{"tokens", "steps", "history"}: the MOPD run the baseline matches (mopd_run's history.json), or the
    budget_* keys."""
    if cfg.mopd_run:
        hist = Path(cfg.mopd_run) / "history.json"
        if not hist.is_file():
            raise ConfigError(f"mopd_run: {hist} does not exist (the history a finished `mopd distill --out "
                              f"{cfg.mopd_run}` writes); run MOPD first, or give budget_tokens and budget_steps")
        from evals.report import tokens_from_history

        h = json.loads(hist.read_text())
        return {"tokens": tokens_from_history(h), "steps": len(h), "history": str(hist)}
    if cfg.budget_tokens < 1 or cfg.budget_steps < 1:
        raise ConfigError("budget: give mopd_run (a finished MOPD run's --out) or both budget_tokens and "
                          "budget_steps (>= 1)")
    return {"tokens": cfg.budget_tokens, "steps": cfg.budget_steps, "history": ""}


def rl_settings(cfg: BaselineConfig) -> dict:
    """Mix-RL's GRPO settings: the section's, a null one the experts' RL default (ExpertConfig's)."""
    from experts.run import ExpertConfig
    from pipeline.stages.mix_rl import rl_settings as from_recipes

    return from_recipes(cfg.mix_rl, {"defaults": ExpertConfig()})


def reward_refs(cfg: BaselineConfig, mopd_cfg, domains: list[str]) -> dict[str, str]:
    from experts.registry import reward_ref

    out = {}
    for d in domains:
        ref = cfg.rewards.get(d) or mopd_cfg.rewards.get(d)
        if not ref:
            try:
                ref = reward_ref(d)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"rewards.{d}: no reward for domain {d!r} ({e}); name one: rewards.{d}=module:function") \
                    from None
        out[d] = ref
    return out


def dry_run(kind: str, cfg: BaselineConfig, recipe, dry, *, accelerate_config: str = "") -> None:
    """Every problem of `mopd baseline KIND` at once: the MOPD recipe's inputs (its dry run), the budget, the
    per-rank split, Mix-RL's rewards."""
    from mopd.distill.dryrun import dry_run as distill_dry_run
    from mopd.distill.data import load_reward_fn

    mopd_cfg = dry.check(mopd_recipe, cfg, recipe)
    if mopd_cfg is None:
        return
    distill_dry_run(mopd_cfg, None, dry, accelerate_config=accelerate_config)
    b = dry.check(budget, cfg)
    if b is not None:
        dry.show("budget", f"{b['tokens']:,} student tokens, {b['steps']} steps (MOPD's)")
    world = ranks.world_size() if not accelerate_config else max(1, _processes(dry))
    if kind in ("seq-kd", "warmup") and cfg.seq_kd.batch_size % world:
        dry.problem(f"seq_kd.batch_size={cfg.seq_kd.batch_size} does not split over {world} processes")
    if kind == "mix-rl":
        rl = dry.check(rl_settings, cfg)
        if rl is not None and (rl["batch_size"] * rl["num_generations"]) % world:
            dry.problem(f"mix_rl: batch_size x num_generations = {rl['batch_size'] * rl['num_generations']} does "
                        f"not split over {world} processes")
        domains = sorted(mopd_cfg.data.mix) or sorted(mopd_cfg.teachers)
        refs = dry.check(reward_refs, cfg, mopd_cfg, domains) or {}
        for d, ref in refs.items():
            dry.check(load_reward_fn, ref)
        dry.show("rewards", ", ".join(f"{d} {r}" for d, r in refs.items()) or "-")


def _processes(dry) -> int:
    for line in dry.lines:
        if line.strip().startswith("processes"):
            n = line.split()[1]
            return int(n) if n.isdigit() else 1
    return 1


def _context(name: str, out: Path, cfg: BaselineConfig, mopd_cfg, parent_run_id: str | None = None):
    """The StageContext the pipeline's stage function reads: the start as `base`, the MOPD run as `mopd`,
    each teacher's checkpoint as stage `teacher/<key>`."""
    from pipeline.runner import StageContext
    from teachers.resolve import resolve_ref

    inputs = {"base": {"checkpoint": str(resolve_ref(mopd_cfg.model.path, tracking_uri=mopd_cfg.mlflow.tracking_uri))},
              "mopd": budget(cfg)}
    teachers = {}
    for key, spec in mopd_cfg.teachers.items():
        teachers[key] = f"teacher/{key}"
        inputs[teachers[key]] = {"checkpoint": str(resolve_ref(spec.path, tracking_uri=mopd_cfg.mlflow.tracking_uri))}
    ctx = StageContext(name=name, out=out, resume=False, inputs=inputs, hash="", seconds={},
                       parent_run_id=parent_run_id)
    return ctx, teachers


def _tracking(mopd_cfg, out: Path):
    from core.tracking import resolve_uri
    from pipeline.stages.common import Tracking

    return Tracking(uri=resolve_uri(mopd_cfg.mlflow.tracking_uri, out), experiment=mopd_cfg.mlflow.experiment)


def _seq_kd(cfg, mopd_cfg, out: Path, *, share: float = 1.0, name: str = "baseline/seq_kd",
            parent_run_id: str | None = None) -> dict:
    from pipeline.stages.baselines import run_seq_kd

    ctx, teachers = _context(name, out, cfg, mopd_cfg, parent_run_id)
    sk = cfg.seq_kd
    settings = {**dataclasses.asdict(sk), "max_new_tokens": sk.max_new_tokens or mopd_cfg.rollout.max_new_tokens,
                "mopd": cfg.mopd, "budget": ctx.inputs["mopd"]}
    if share != 1.0:   # the warm-up trains on its share of the tokens (the pipeline's warm-up stage: the same)
        settings.pop("match")
    return run_seq_kd(ctx, sk, settings, mopd_cfg, None, teachers, _tracking(mopd_cfg, out), share=share,
                      run_name=name.split("/")[-1])


def _mix_rl(cfg, mopd_cfg, out: Path) -> dict:
    from pipeline.stages import mix_rl as stage

    ctx, _ = _context(stage.MIX_RL, out, cfg, mopd_cfg)
    domains = sorted(mopd_cfg.data.mix) or sorted(mopd_cfg.teachers)
    refs = reward_refs(cfg, mopd_cfg, domains)
    stream = dataclasses.replace(mopd_cfg, agents={})
    settings = {"rl": rl_settings(cfg), "n_samples": cfg.mix_rl.n_samples or stage.mopd_samples(mopd_cfg),
                "domains": domains, "skipped_domains": [], "reward_kwargs": {d: mopd_cfg.reward_kwargs.get(d) for d in domains},
                "start": ctx.inputs["base"]["checkpoint"], "cascade": None, "rewards": refs}
    return stage.run(ctx, settings, stream, None, _tracking(mopd_cfg, out), run_name="mix_rl")


def _warmup(cfg, mopd_cfg, out: Path) -> dict:
    from pipeline.stages import warmup_mopd as stage

    tracking = _tracking(mopd_cfg, out)
    ctx, teachers = _context(stage.WARMUP_MOPD, out / "mopd", cfg, mopd_cfg)
    with tracking.stage_run(ctx, "warmup_mopd") as parent:   # the two parts' runs nest under it
        pid = parent.info.run_id if parent is not None else None
        warm = _seq_kd(cfg, mopd_cfg, out / "warmup", share=cfg.warmup_share, name=stage.WARMUP, parent_run_id=pid)
        ctx.inputs[stage.WARMUP] = warm
        ctx.parent_run_id = pid
        res = stage.run(ctx, dataclasses.replace(mopd_cfg, mlflow=dataclasses.replace(mopd_cfg.mlflow,
                                                                                      run_name="mopd")),
                        cfg.warmup_share, teachers)
    return res


RUNNERS = {"seq-kd": _seq_kd, "mix-rl": _mix_rl, "warmup": _warmup}


def run(kind: str, cfg: BaselineConfig, recipe, out: str | Path) -> dict:
    """Train baseline `kind` into `out` (rank 0 writes out/summary.json); returns the summary."""
    from core.dryrun import DryRun

    dry = DryRun(f"mopd baseline {kind}")
    dry_run(kind, cfg, recipe, dry)
    dry.raise_if_any()   # every problem the dry run names, before any model loads
    ranks.state()        # the process group (gloo on CPU) before TRL or transformers build theirs
    out = Path(out)
    mopd_cfg = mopd_recipe(cfg, recipe)
    # one store for every run of the command (the warm-up's MOPD part writes into out/mopd)
    mopd_cfg = dataclasses.replace(mopd_cfg, mlflow=dataclasses.replace(
        mopd_cfg.mlflow, tracking_uri=_tracking(mopd_cfg, out).uri))
    s = RUNNERS[kind](cfg, mopd_cfg, out)
    if ranks.is_main():
        (out / "summary.json").write_text(json.dumps({"baseline": kind, **s}, indent=1, default=str))
    return s


