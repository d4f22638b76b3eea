"""Stage `mopd`: one student from the base (or `mopd.student`), every RL expert a teacher
(the MOPD loop, mopd.distill) -> DIR/mopd. Its config is `mopd.recipe` with `mopd.overrides`,
then what the pipeline owns: the student's start, DIR/data as prompts, the experts as teachers
(the recipe's teacher backend kept), the experts' quant, the step cap, the MLflow store.
A killed run resumes from its last checkpoint (train.save_every) when its hash matches."""
from __future__ import annotations

import dataclasses
import shutil
from functools import partial

from evals.report import tokens_from_history
from core.config import ConfigError, checked, load_config
from mopd.distill import DistillConfig, run as distill
from mopd.distill.checkpoints import latest_checkpoint
from experts.registry import environment_ref, get as get_domain, is_agent_domain
from mopd.distill.config import AgentDomainConfig, DatasetSpec, TeacherSpec
from core.quant import QuantConfig
from pipeline.runner import Stage, StageContext, say
from pipeline.stages.experts import config as experts_config
from pipeline.stages.experts import quant_label
from pipeline.config import PipelineConfig
from pipeline.stages.common import MLFLOW_OWNED, Scope, find, names, overridden, refuse, resolve_checkpoint, \
    seeded_name, settings, with_parent

NAME = "mopd"


# what the pipeline sets in the MOPD config itself: an override of one is an error
OWNED = {
    "model.path": "the student is the pipeline's mopd.student (default: the base, as every expert): set "
                  "mopd.student to start it from a checkpoint of your own",
    "data.datasets": "the prompts are the pipeline's (DIR/data, mopd.n_prompts per teacher key)",
    "train.resume": "the pipeline resumes a killed MOPD stage itself when its settings are unchanged",
    "reward_kwargs.chat.reward_model": "chat is scored with the pipeline's own reward model (the chat_rm stage)",
    "mlflow.run_name": "the pipeline names the stage's run", **MLFLOW_OWNED}


def config(scope: Scope, quant: QuantConfig) -> DistillConfig:
    recipe = find(scope.cfg.mopd.recipe)
    named = overridden(list(scope.cfg.mopd.overrides))
    refuse(named, OWNED, f"mopd.overrides ({recipe})")
    # a teacher setting named for a key the recipe has no entry for needs a path to load;
    # the expert's, which is what the key gets anyway
    paths = [f"teachers.{key}.path={scope.layout.expert_model(key, 'rl')}"
             for key in {k.split(".")[1] for k in names(named, "teachers") if k.count(".") >= 2}]
    c = load_config(DistillConfig, recipe, paths + list(scope.cfg.mopd.overrides))
    L, domains = scope.layout, scope.domains
    check_quant(named, c.quant, quant, recipe)
    # The recipe's own teacher entries are placeholders; their backend is kept.
    backend = next(iter(c.teachers.values())).backend
    # the recipe covers every domain; a run over some of them keeps their entries only
    mix = {d: w for d, w in c.data.mix.items() if d in domains}
    if mix:   # a team's domain the recipe does not weigh: the weight its Domain object proposes
        mix.update({d: get_domain(d).mix_weight for d in domains if d not in mix and get_domain(d).mix_weight})
    missing = [d for d in domains if d not in mix]
    if mix and missing:
        raise ConfigError(f"{recipe}: data.mix has no weight for {missing} (drop data.mix for uniform)")
    reward_kwargs = c.reward_kwargs
    if uses_chat_rm(scope, c):   # the chat reward scores with the pipeline's reward model
        reward_kwargs = {**reward_kwargs, "chat": {**reward_kwargs.get("chat", {}), "reward_model": str(L.chat_rm)}}
    agents = agent_domains(scope, c)
    c = dataclasses.replace(
        c, model=dataclasses.replace(c.model, path=str(scope.student_model)), reward_kwargs=reward_kwargs,
        data=dataclasses.replace(c.data, datasets=[DatasetSpec(path=str(L.data(k.key))) for k in scope.keys], mix=mix),
        teachers=teacher_specs(scope, c, named, backend),
        quant=dataclasses.replace(quant),
        agents=agents,
        rollout=dataclasses.replace(c.rollout, by_domain={d: o for d, o in c.rollout.by_domain.items() if d in domains},
                                    # the engines' context holds the episodes
                                    max_model_len=max([c.rollout.max_model_len,
                                                       *(a.max_context_tokens for a in agents.values())])),
        train=dataclasses.replace(c.train, max_steps=min(c.train.max_steps, scope.cap), resume=False),
        # the student is registered as <DIR's name>-mopd-student: pipelines sharing a server stay apart
        mlflow=scope.tracking.section(c.mlflow, run_name="mopd",
                                      registered_name=c.mlflow.registered_name or f"{scope.layout.root.name}-mopd"))
    return checked(c, str(recipe))


def resolve_student(cfg: PipelineConfig, base_checkpoint: str, tracking_uri: str) -> str:
    """The local folder of `mopd.student` ("" for the base), checked at plan time: a causal LM
    with a chat template whose tokenizer is the base's, so the experts trained from the base
    can teach it (the same fit check `mopd distill` runs on its teachers, hours earlier)."""
    if not cfg.mopd.student:
        return ""
    from transformers import AutoTokenizer

    from core.tiny import load_tokenizer
    from teachers.resolve import tokenizer_problems

    path = resolve_checkpoint(cfg.mopd.student, "mopd.student", tracking_uri)
    base_tok = AutoTokenizer.from_pretrained(base_checkpoint) if base_checkpoint else load_tokenizer()
    problems = tokenizer_problems(AutoTokenizer.from_pretrained(path), base_tok)
    if problems:
        base = base_checkpoint or f"the tiny base trained from {cfg.base.recipe}"
        raise ConfigError(f"pipeline: mopd.student: {path}'s tokenizer is not the base's ({base}), which every "
                          f"expert, the student's teachers, keeps (the teacher's below is the base's): "
                          f"{'; '.join(problems)}; give a student with the base's tokenizer, or set base.path "
                          f"to a checkpoint with the student's")
    return path


def teacher_specs(scope: Scope, c: DistillConfig, named: dict, backend: str) -> dict[str, TeacherSpec]:
    """Each teacher key's RL expert, with the recipe's backend, and the settings an
    override names for that key (teachers.<key>.<field>) applied; its path (and adapter)
    is the pipeline's: the expert."""
    keys = {k.key for k in scope.keys}
    out = {}
    for key in sorted(names(named, "teachers")):
        parts = key.split(".")
        if len(parts) < 3:
            raise ConfigError(f"pipeline: mopd.overrides {key}: set one teacher's field, teachers.<key>.<field> "
                              f"(keys {sorted(keys)})")
        if parts[1] not in keys:
            raise ConfigError(f"pipeline: mopd.overrides {key}: {parts[1]!r} is not a teacher key of this run "
                              f"({sorted(keys)})")
        if parts[2] in ("path", "adapter"):
            raise ConfigError(f"pipeline: mopd.overrides {key}: the teacher of {parts[1]!r} is the pipeline's "
                              f"{parts[1]} expert; to distill from a checkpoint of your own, run `mopd distill` "
                              f"with it in teachers")
    for k in scope.keys:
        spec = TeacherSpec(path=str(scope.layout.expert_model(k.key, "rl")), backend=backend)
        fields = {key.split(".")[2] for key in names(named, f"teachers.{k.key}")}
        if fields:
            spec = dataclasses.replace(spec, **{f: getattr(c.teachers[k.key], f) for f in fields})
        out[k.key] = spec
    return out


def check_quant(named: dict, quant: QuantConfig, experts_quant: QuantConfig, recipe):
    """The student's quant is the experts' (the pipeline sets it): an override that asks
    for another is an error, one that agrees is fine."""
    if names(named, "quant") and dataclasses.asdict(quant) != dataclasses.asdict(experts_quant):
        raise ConfigError(f"pipeline: mopd.overrides ({recipe}): {', '.join(names(named, 'quant'))} would not reach "
                          f"the student: its quant is the experts' ({dataclasses.asdict(experts_quant)}), so the "
                          f"sampler and the teachers run the same grid; set quant in experts.sft and experts.rl")


def agent_domains(scope: Scope, c: DistillConfig) -> dict[str, AgentDomainConfig]:
    """The selected agent domains' episode settings: the recipe's `agents` entry where it
    has one, else the domain's own, from its RL expert recipe's `agent:` section (the
    team's harnesses, turns and context) with its Domain object's environment."""
    out = {}
    for k in scope.keys:
        if not is_agent_domain(k.domain) or k.domain in out:
            continue
        if k.domain in c.agents:
            out[k.domain] = c.agents[k.domain]
            continue
        a = experts_config(scope, k, "rl").agent
        out[k.domain] = AgentDomainConfig(env=environment_ref(k.domain), harnesses=a.harnesses,
                                          max_turns=a.max_turns, max_context_tokens=a.max_context_tokens,
                                          max_new_tokens=a.max_new_tokens)
    return out


def uses_chat_rm(scope: Scope, cfg: DistillConfig) -> bool:
    """A task reward for chat (loss.task_reward_alpha) needs the chat reward model."""
    return scope.chat and "chat" in cfg.rewards


def seeded_config(cfg: DistillConfig, seed: int) -> DistillConfig:
    """The MOPD config of the `extra_seeds` copy with train seed `seed` (its sampler, init of
    the optimizer's draws and prompt stream; the baselines of that seed replay this stream)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed),
                               mlflow=dataclasses.replace(cfg.mlflow, run_name=f"mopd-seed{seed}"))


def stage(scope: Scope, cfg: DistillConfig, teachers: dict[str, str], rm: str | None,
          seed: int | None = None) -> Stage:
    """`teachers`: teacher key -> its RL expert stage; `rm`: the chat RM stage, if any;
    `seed`: the stage of an `extra_seeds` copy (`cfg` already seeded_config's)."""
    s = settings(cfg)
    s["train"].pop("resume", None)
    s["train"].pop("accept_config_change", None)   # how a run is continued, not what it computes
    deps = ["data", "base", *teachers.values(), *([rm] if rm and uses_chat_rm(scope, cfg) else [])]
    return Stage(seeded_name(NAME, seed), scope.layout.hashed(s), partial(run, cfg=cfg), deps=deps,
                 out=scope.layout.seeded(seed) / "mopd", resumable=True, shows=shows(cfg))


def shows(cfg: DistillConfig) -> dict:
    return {"model": cfg.model.path, "dtype": cfg.model.dtype, "quant": quant_label(cfg.quant),
            "teachers": {k: f"{t.path} ({t.backend})" for k, t in cfg.teachers.items()}}


def run(ctx: StageContext, cfg: DistillConfig) -> dict:
    resume = ctx.resume and latest_checkpoint(ctx.out) is not None
    if resume:
        say(f"mopd: resuming from {latest_checkpoint(ctx.out)}")
    elif ctx.out.exists():
        shutil.rmtree(ctx.out)
    cfg = with_parent(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=resume)), ctx.parent_run_id)
    res = distill(cfg, ctx.out)
    return {"final": res["final"], "mlflow_run_id": res["mlflow_run_id"], "steps": len(res["history"]),
            "tokens": tokens_from_history(res["history"]), "history": str(ctx.out / "history.json")}
