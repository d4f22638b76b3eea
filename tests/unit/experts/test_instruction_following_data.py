"""experts/instruction_following/data.py: deterministic disjoint splits, references that
meet every constraint, corruptions that break them, pretrain rows that do not solve the
task, and the eval entry point on a tiny random model."""
from __future__ import annotations

import collections
import json
import random

import pytest

from experts.instruction_following import data
from rewards.instruction_following import CHECKS, reward


def _scores(ds, completions=None):
    return reward(prompts=ds["prompt"], completions=completions if completions is not None else ds["completion"],
                  constraints=ds["constraints"], domain=ds["domain"])


def _prompts(ds) -> set[str]:
    return {p[-1]["content"] for p in ds["prompt"]}


@pytest.mark.parametrize("difficulty", [1, 3])
def test_splits_are_deterministic_and_disjoint(difficulty):
    train = data.make_dataset("train", 300, seed=0, difficulty=difficulty)
    test = data.make_dataset("test", 100, seed=0, difficulty=difficulty)
    assert train.to_list() == data.make_dataset("train", 300, seed=0, difficulty=difficulty).to_list()
    assert train.to_list() != data.make_dataset("train", 300, seed=1, difficulty=difficulty).to_list()
    assert not _prompts(train) & _prompts(test)
    assert not _prompts(test) & _prompts(data.make_dataset("train", 300, seed=1, difficulty=difficulty))
    assert len(_prompts(test)) == 100
    assert set(train.column_names) == {"prompt", "completion", "domain", "constraints"}
    assert set(train["domain"]) == {"instruction_following"}


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_references_meet_everything_and_corruptions_break_it(difficulty):
    ds = data.make_dataset("train", 300, seed=0, difficulty=difficulty)
    assert _scores(ds) == [1.0] * len(ds)
    rng = random.Random(0)
    rows = ds.to_list()
    corrupted = [data.corrupt(r, r["completion"], rng) for r in rows]
    bad = _scores(ds, corrupted)
    assert max(bad) < 1.0
    assert sum(bad) / len(bad) < 0.05
    n = difficulty + 1 if difficulty < 4 else 5
    assert {len(json.loads(c)) for c in ds["constraints"]} == {n}


def test_constraint_mix():
    d1 = collections.Counter(c["type"] for cs in data.make_dataset("train", 300, difficulty=1)["constraints"]
                             for c in json.loads(cs))
    d3 = collections.Counter(c["type"] for cs in data.make_dataset("train", 300, difficulty=3)["constraints"]
                             for c in json.loads(cs))
    assert set(d1) == set(data.BASIC)
    assert set(d3) == set(CHECKS)


def test_references_are_short():
    from tokenizers import Tokenizer

    from core.tiny import TOKENIZER_DIR

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ds = data.make_dataset("train", 300, difficulty=1)
    lengths = [len(tok.encode(c[0]["content"]).ids) for c in ds["completion"]]
    assert max(lengths) <= 45 and sum(lengths) / len(lengths) < 30
    assert max(len(tok.encode(p[0]["content"]).ids) for p in ds["prompt"]) <= 60


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        data.make_dataset("dev", 3)
    with pytest.raises(ValueError, match="difficulty"):
        data.make_dataset("train", 3, difficulty=0)
    with pytest.raises(ValueError, match="effort"):
        data.make_dataset("train", 3, effort="low")
    assert data.EFFORTS == () and data.DATASETS == {}


def test_pretrain_rows_have_the_format_but_do_not_solve_it():
    n = 300
    ds = data.pretrain_rows(n, seed=0)
    assert len(ds) == n and set(ds["domain"]) == {"pretrain"}
    assert set(ds.column_names) == {"prompt", "completion", "domain"}
    assert ds.to_list() == data.pretrain_rows(n, seed=0).to_list()
    # constrained prompts are answered with their corrupted reference
    problems = {p: c for p, _, c in data._problems("train", n // 2, 0, 1, stream="pretrain")
                + data._problems("train", n - n // 2, 0, 2, stream="pretrain")}
    constrained = [r for r in ds.to_list() if r["prompt"][0]["content"] in problems]
    assert n // 4 < len(constrained) < 3 * n // 4
    scores = reward(prompts=[r["prompt"] for r in constrained], completions=[r["completion"] for r in constrained],
                    constraints=[json.dumps(problems[r["prompt"][0]["content"]]) for r in constrained])
    assert max(scores) < 1.0 and sum(scores) / len(scores) < 0.05


def test_eval_runs_on_a_tiny_model(tiny_student_dir):
    from evals.instruction_following import evaluate

    out = evaluate(str(tiny_student_dir), n=4, max_new_tokens=6)
    assert out == {"domain": "instruction_following", "effort": None, "dataset": "procedural", "n": 4,
                   "score": out["score"]}
    assert 0.0 <= out["score"] <= 1.0
    with pytest.raises(ValueError, match="effort"):
        evaluate(str(tiny_student_dir), effort="high")
