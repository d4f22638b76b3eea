"""Pieces every procedural data builder shares (experts/<domain>/data.py): the checks of
make_dataset's common arguments, the draw of n distinct tasks of one split, and a
dataset of rows that keeps its columns when there are none."""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import datasets

T = TypeVar("T")


def check_split_n_effort(domain: str, split: str, n, effort) -> None:
    """split is train or test, n an int >= 0, and no effort (a domain without efforts)."""
    if split not in ("train", "test"):
        raise ValueError(f"{domain}: unknown split {split!r}; expected 'train' or 'test'")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"{domain}: n must be an int >= 0, got {n!r}")
    if effort is not None:
        raise ValueError(f"{domain}: this domain has no efforts, got effort={effort!r}")


def draw_distinct(domain: str, split: str, n: int, draw: Callable[[int], T], split_of: Callable[[T], str],
                  key: Callable[[T], Hashable], *, attempts: int, repeats: bool = True) -> list[T]:
    """n tasks of `split`: for row i, `draw(i)` until a task of the split (`split_of(task)`)
    not drawn before (`key(task)`) comes, at most `attempts` draws. When none comes, a
    split with fewer distinct tasks than n repeats the last task of the split drawn
    (`repeats`), or it is an error (`repeats=False`; also when no task of the split came).
    The draws are the builder's own rng's, so the rows stay what they were for a seed."""
    out: list[T] = []
    seen: set = set()
    for i in range(n):
        fallback = None
        for _attempt in range(attempts):
            task = draw(i)
            if split_of(task) != split:
                continue
            fallback = task
            if key(task) not in seen:
                break
        else:
            if fallback is None or not repeats:
                raise RuntimeError(f"{domain}: could not draw a {'' if repeats else 'new '}{split} task for row {i} "
                                   f"in {attempts} draws")
        seen.add(key(fallback))
        out.append(fallback)
    return out


@dataclass(frozen=True)
class EpisodeTasks:
    """An episode domain's procedural tasks: `make_task(family, rng, difficulty)` draws one,
    whose id ends with a digest that `split_of` puts in train or test. `families`: the
    domain's; `difficulty_is`: what difficulty means there, for the error; `repeats`: a
    split with fewer distinct tasks than n repeats some (else it is an error)."""
    domain: str
    make_task: Callable
    split_of: Callable[[str], str]
    families: tuple
    max_difficulty: int
    difficulty_is: str
    repeats: bool

    def check(self, split: str, n, difficulty, effort, families) -> None:
        """make_dataset's arguments, before any work."""
        check_split_n_effort(self.domain, split, n, effort)
        if not isinstance(difficulty, int) or not 1 <= difficulty <= self.max_difficulty:
            raise ValueError(f"{self.domain}: difficulty is {self.difficulty_is}, an int in "
                             f"1..{self.max_difficulty}, got {difficulty!r}")
        unknown = [f for f in families if f not in self.families]
        if unknown or not families:
            raise ValueError(f"{self.domain}: unknown families {unknown or families!r}; "
                             f"expected some of {self.families}")

    def draw(self, split: str, n: int, seed: int, difficulty: int, families, stream: str) -> list[dict]:
        """n distinct tasks of `split`, the families in turn, from the rng of (domain,
        stream, split, seed, difficulty)."""
        families = tuple(families)
        self.check(split, n, difficulty, None, families)
        rng = random.Random(f"mopd/{self.domain}/{stream}/{split}/{seed}/{difficulty}")   # str seeds are stable
        return draw_distinct(self.domain, split, n,
                             lambda i: self.make_task(families[i % len(families)], rng, difficulty),
                             lambda t: self.split_of(t["id"].rsplit("-", 1)[1]), lambda t: t["id"],
                             attempts=500, repeats=self.repeats)


def prompt_dataset(domain: str, split: str, n: int, draw: Callable[[], T], split_of: Callable[[str], str],
                   row: Callable[[T], dict], features: datasets.Features) -> datasets.Dataset:
    """A single-turn domain's rows of n tasks of `split`, each drawn by `draw()` and told apart by its
    `prompt`; a split with fewer distinct prompts than n repeats some."""
    tasks = draw_distinct(domain, split, n, lambda _i: draw(), lambda t: split_of(t.prompt), lambda t: t.prompt,
                          attempts=200)
    return rows_dataset([row(t) for t in tasks], features)


EPISODE_COLUMNS = ("prompt", "completion", "domain", "task", "harness")


def episode_dataset(domain: str, tasks: list[dict], harness_cfgs: list, oracle_messages: Callable) -> datasets.Dataset:
    """An episode domain's rows, task i through harness_cfgs[i]: prompt (the first user
    message), completion (the oracle's episode after it), domain, task (JSON), harness (its
    name; the reward replays the completion with it)."""
    cols: dict[str, list] = {c: [] for c in EPISODE_COLUMNS}
    for task, cfg in zip(tasks, harness_cfgs, strict=True):
        msgs = oracle_messages(task, cfg)
        for c, v in zip(EPISODE_COLUMNS, (msgs[:1], msgs[1:], domain, json.dumps(task), cfg.name)):
            cols[c].append(v)
    return datasets.Dataset.from_dict(cols)


def rows_dataset(rows: list[dict], features: datasets.Features) -> datasets.Dataset:
    """The rows as a Dataset with `features`; with no rows, an empty one with the same columns."""
    if rows:
        return datasets.Dataset.from_list(rows, features=features)
    return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
