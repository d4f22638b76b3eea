"""Data of the `frontend_loop` domain: the frontend domain's page tasks
(experts/frontend/data.py: the same prompts, checks and splits) as episodes of the
environment in rewards/frontend_loop.py.

The scripted (oracle) episode the expert's SFT learns from, played through the real
environment so every report is the browser's:

    perturbed   an imperfect first page, its render report, the reference page, "All
                checks pass.", then DONE. The imperfect page is one of, in equal shares:
                  kind      the reference with one frontend corruption kind (every color
                            wrong, every text, the layout, or a missing element)
                  slip      the reference with one slip: one color, text, size or element
                            wrong, often one copied from elsewhere in the page (the
                            background as the text color, a neighbour's text), which is how
                            the frontend expert's own first pages go wrong
                  two slips two slips, then a failed fix (the first slip still there, its
                            report still failing) before the reference: the episode does
                            not end after the second page, only after "All checks pass."
                Imperfect pages are context, not targets (no loss on them): trained on, the
                first one taught the expert to write a wrong first page in `perturb` of its
                episodes. What is learnt: the fix, a copy of the page before it with only
                what its report names changed, and DONE after "All checks pass." only
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
import re
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


_COLOR = re.compile(r"(?:background|color):(\w+)")
_SIZE = re.compile(r"(width|height):(\d+)px")
_TEXT = re.compile(r'<(\w+) id="\w+"[^>]*>([^<]+)</\1>')


def slips(reference: str, rng: random.Random) -> list[tuple[int, int, str]]:
    """Every one-property mistake of the reference as (start, end, replacement), one per
    place, in page order; each breaks the check of that place. A slip takes a value from
    elsewhere in the page when there is one (half the time): the frontend expert's own
    wrong first pages are mostly such copies (a color of the spec in the wrong property, a
    neighbour's text)."""
    def pick(value, page_values, pool):
        near = [v for v in dict.fromkeys(page_values) if v != value]
        if near and rng.random() < 0.5:
            return rng.choice(near)
        return rng.choice([v for v in pool if v != value])

    out = []
    colors = [m.group(1) for m in _COLOR.finditer(reference)]
    for m in _COLOR.finditer(reference):
        out.append((m.start(1), m.end(1), pick(m.group(1), colors, frontend.PALETTE)))
    sizes = [m.group(2) for m in _SIZE.finditer(reference)]
    for m in _SIZE.finditer(reference):
        # smaller: a centered box's width is a minimum, so only a smaller one fails it
        smaller = [str(v) for v in range(10, int(m.group(2)), 10)]
        if smaller:
            out.append((m.start(2), m.end(2), pick(m.group(2), [v for v in sizes if int(v) < int(m.group(2))], smaller)))
    texts = [m.group(2) for m in _TEXT.finditer(reference)]
    leaves = list(_TEXT.finditer(reference))
    for m in leaves:
        out.append((m.start(2), m.end(2), pick(m.group(2), texts, frontend.WORDS)))
    if len(leaves) > 1:   # a missing element, where the page keeps one
        for m in leaves:
            out.append((m.start(), m.end(), ""))
    return sorted(out)


def apply_slips(reference: str, chosen: list[tuple[int, int, str]]) -> str:
    page = reference
    for start, end, new in sorted(chosen, reverse=True):
        page = page[:start] + new + page[end:]
    return page


def slipped_pages(task: dict, rng: random.Random, k: int) -> list[str]:
    """k pages, each the reference with one slip fewer than the one before: k slips at
    places that do not overlap, then the first of them alone, ...; [] when the page has
    fewer than k such places."""
    ref = task["reference"]
    cands = slips(ref, rng)
    chosen: list[tuple[int, int, str]] = []
    for s in rng.sample(cands, len(cands)):
        if all(s[1] <= c[0] or c[1] <= s[0] for c in chosen):
            chosen.append(s)
        if len(chosen) == k:
            return [apply_slips(ref, chosen[:k - i]) for i in range(k)]
    return []


def imperfect_pages(task: dict, rng: random.Random) -> list[str]:
    """The imperfect pages before the reference in a perturbed episode (module doc): a
    corruption kind, one slip, or two slips then a failed fix, in equal shares."""
    shape = rng.choice(("kind", "slip", "two slips"))
    pages = [] if shape == "kind" else slipped_pages(task, rng, 2 if shape == "two slips" else 1)
    if pages:
        return pages
    bad = imperfect_page(task, rng)   # a corruption kind, also where the page has too few places to slip
    return [bad] if bad else []


def play_texts(task: dict, texts: list[str], harness_cfg=None, harnesses=None, *, factory=make_env,
               shot_dir: str | None = None) -> list[dict]:
    """The episode of these assistant turns through the real environment (`factory`: the
    render report's, or the screenshots', which keeps them in `shot_dir`): user message, then
    each turn and the observation it got (none after the turn that ended it)."""
    cfg = as_harness_config(harness_cfg, harnesses or HARNESSES)
    env = factory(cfg, max_turns=max(MAX_TURNS, len(texts)), timeout_s=ORACLE_TIMEOUT_S,
                  **({"shot_dir": shot_dir} if shot_dir else {}))
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
                    harnesses=None, **env) -> list[dict]:
    """The scripted episode (module doc) as chat messages after the system prompt; `env`:
    play_texts's factory and shot_dir (default: the render report)."""
    task = json.loads(task) if isinstance(task, str) else task
    ref = task["reference"]
    texts = [ref, DONE]
    if perturb:
        bad = imperfect_pages(task, rng or random.Random(0))
        if bad:
            msgs = play_texts(task, bad + [ref, DONE], harness_cfg, harnesses, **env)
            for k in range(len(bad)):   # the scripted mistakes: seen, never learnt (module doc)
                msgs[1 + 2 * k]["loss"] = False
            return msgs
    return play_texts(task, texts, harness_cfg, harnesses, **env)


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
    from experts.frontend_loop.screens import env_factory

    turns = getattr(getattr(cfg, "agent", None), "max_turns", MAX_TURNS)
    return env_factory(cfg)(harness_cfg, max_turns=turns)


class LoopExpert(AgentExpert):
    """The agent experts' stages; the SFT's scripted episodes have their pages rendered
    concurrently first (rewards.frontend_loop.prerendered), the same transcripts as one
    page at a time. `agent.env` chooses the environment of every stage (screens.py: with
    screenshots, the SFT's rows carry the images)."""
    takes_env = True

    def sft_transcripts(self, cfg, tokenizer, train_ds):
        from experts.frontend_loop.screens import sft_rows

        return sft_rows(self, cfg, tokenizer, train_ds, prerendered, ORACLE_TIMEOUT_S)


# experts/run.py's SFT and RL stages for this domain (the agent experts' loop)
TRAINER = LoopExpert(_episode_env, oracle_messages, DOMAIN)
