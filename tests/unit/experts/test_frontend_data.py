"""experts/frontend/data.py: deterministic disjoint splits, specs that name every value the
page must hold, short regular reference pages (project tokenizer), the difficulty knob,
corruptions, pretrain rows that do not solve the task, bad input named. (Rendering the
references in the browser: tests/unit/rewards/test_reward_frontend.py.)"""
from __future__ import annotations

import collections
import json
import random
import re

import pytest

from experts.frontend import data
from core.tiny import load_tokenizer


def _prompts(ds) -> set[str]:
    return {p[-1]["content"] for p in ds["prompt"]}


@pytest.mark.parametrize("difficulty", [1, 3])
def test_splits_are_deterministic_and_disjoint(difficulty):
    train = data.make_dataset("train", 400, seed=0, difficulty=difficulty)
    test = data.make_dataset("test", 100, seed=0, difficulty=difficulty)
    assert train.to_list() == data.make_dataset("train", 400, seed=0, difficulty=difficulty).to_list()
    assert train.to_list() != data.make_dataset("train", 400, seed=1, difficulty=difficulty).to_list()
    assert not _prompts(train) & _prompts(test)
    assert not _prompts(test) & _prompts(data.make_dataset("train", 400, seed=1, difficulty=difficulty))
    assert len(_prompts(test)) == 100
    assert set(train.column_names) == {"prompt", "completion", "domain", "family", "checks"}
    assert set(train["domain"]) == {"frontend"}
    assert set(train["family"]) == set(data.FAMILIES)


def test_the_spec_names_every_value_of_the_page():
    """The page follows from the spec: every id, text, color and size in the reference
    (and in its checks) appears in the prompt."""
    for d in (1, 2, 3):
        for row in data.make_dataset("test", 60, seed=0, difficulty=d):
            prompt, page = row["prompt"][-1]["content"], row["completion"][-1]["content"]
            for ident in re.findall(r'id="(\w+)"', page):
                assert f"#{ident}" in prompt, (prompt, page)
            for text in re.findall(r">([^<]+)<", page):
                assert f'"{text}"' in prompt, (prompt, page)
            for prop, value in re.findall(r"(background|color):(\w+)", page):
                assert f"{'background' if prop == 'background' else 'text'} {value}" in prompt, (prompt, page)
            for px in re.findall(r"(?:width|height):(\d+)px", page):
                assert f"{px}px" in prompt, (prompt, page)
            for c in json.loads(row["checks"]):
                assert c["type"] in ("text", "exists", "style", "width", "height", "centered", "row", "above",
                                     "inside")


def test_pages_are_short_and_regular():
    tok = load_tokenizer()
    budget = {1: 128, 2: 192, 3: 256}   # evals/frontend.py's max_new_tokens
    for d, limit in budget.items():
        pages = [c[-1]["content"] for c in data.make_dataset("train", 200, seed=0, difficulty=d)["completion"]]
        lengths = [len(tok(p)["input_ids"]) for p in pages]
        assert max(lengths) + 1 <= limit, (d, max(lengths))
        for p in pages:   # one template: style properties in the fixed order
            for style in re.findall(r'style="([^"]*)"', p):
                props = [kv.split(":")[0] for kv in style.split(";")]
                order = ["display", "margin", "width", "height", "background", "color"]
                assert props == sorted(props, key=order.index), p


def test_difficulty_adds_components_and_properties():
    def components(d):
        rows = [r for r in data.make_dataset("train", 300, seed=0, difficulty=d) if r["family"] == "row"]
        return collections.Counter(r["completion"][-1]["content"].count(" id=") for r in rows)
    assert set(components(1)) == {3} and set(components(2)) == {4} and set(components(3)) == {5}
    d1 = data.make_dataset("train", 100, seed=0, difficulty=1)
    d2 = data.make_dataset("train", 100, seed=0, difficulty=2)
    mean = lambda ds: sum(len(json.loads(c)) for c in ds["checks"]) / len(ds)   # noqa: E731
    assert mean(d2) > mean(d1) + 1


def test_corruptions_change_the_page():
    rows = data.make_dataset("test", 50, seed=0).to_list()
    rng = random.Random(0)
    for r in rows:
        ref = r["completion"][-1]["content"]
        assert data.corrupt(r, r["completion"], rng) != ref
        for kind in data.CORRUPTIONS:
            assert data.corrupt_kind(ref, kind, rng) != ref, (kind, ref)
    with pytest.raises(ValueError, match="unknown corruption"):
        data.corrupt_kind("<p>x</p>", "nope", rng)


def test_pretrain_rows_do_not_solve_the_task():
    pre = data.pretrain_rows(60, seed=0)
    assert set(pre["domain"]) == {"pretrain"} and len(pre) == 60
    refs = {c[-1]["content"] for c in data.make_dataset("train", 2000, seed=0)["completion"]}
    assert not {c[-1]["content"] for c in pre["completion"]} & refs
    assert any("style=" in c[-1]["content"] for c in pre["completion"])   # near-misses of the right shape


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown split"):
        data.make_dataset("dev", 3)
    with pytest.raises(ValueError, match="n must be"):
        data.make_dataset("test", -1)
    with pytest.raises(ValueError, match="difficulty"):
        data.make_dataset("test", 3, difficulty=0)
    with pytest.raises(ValueError, match="no reasoning efforts"):
        data.make_dataset("test", 3, effort="low")
    with pytest.raises(ValueError, match="n must be"):
        data.pretrain_rows(-2)
