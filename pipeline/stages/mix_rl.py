"""Stages `baseline/mix_rl` (joint GRPO over every single-turn domain at once) and
`baseline/cascade_rl` (the domains one after another) -> DIR/baselines/<name>/model: RL
from the MOPD student's starting point (the base) with MOPD's number of student samples,
on MOPD's own prompt stream (DIR/data, its domain mix and seed), each row scored by its
domain's reward (chat through the chat_rm stage's reward model), QAT on like the experts.

The RL settings are `baselines.mix_rl`'s; a setting left null takes the value most of
the run's RL expert recipes use (max_completion_length: the longest, since one run
samples every domain). Agent domains (multi-turn episodes) are left out: a run naming
them trains Mix-RL on its single-turn domains, says so in the log and in the stage's
summary (`skipped_domains`), and the report notes it. The budget: MOPD's sampled batches
(ceil(train.max_steps / train.minibatches)) x prompts_per_step x samples_per_prompt
student samples, unless `n_samples` says otherwise; see mopd.baselines.mix_rl for how
that becomes GRPO steps."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from functools import partial

from experts.registry import is_agent_domain, reward_ref
from experts.run import ExpertConfig
from mopd.baselines import mopd_prompt_stream
from mopd.baselines.budget import checkpoint_params, rl_budget
from mopd.baselines.mix_rl import mix_rl, plan_phases
from core.config import ConfigError, to_dict
from mopd.distill import DistillConfig
from mopd.distill.data import load_reward_fn
from core.quant import QuantConfig
from pipeline.config import MixRLSection
from pipeline.runner import Stage, StageContext, say
from pipeline.stages.common import Layout, Scope, Tracking, key_dir, log_metrics, log_model, log_params, seeded_name
from pipeline.stages.experts import quant_label

MIX_RL, CASCADE_RL = "baseline/mix_rl", "baseline/cascade_rl"
# (setting, where the RL expert recipe keeps it)
FROM_RECIPES = (("lr", "train.lr"), ("batch_size", "train.batch_size"), ("num_generations", "rl.num_generations"),
                ("temperature", "rl.temperature"), ("beta", "rl.beta"), ("epsilon", "rl.epsilon"),
                ("loss_type", "rl.loss_type"), ("scale_rewards", "rl.scale_rewards"))


def mopd_samples(mopd_cfg: DistillConfig) -> int:
    """Student samples the MOPD stage draws: one batch of prompts_per_step prompts x
    samples_per_prompt per `minibatches` optimizer steps."""
    t = mopd_cfg.train
    return math.ceil(t.max_steps / t.minibatches) * t.prompts_per_step * mopd_cfg.rollout.samples_per_prompt


def rl_settings(section: MixRLSection, rl_cfgs: dict[str, ExpertConfig]) -> dict:
    """The GRPO settings: the section's, a null one from the RL expert recipes of the keys
    in `rl_cfgs` (the value most of them use; ties: the first key's), max_completion_length
    the longest of theirs."""
    def get(c: ExpertConfig, path: str):
        sec, _, k = path.partition(".")
        return getattr(getattr(c, sec), k)

    cfgs = list(rl_cfgs.values())
    out = {}
    for k, path in FROM_RECIPES:
        own = getattr(section, k, None)
        if own is not None:
            out[k] = own
        else:
            vals = [get(c, path) for c in cfgs]
            counts = Counter(vals)
            out[k] = max(vals, key=lambda v: (counts[v], -vals.index(v)))
    out["max_completion_length"] = section.max_completion_length or max(c.rl.max_completion_length for c in cfgs)
    out.update(warmup_steps=section.warmup_steps, seed=section.seed)
    if out["num_generations"] < 2:
        raise ConfigError(f"baselines.mix_rl.num_generations must be >= 2, the RL recipes give "
                          f"{out['num_generations']}")
    return out


def stream_config(mopd_cfg: DistillConfig, keys: list[str], domains: list[str]) -> DistillConfig:
    """MOPD's config cut to the teacher `keys` and `domains` Mix-RL trains on: the same data
    files, mix weights and sampler seed, without the agent domains' entries."""
    d = mopd_cfg.data
    keep = {key_dir(k) for k in keys}
    datasets = [s for s in d.datasets if s.path.rstrip("/").split("/")[-1] in keep]
    return dataclasses.replace(
        mopd_cfg, data=dataclasses.replace(d, datasets=datasets, mix={x: w for x, w in d.mix.items() if x in domains}),
        teachers={k: v for k, v in mopd_cfg.teachers.items() if k in keys}, agents={},
        rewards={x: r for x, r in mopd_cfg.rewards.items() if x in domains},
        reward_kwargs={x: r for x, r in mopd_cfg.reward_kwargs.items() if x in domains},
        rollout=dataclasses.replace(mopd_cfg.rollout,
                                    by_domain={x: o for x, o in mopd_cfg.rollout.by_domain.items() if x in domains}))


def stages(scope: Scope, mopd_cfg: DistillConfig, quant: QuantConfig | None,
           experts: dict[str, dict[str, ExpertConfig]], rm: str | None, seed: int | None = None) -> dict[str, Stage]:
    """{"mix_rl": stage, "cascade_rl": stage} for the enabled ones; `experts`: the resolved
    expert configs by teacher key; `rm`: the chat RM stage, if any. `seed`: the `extra_seeds`
    copy of Mix-RL alone, with that seed, matched to that seed's MOPD (`mopd_cfg` its config)."""
    bl = scope.cfg.baselines
    if seed is not None:
        bl = dataclasses.replace(bl, mix_rl=dataclasses.replace(bl.mix_rl, seed=seed),
                                 cascade_rl=dataclasses.replace(bl.cascade_rl, enabled=False))
    if not (bl.mix_rl.enabled or bl.cascade_rl.enabled):
        return {}
    single = [d for d in scope.domains if not is_agent_domain(d)]
    skipped = [d for d in scope.domains if is_agent_domain(d)]
    if not single:
        raise ConfigError(f"baselines.mix_rl / cascade_rl: no single-turn domain in this run (domains "
                          f"{scope.domains}); agent domains are out of their scope: disable them")
    keys = [k for k in scope.keys if k.domain in single]
    mix = mopd_cfg.data.mix
    zero = [d for d in single if mix and mix.get(d, 0) <= 0]
    if zero:
        raise ConfigError(f"baselines.mix_rl: domains {zero} have weight 0 in the MOPD recipe's data.mix; "
                          "RL would never draw their prompts")
    rl = rl_settings(bl.mix_rl, {k.key: experts[k.key]["rl"] for k in keys})
    # each domain's reward with its RL recipe's settings (chat: the pipeline's reward model)
    reward_kwargs = {}
    for k in keys:
        reward_kwargs.setdefault(k.domain, dict(experts[k.key]["rl"].rl.reward_kwargs))
    n_samples = bl.mix_rl.n_samples or mopd_samples(mopd_cfg)
    cfg = stream_config(mopd_cfg, [k.key for k in keys], single)
    common = {"rl": rl, "n_samples": n_samples, "domains": single, "skipped_domains": skipped,
              "reward_kwargs": reward_kwargs, "start": mopd_cfg.model.path,
              "prompts": {"data": to_dict(cfg.data), "seed": cfg.train.seed,
                          "prompts_per_step": cfg.train.prompts_per_step, "minibatches": cfg.train.minibatches},
              "quant": dataclasses.asdict(quant) if quant else None}
    deps = ["data", "base", *([rm] if rm and "chat" in single else [])]
    shows = {"model": mopd_cfg.model.path, "dtype": "float32", "quant": quant_label(quant)}
    out = {}
    if bl.mix_rl.enabled:
        s = {**common, "cascade": None}
        out["mix_rl"] = Stage(seeded_name(MIX_RL, seed), scope.layout.hashed(s),
                              partial(run, settings=s, stream_cfg=cfg, quant=quant, tracking=scope.tracking,
                                      run_name=key_dir(seeded_name("mix_rl", seed))),
                              deps=deps, out=Layout(scope.layout.seeded(seed)).baseline("mix_rl"), shows=shows)
    if bl.cascade_rl.enabled:
        order = list(bl.cascade_rl.order) or single
        bad = sorted(set(order) ^ set(single))
        if bad or len(order) != len(set(order)):
            raise ConfigError(f"baselines.cascade_rl.order must name each single-turn domain of the run once "
                              f"({single}), got {order}")
        s = {**common, "cascade": order}
        out["cascade_rl"] = Stage(CASCADE_RL, scope.layout.hashed(s),
                                  partial(run, settings=s, stream_cfg=cfg, quant=quant, tracking=scope.tracking,
                                          run_name="cascade_rl"),
                                  deps=deps, out=scope.layout.baseline("cascade_rl"), shows=shows)
    return out


def run(ctx: StageContext, settings: dict, stream_cfg: DistillConfig, quant: QuantConfig | None,
        tracking: Tracking, run_name: str) -> dict:
    from transformers import AutoTokenizer

    start, rl = settings["start"], settings["rl"]
    if settings["skipped_domains"]:
        say(f"{run_name}: agent domains {settings['skipped_domains']} are out of its scope (multi-turn "
            f"episodes); training on {settings['domains']}")
    # `rewards`: domain -> reward ref, given by `mopd baseline mix-rl`; else the registered domain's
    rewards = {d: load_reward_fn(settings.get("rewards", {}).get(d) or reward_ref(d),
                                 settings["reward_kwargs"].get(d) or None)
               for d in settings["domains"]}
    tok = AutoTokenizer.from_pretrained(start)
    order = settings["cascade"]
    phases = plan_phases(mopd_prompt_stream(stream_cfg, tok), order or settings["domains"], settings["n_samples"],
                         batch_size=rl["batch_size"], num_generations=rl["num_generations"], cascade=bool(order))
    with tracking.stage_run(ctx, run_name):
        log_params({**{f"rl/{k}": v for k, v in rl.items()}, "n_samples": settings["n_samples"],
                    "domains": settings["domains"], "cascade": order})
        s = mix_rl(start, phases, rewards, ctx.out, quant=quant, **rl)
        budget = rl_budget(n_student=checkpoint_params(start), tokens=s["tokens"], samples=s["samples"],
                           beta=rl["beta"])
        log_metrics({"samples": s["samples"], "tokens": s["tokens"], "steps": s["steps"], "flops": budget["flops"],
                     **{f"reward_last/{k}": v["last"] for k, v in s["reward"].items()}})
        log_model(s["checkpoint"])
    return {**s, "budget_samples": settings["n_samples"], "budget": budget,
            "skipped_domains": settings["skipped_domains"], "rl": rl}
