"""Agent domains in the MOPD loop (`agents:` in the recipe).

A row of an agent domain is a task (its `task` column, a JSON object): the student plays
it as a multi-turn episode against the domain's environment (`mopd.agent.episode`),
under a harness drawn per episode from the domain's harness mix with a seeded rng (so
reruns and ranks agree). Each episode segment becomes one training row: the teacher
scores its whole transcript in one forward pass, and its loss mask keeps the loss, the
importance weights and the metrics on the tokens the student wrote.

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

from mopd.agent.episode import Episode, run_episodes
from mopd.agent.harness import HarnessMix, MemoryStore, load_harnesses
from mopd.agent.transcript import prompt_ids
from mopd.config import ConfigError
from mopd.distill.config import AgentDomainConfig, DistillConfig, RolloutConfig
from mopd.rollout import Sample


@dataclass
class AgentDomain:
    """One agent domain, ready to play: its settings, environment factory, harness mix and
    the memory store its episodes share (notes kept across episodes of a task family)."""
    name: str
    cfg: AgentDomainConfig
    factory: Callable
    mix: HarnessMix
    memory: MemoryStore


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
    for d, a in cfg.agents.items():
        factory = _import_factory(a.env, f"agents.{d}.env")
        try:
            mix = load_harnesses(a.harnesses)
        except ConfigError as e:
            raise ConfigError(f"agents.{d}.harnesses: {e}") from None
        for h in mix.harnesses + mix.held_out:
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
        out[d] = AgentDomain(d, a, factory, mix, MemoryStore())
    return out


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


def play(agents: dict[str, AgentDomain], rollout, tokenizer, eos: set[int], rows: list, seeds: list[int],
         idx: list[int], rd: dict[str, RolloutConfig]) -> list[Episode]:
    """One episode for each row of `idx` (seeded by its sample seed), each agent domain's
    episodes in one batched run at that domain's sampling settings. In the order of `idx`."""
    episodes: dict[int, Episode] = {}
    for d, a in agents.items():
        sel = [i for i in idx if rows[i].domain == d]
        if not sel:
            continue
        envs = []
        for i in sel:
            h = a.mix.sample(random.Random(seeds[i]))
            try:
                envs.append(a.factory(harness_cfg=h, memory=a.memory))
            except Exception as e:   # noqa: BLE001 (this episode fails; the run goes on)
                envs.append(_BrokenEnv(e, h.name))
        r = rd[d]
        for i, ep in zip(sel, run_episodes(rollout, tokenizer, envs, [_task(rows[i]) for i in sel],
                                           seeds=[seeds[i] for i in sel], temperature=r.temperature,
                                           top_p=r.top_p, max_turns=a.cfg.max_turns,
                                           max_context_tokens=a.cfg.max_context_tokens,
                                           max_new_tokens=a.cfg.max_new_tokens, eos_ids=eos)):
            episodes[i] = ep
    return [episodes[i] for i in idx]


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
