"""Data of the `frontend_loop` domain: the frontend domain's page tasks
(experts/frontend/data.py: the same prompts, checks and splits) as episodes of the
environment in rewards/frontend_loop.py.

The scripted (oracle) episode the expert's SFT learns from, played through the real
environment so every report is the browser's:

    perturbed   an imperfect first page (the reference with one frontend corruption:
                wrong colors, wrong texts, a broken layout or a missing element), its
                render report, the reference page, "All checks pass.", then DONE. The
                imperfect page is context, not a target (no loss on it): trained on, it
                taught the expert to write a wrong first page in `perturb` of its episodes
    plain       the reference page, "All checks pass.", then DONE

`agent.perturb` of the recipe is the share of perturbed episodes: the expert learns to
read a report and fix what it names, and to stop when the report says nothing fails. The
task dict carries the reference page (`reference`) for the oracle; the environment never
shows it.

Rows: prompt (the page request), completion (the oracle episode after it), domain, task
(JSON: id, family, user, checks, reference), harness (its name).
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import datasets

from experts.agent_expert import AgentExpert
from experts.frontend import data as frontend
from experts.procedural import episode_dataset
from core.agent.harness import HarnessConfig, as_harness_config
from rewards.frontend_loop import DOMAIN, DONE, HARNESSES, MAX_TURNS, harness_config, make_env, prerendered

EFFORTS: tuple[str, ...] = ()
# The scripted pages never hang: a render past the episode deadline is a busy machine, so
# the oracle's renders get this much longer.
ORACLE_TIMEOUT_S = 60.0
MULTI_TURN = True
DATASETS: dict = {}


def make_tasks(split: str, n: int, seed: int = 0, difficulty: int = 1) -> list[dict]:
    """n page tasks of `split` (the frontend domain's own split of its prompts)."""
    frontend._check_args(split, n, None)
    out = []
    for family, prompt, page, checks in frontend._problems(split, n, seed, difficulty):
        tid = hashlib.sha256(prompt.encode()).hexdigest()[:12]
        out.append({"id": f"{family}-{tid}", "family": family, "user": prompt, "checks": checks, "reference": page})
    return out


def imperfect_page(task: dict, rng: random.Random) -> str:
    """The reference with one corruption kind that changes it (a first try to revise)."""
    kinds = list(frontend.CORRUPTIONS)
    rng.shuffle(kinds)
    for kind in kinds:
        page = frontend.corrupt_kind(task["reference"], kind, rng)
        if page.strip() and page != task["reference"]:
            return page
    return ""


def play_texts(task: dict, texts: list[str], harness_cfg=None, harnesses=None) -> list[dict]:
    """The episode of these assistant turns through the real environment: user message, then
    each turn and the observation it got (none after the turn that ended it)."""
    cfg = as_harness_config(harness_cfg, harnesses or HARNESSES)
    env = make_env(cfg, max_turns=max(MAX_TURNS, len(texts)), timeout_s=ORACLE_TIMEOUT_S)
    msgs = [{"role": "user", "content": env.reset(task)}]
    try:
        for k, text in enumerate(texts):
            obs, done, _info = env.step(text)
            msgs.append({"role": "assistant", "content": text})
            if done:
                if k != len(texts) - 1:
                    raise RuntimeError(f"{DOMAIN}: the scripted episode of {task['id']} ended at turn {k}")
                return msgs
            msgs.append({"role": "user", "content": obs})
    finally:
        env.close()
    raise RuntimeError(f"{DOMAIN}: the scripted episode of {task['id']} did not end")


def oracle_messages(task: dict | str, harness_cfg=None, perturb: bool = False, rng: random.Random | None = None,
                    harnesses=None) -> list[dict]:
    """The scripted episode (module doc) as chat messages after the system prompt."""
    task = json.loads(task) if isinstance(task, str) else task
    ref = task["reference"]
    texts = [ref, DONE]
    if perturb:
        bad = imperfect_page(task, rng or random.Random(0))
        if bad:
            msgs = play_texts(task, [bad, ref, DONE], harness_cfg, harnesses)
            msgs[1]["loss"] = False   # the scripted mistake: seen, never learnt (module doc)
            return msgs
    return play_texts(task, texts, harness_cfg, harnesses)


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1, effort: str | None = None, *,
                 harness: str | None = None, harnesses: str | Path | None = None) -> datasets.Dataset:
    """Page tasks as episode rows; the completion is the plain oracle episode."""
    if effort is not None:
        raise ValueError(f"{DOMAIN} has no reasoning efforts; got effort={effort!r}")
    cfg = harness_config(harness, harnesses)
    tasks = make_tasks(split, n, seed, difficulty)

    def build():
        return episode_dataset(DOMAIN, tasks, [cfg] * len(tasks), oracle_messages)
    # the pages rendered concurrently first (one at a time, 1000 tasks took ~11 min on 2 loaded cores)
    with prerendered(build, timeout_s=ORACLE_TIMEOUT_S):
        return build()


def corrupt(row: dict, reference, rng: random.Random) -> list[dict]:
    """An episode that stops at an imperfect page (it says DONE without revising)."""
    task = json.loads(row["task"]) if isinstance(row["task"], str) else row["task"]
    bad = frontend.corrupt({}, task["reference"], rng)
    return play_texts(task, [bad, DONE], row.get("harness"))[1:]


def _episode_env(harness_cfg: HarnessConfig, task: dict, cfg=None):
    turns = getattr(getattr(cfg, "agent", None), "max_turns", MAX_TURNS)
    return make_env(harness_cfg, max_turns=turns)


class LoopExpert(AgentExpert):
    """The agent experts' stages; the SFT's scripted episodes have their pages rendered
    concurrently first (rewards.frontend_loop.prerendered), the same transcripts as one
    page at a time."""

    def sft_transcripts(self, cfg, tokenizer, train_ds):
        from rewards.frontend_loop import prerendered

        with prerendered(lambda: AgentExpert.sft_transcripts(self, cfg, tokenizer, train_ds),
                         timeout_s=ORACLE_TIMEOUT_S):
            return AgentExpert.sft_transcripts(self, cfg, tokenizer, train_ds)


# experts/run.py's SFT and RL stages for this domain (the agent experts' loop)
TRAINER = LoopExpert(_episode_env, oracle_messages, DOMAIN)
