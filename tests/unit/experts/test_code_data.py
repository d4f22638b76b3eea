"""experts/code/data.py and evals/code.py: splits, difficulty, references, tests that
catch near misses, corrupt, pretrain rows, HumanEval loading."""
from __future__ import annotations

import random
import re

import pytest

from experts.code import data
from experts.code.data import (DATASETS, DOMAIN, EFFORTS, TEMPLATES, corrupt, load_humaneval, make_dataset,
                               make_test, pretrain_rows, task_of_prompt)
from rewards.code import prompt_code_of, reward


def _user(row):
    return row["prompt"][-1]["content"]


def _ref(row):
    return row["completion"][0]["content"]


def _scores(ds, completions):
    cols = {c: list(ds[c]) for c in ("test", "entry_point", "prompt_code", "domain")}
    return reward(list(ds["prompt"]), completions, timeout_s=5.0, **cols)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_splits_disjoint_and_deterministic(difficulty):
    train = make_dataset("train", 600, seed=0, difficulty=difficulty)
    test = make_dataset("test", 200, seed=0, difficulty=difficulty)
    assert not {_user(r) for r in train} & {_user(r) for r in test}
    assert all(data._split_of(_user(r)) == "test" for r in test)
    assert make_dataset("test", 200, seed=0, difficulty=difficulty).to_list() == test.to_list()
    assert make_dataset("test", 200, seed=1, difficulty=difficulty).to_list() != test.to_list()
    assert len({_user(r) for r in test}) > 190   # enough distinct held-out tasks


def test_columns_and_contract():
    assert DOMAIN == "code" and EFFORTS == () and "humaneval" in DATASETS
    ds = make_dataset("test", 20)
    assert set(ds.column_names) == {"prompt", "completion", "domain", "test", "entry_point", "prompt_code"}
    for r in ds:
        assert r["domain"] == "code" and r["prompt_code"] == ""
        assert [m["role"] for m in r["prompt"]] == ["user"] and r["completion"][0]["role"] == "assistant"
        assert r["test"].startswith("def check(candidate):\n") and r["test"].count("assert candidate(") >= 4
        assert _ref(r).startswith(f"```python\ndef {r['entry_point']}(") and _ref(r).endswith("\n```")
        assert f" {r['entry_point']}(" in _user(r)
    assert len(make_dataset("train", 0)) == 0
    with pytest.raises(ValueError, match="split"):
        make_dataset("dev", 3)
    with pytest.raises(ValueError, match="effort"):
        make_dataset("train", 3, effort="high")
    with pytest.raises(ValueError, match="difficulty"):
        make_dataset("train", 3, difficulty=0)


def test_difficulty_knob():
    def keys(ds):
        return {task_of_prompt(_user(r)).template.key for r in ds}

    def consts(ds):
        return [int(x) for r in ds for x in re.findall(r"\d+", _user(r))]

    one, two, three = (make_dataset("train", 400, difficulty=d) for d in (1, 2, 3))
    level = {t.key: t.level for t in TEMPLATES}
    assert {level[k] for k in keys(one)} == {1} and len(keys(one)) == 13
    assert 2 in {level[k] for k in keys(two)} and 3 not in {level[k] for k in keys(two)}
    assert 3 in {level[k] for k in keys(three)}
    assert max(consts(one)) <= 9 < max(consts(two))
    assert any(_ref(r).count("\n") > 3 for r in three)   # loops over several lines


def test_short_completions():
    from tokenizers import Tokenizer

    from core.tiny import TOKENIZER_DIR

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))  # the project tokenizer, fast to load
    for d in (1, 2, 3):
        for r in make_dataset("train", 300, difficulty=d):
            assert len(tok.encode(_ref(r), add_special_tokens=False).ids) < 40, _ref(r)


def test_task_of_prompt_roundtrip_and_tests_match_templates():
    for r in make_dataset("train", 300, difficulty=3):
        task = task_of_prompt(_user(r))
        assert task is not None and task.prompt == _user(r) and task.reference == _ref(r)
        assert make_test(task) == r["test"]
    assert task_of_prompt("Write a Python function f(x) that returns x.") is None


@pytest.mark.parametrize("difficulty", [1, 3])
def test_references_pass_and_corruptions_fail(difficulty):
    """Through the real reward (sandboxed), on a sample covering every template."""
    ds = make_dataset("test", 200, seed=0, difficulty=difficulty)
    first = {}
    for i, r in enumerate(ds):
        first.setdefault(task_of_prompt(_user(r)).template.key, i)
    ds = ds.select(sorted(first.values()))
    refs = [_ref(r) for r in ds]
    assert _scores(ds, refs) == [1.0] * len(ds)
    rng = random.Random(0)
    bad = [corrupt(r, ref, rng) for r, ref in zip(ds.to_list(), refs)]
    assert all(b != ref and b.startswith("```python\n") for b, ref in zip(bad, refs))
    assert _scores(ds, bad) == [0.0] * len(ds)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_corruptions_are_near_misses(difficulty):
    """Every corruption keeps the signature and changes the body (whether the tests
    catch it is checked through the reward above, and for 200 rows in the report)."""
    rng = random.Random(1)
    for r in make_dataset("test", 200, difficulty=difficulty).to_list():
        bad = corrupt(r, _ref(r), rng)
        assert bad != _ref(r)
        assert bad.splitlines()[:2] == _ref(r).splitlines()[:2] and bad.endswith("\n```")


def test_pretrain_rows_do_not_solve():
    rows = pretrain_rows(300, seed=0)
    assert set(rows.column_names) == {"prompt", "completion", "domain"}
    assert set(rows["domain"]) == {"pretrain"}
    assert pretrain_rows(50, seed=3).to_list() == pretrain_rows(50, seed=3).to_list()
    test_prompts = {_user(r) for r in make_dataset("test", 200)}
    tasks, comps = [], []
    for r in rows:
        task = task_of_prompt(_user(r))
        assert _user(r) not in test_prompts
        if task is not None:
            assert data._split_of(task.prompt) == "train"
            tasks.append(task)
            comps.append(_ref(r))
            assert f"def {task.name}(" in _ref(r)   # right name, wrong body
    assert len(tasks) > 100
    sample = list(range(0, len(tasks), max(1, len(tasks) // 25)))
    cols = {"test": [make_test(tasks[i]) for i in sample], "entry_point": [tasks[i].name for i in sample],
            "domain": ["code"] * len(sample)}
    assert reward([None] * len(sample), [comps[i] for i in sample], **cols) == [0.0] * len(sample)


def test_humaneval_rows():
    ds = load_humaneval()
    assert len(ds) == 164 and ds[0]["task_id"] == "HumanEval/0"
    for r in ds.select(range(0, 164, 20)):
        assert r["domain"] == "code" and r["entry_point"] in r["prompt_code"]
        assert prompt_code_of(r["prompt"]) == r["prompt_code"]
        assert r["completion"][0]["content"].startswith((" ", "\t"))   # a continuation


def test_humaneval_corruptions_change_every_solution():
    rng = random.Random(0)
    for r in load_humaneval().to_list():
        ref = r["completion"][0]["content"]
        bad = corrupt(r, ref, rng)
        assert bad != ref and ("return None" in bad or "return not (" in bad)


def test_eval_runs_through_mopd_evaluate(tiny_student_dir):
    from evals.code import evaluate

    out = evaluate(str(tiny_student_dir), n=4, max_new_tokens=8, batch_size=4)
    assert out == {"domain": "code", "effort": None, "dataset": "procedural", "n": 4, "score": 0.0}
    with pytest.raises(ValueError, match="dataset"):
        evaluate(str(tiny_student_dir), dataset="mbpp")
    with pytest.raises(ValueError, match="effort"):
        evaluate(str(tiny_student_dir), effort="high")
