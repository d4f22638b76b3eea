"""experts/math/data.py and evals/math.py: splits, efforts, references, corrupt, pretrain rows."""
from __future__ import annotations

import random

import pytest

from experts.math import data
from experts.math.data import EFFORTS, SYSTEM_PROMPTS, corrupt, make_dataset, pretrain_rows
from rewards.math import reward


def _user(row):
    return row["prompt"][-1]["content"]


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_splits_disjoint_and_deterministic(difficulty):
    train = make_dataset("train", 400, seed=0, difficulty=difficulty, effort="low")
    test_low = make_dataset("test", 200, seed=0, difficulty=difficulty, effort="low")
    test_high = make_dataset("test", 200, seed=1, difficulty=difficulty, effort="high")
    train_q = {_user(r) for r in train}
    assert not train_q & {_user(r) for r in test_low}
    assert not train_q & {_user(r) for r in test_high}  # the same problem never crosses efforts
    assert make_dataset("test", 200, seed=0, difficulty=difficulty, effort="low").to_list() == test_low.to_list()
    assert make_dataset("test", 200, seed=1, difficulty=difficulty, effort="low").to_list() != test_low.to_list()
    assert len({_user(r) for r in test_low}) > 190  # enough distinct held-out problems


def test_columns_and_efforts():
    low, high = make_dataset("test", 20, effort="low"), make_dataset("test", 20, effort="high")
    assert set(low.column_names) == {"prompt", "completion", "domain", "effort", "answer"}
    assert SYSTEM_PROMPTS["low"] != SYSTEM_PROMPTS["high"]
    for ds, eff in ((low, "low"), (high, "high")):
        for r in ds:
            assert r["domain"] == "math" and r["effort"] == eff
            assert r["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPTS[eff]}
            assert r["prompt"][1]["role"] == "user"
            assert r["completion"][0]["role"] == "assistant"
    assert all(r["completion"][0]["content"] == f"Answer: {r['answer']}" for r in low)
    assert all("=" in r["completion"][0]["content"] for r in high)  # worked steps
    mixed = make_dataset("train", 100, effort=None)
    assert set(mixed["effort"]) == set(EFFORTS)
    assert all(r["prompt"][0]["content"] == SYSTEM_PROMPTS[r["effort"]] for r in mixed)


def test_difficulty_knob():
    one = make_dataset("train", 300, difficulty=1, effort="high")
    two = make_dataset("train", 300, difficulty=2, effort="high")
    four = make_dataset("train", 300, difficulty=4, effort="high")
    assert all(r["completion"][0]["content"].count("=") == 1 for r in one)  # one step
    assert any(r["completion"][0]["content"].count("=") == 2 for r in two)  # some two-step
    import re
    operands = lambda ds: [int(x) for r in ds for x in re.findall(r"\d+", _user(r))]
    assert max(operands(one)) <= 9 < max(operands(four))


def test_short_completions():
    from core.tiny import load_tokenizer

    tiny_tokenizer = load_tokenizer()
    for eff in EFFORTS:
        for r in make_dataset("train", 200, difficulty=2, effort=eff):
            ids = tiny_tokenizer(r["completion"][0]["content"], add_special_tokens=False)["input_ids"]
            assert len(ids) < 30


@pytest.mark.parametrize("effort", EFFORTS)
def test_reference_scores_one_and_corrupt_scores_zero(effort):
    ds = make_dataset("test", 200, difficulty=2, effort=effort)
    refs = [r["completion"][0]["content"] for r in ds]
    cols = {"answer": ds["answer"], "domain": ds["domain"], "effort": ds["effort"]}
    assert reward(ds["prompt"], ds["completion"], **cols) == [1.0] * len(ds)
    rng = random.Random(0)
    bad = [corrupt(r, ref, rng) for r, ref in zip(ds.to_list(), refs)]
    assert reward(ds["prompt"], bad, **cols) == [0.0] * len(ds)
    assert all(b != ref for b, ref in zip(bad, refs))
    if effort == "high":  # corrupted steps stay well-formed: same number of steps
        assert all(b.count("=") == ref.count("=") for b, ref in zip(bad, refs))


def test_pretrain_rows_do_not_solve():
    rows = pretrain_rows(400, seed=0)
    assert set(rows["domain"]) == {"pretrain"}
    assert rows.to_list() == pretrain_rows(400, seed=0).to_list()
    texts = [r["completion"][0]["content"] for r in rows]
    assert all(t.startswith("Answer:") or "=" in t for t in texts)
    # every worked step in a pretrain row is arithmetically wrong, and no word problem
    # is answered right
    import re
    for r, t in zip(rows, texts):
        for x, op, y, z in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", t):
            assert data._OPS[op](int(x), int(y)) != int(z), t
    problems = [(_user(r), t) for r, t in zip(rows, texts) if "How many" in _user(r)]
    assert len(problems) > 100
    for problem, t in problems:
        assert data.solve(problem) is not None, problem
        assert int(t.split("Answer: ")[-1]) != data.solve(problem), (problem, t)


@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_answers_match_the_wording(difficulty):
    for r in make_dataset("train", 300, difficulty=difficulty):
        assert data.solve(_user(r)) == int(r["answer"]) >= 0, r


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        make_dataset("val", 3)
    with pytest.raises(ValueError, match="effort"):
        make_dataset("train", 3, effort="medium")
    with pytest.raises(ValueError, match="difficulty"):
        make_dataset("train", 3, difficulty=0)


def test_eval_requires_effort():
    from evals.math import evaluate

    with pytest.raises(ValueError, match="effort"):
        evaluate("unused", effort=None)
    with pytest.raises(ValueError, match="effort"):
        evaluate("unused", effort="medium")
    with pytest.raises(ValueError, match="dataset"):
        evaluate("unused", effort="low", dataset="gsm8k")


def test_eval_runs_on_tiny_model(student_hf, tiny_tokenizer):
    from evals.math import evaluate

    out = evaluate(student_hf, n=8, effort="high", max_new_tokens=4, batch_size=8)
    assert out["domain"] == "math" and out["effort"] == "high" and out["n"] == 8
    assert out["dataset"] == "procedural" and 0.0 <= out["score"] <= 1.0
