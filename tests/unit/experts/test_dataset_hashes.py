"""The procedural datasets are pinned to the byte: a hash of the rows (as sorted-key JSON)
of a few (domain, split, n, difficulty) cases, taken before the shared dataset helpers
(experts/base.py) replaced each domain's own argument checks and draw of unseen tasks.
A change that moves a row, a draw or a column fails here; one that means to change the
data updates the hashes and says why. The n=400 cases draw more tasks than the split
has at that difficulty, so they cover the repeat fallback too."""
from __future__ import annotations

import hashlib
import json

import pytest

from experts.registry import data_module

CASES = [   # (domain, split, n, difficulty, sha256 of the rows, first 32 hex digits); seed 1
    ("agent", "train", 24, 2, "3afd99237aa61b4007513ba001902ebb"),
    ("agent", "test", 24, 4, "04d8bcd43e475a38b46ef7148dd37a20"),
    ("agent", "test", 400, 1, "65e55f6270479d46ec544299cebac7bc"),
    ("search_agent", "train", 24, 1, "daab228d1c567505e1cf393ec6b40676"),
    ("search_agent", "test", 24, 3, "74fc8364ac805e7a1c48b5a1f97f86f8"),
    ("code", "train", 24, 1, "12f5ee498c1f516eb6acb8df757245c9"),
    ("code", "test", 24, 3, "2fe2fe947f28c8b3d4afee73d5f60921"),
    ("kernel", "train", 24, 2, "34f6a060b5eb8f4cc2291a557dacc48e"),   # issue 45: spec.sol added
    ("kernel", "test", 400, 1, "b267ecd0e063e6a676a28cfe594a9ecc"),
]


def rows_hash(ds) -> str:
    m = hashlib.sha256()
    for row in ds:
        m.update(json.dumps(row, sort_keys=True).encode() + b"\n")
    return m.hexdigest()[:32]


@pytest.mark.parametrize("domain,split,n,difficulty,expected", CASES)
def test_dataset_rows_are_pinned(domain, split, n, difficulty, expected):
    ds = data_module(domain).make_dataset(split, n, seed=1, difficulty=difficulty)
    assert len(ds) == n
    assert rows_hash(ds) == expected, f"{domain} {split} n={n} difficulty={difficulty}: the rows changed"


@pytest.mark.parametrize("domain", ["agent", "search_agent", "code", "kernel", "instruction_following", "tool_use"])
def test_bad_arguments_name_the_domain_and_the_argument(domain):
    make = data_module(domain).make_dataset
    with pytest.raises(ValueError, match=f"{domain}: unknown split 'dev'"):
        make("dev", 1)
    with pytest.raises(ValueError, match=f"{domain}: n must be an int >= 0, got -1"):
        make("train", -1)
    with pytest.raises(ValueError, match=f"{domain}: this domain has no efforts, got effort='low'"):
        make("train", 1, effort="low")


def test_a_split_without_enough_new_tasks_repeats_or_fails():
    from experts.procedural import draw_distinct

    draws = iter(range(1000))
    tasks = draw_distinct("toy", "test", 5, lambda i: next(draws) % 4, lambda t: "test" if t < 2 else "train",
                          lambda t: t, attempts=20)
    assert tasks[:2] == [0, 1] and set(tasks) == {0, 1}   # two tasks in the split: the rest repeat
    with pytest.raises(RuntimeError, match="toy: could not draw a new test task for row 2 in 20 draws"):
        draw_distinct("toy", "test", 5, lambda i: i % 2, lambda t: "test", lambda t: t, attempts=20, repeats=False)
