"""Pieces every procedural data builder shares (experts/<domain>/data.py): the checks of
make_dataset's common arguments, the draw of n distinct tasks of one split, and a
dataset of rows that keeps its columns when there are none."""
from __future__ import annotations

from collections.abc import Callable, Hashable
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


def rows_dataset(rows: list[dict], features: datasets.Features) -> datasets.Dataset:
    """The rows as a Dataset with `features`; with no rows, an empty one with the same columns."""
    if rows:
        return datasets.Dataset.from_list(rows, features=features)
    return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
