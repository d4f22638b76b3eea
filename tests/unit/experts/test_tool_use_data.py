"""experts/tool_use/data.py: deterministic disjoint splits, references that score 1,
corruptions that score 0, pretrain rows that do not solve the task, BFCL loading, and
the eval entry point on a tiny random model."""
from __future__ import annotations

import collections
import json
import random

import pytest

from experts.tool_use import data
from rewards.tool_use import reward


def _scores(ds, completions=None):
    cols = {c: ds[c] for c in ds.column_names if c not in ("prompt", "completion")}
    return reward(prompts=ds["prompt"], completions=completions if completions is not None else ds["completion"], **cols)


def _requests(ds) -> set[str]:
    return {p[-1]["content"] for p in ds["prompt"]}


@pytest.mark.parametrize("difficulty", [1, 3])
def test_splits_are_deterministic_and_disjoint(difficulty):
    train = data.make_dataset("train", 300, seed=0, difficulty=difficulty)
    test = data.make_dataset("test", 100, seed=0, difficulty=difficulty)
    assert train.to_list() == data.make_dataset("train", 300, seed=0, difficulty=difficulty).to_list()
    assert not _requests(train) & _requests(test)
    assert not _requests(test) & _requests(data.make_dataset("train", 300, seed=1, difficulty=difficulty))
    assert train.to_list() != data.make_dataset("train", 300, seed=1, difficulty=difficulty).to_list()
    assert len(_requests(test)) == 100  # no repeats at this size
    assert set(train.column_names) == {"prompt", "completion", "domain", "functions", "ground_truth", "test_category"}
    assert set(train["domain"]) == {"tool_use"}


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_references_score_one_and_corruptions_zero(difficulty):
    ds = data.make_dataset("train", 200, seed=0, difficulty=difficulty)
    assert _scores(ds) == [1.0] * len(ds)
    rng = random.Random(0)
    rows = ds.to_list()
    corrupted = [data.corrupt(r, r["completion"], rng) for r in rows]
    assert _scores(ds, corrupted) == [0.0] * len(ds)
    assert sum(c.startswith("{") or c.startswith("[") for c in corrupted) == len(ds)  # still call-shaped
    assert data.corrupt(rows[0], rows[0]["completion"][0]["content"], random.Random(0)) == \
        data.corrupt(rows[0], rows[0]["completion"], random.Random(0))  # a string reference works too


def test_difficulty_knob():
    def offered(ds):
        return collections.Counter(len(json.loads(f)) for f in ds["functions"])

    d1, d3 = data.make_dataset("train", 200, difficulty=1), data.make_dataset("train", 200, difficulty=3)
    assert set(offered(d1)) == {2} and set(offered(d3)) == {4}
    assert set(d1["test_category"]) == {"multiple"}
    assert {"parallel", "parallel_multiple"} & set(d3["test_category"])
    # difficulty 1 never asks for an optional argument; difficulty 3 sometimes must pass one
    assert all("" in v for g in d1["ground_truth"] for a in json.loads(g) for args in a.values()
               for p, v in args.items() if p in ("unit", "label", "date", "passengers", "volume", "time"))
    assert any(len(json.loads(c[0]["content"]).get("arguments", {})) > 2 for c in d3["completion"]
               if c[0]["content"].startswith("{"))


def _n_tokens(text: str) -> int:
    """Tokens of the project's tiny tokenizer (the `tokenizers` file: no transformers import)."""
    from tokenizers import Tokenizer

    from core.tiny import TOKENIZER_DIR

    global _TOK
    if "_TOK" not in globals():
        _TOK = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return len(_TOK.encode(text, add_special_tokens=False).ids)


def _chat(messages) -> str:  # core/tiny.py's ChatML template, generation prompt included
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def test_difficulty_one_is_short_for_the_tiny_tokenizer():
    ds = data.make_dataset("train", 200, difficulty=1)
    assert max(_n_tokens(_chat(p)) for p in ds["prompt"]) <= 160
    assert max(_n_tokens(c[0]["content"]) for c in ds["completion"]) <= 45


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        data.make_dataset("dev", 3)
    with pytest.raises(ValueError, match="difficulty"):
        data.make_dataset("train", 3, difficulty=0)
    with pytest.raises(ValueError, match="effort"):
        data.make_dataset("train", 3, effort="high")
    assert data.EFFORTS == ()


def test_pretrain_rows_have_the_format_but_never_the_answer():
    n = 300
    ds = data.pretrain_rows(n, seed=0)
    assert len(ds) == n and set(ds["domain"]) == {"pretrain"}
    assert set(ds.column_names) == {"prompt", "completion", "domain"}
    assert ds.to_list() == data.pretrain_rows(n, seed=0).to_list()
    # the same problems pretrain_rows drew: none of its tool-prompt answers is right
    problems = {p["request"]: p for p in data._problems("train", n, 0, 1, stream="pretrain")}
    kinds = collections.Counter()
    for row in ds.to_list():
        text = row["completion"][0]["content"]
        if row["prompt"][-1]["content"].startswith("Echo this JSON: "):
            kinds["echo"] += 1
            assert row["prompt"][-1]["content"].endswith(text)
            continue
        p = problems[row["prompt"][-1]["content"]]
        got = reward(prompts=["x"], completions=[text], functions=[data._row(p)["functions"]],
                     ground_truth=[json.dumps(p["answers"])])[0]
        assert got == 0.0
        kinds["right tool" if json.loads(text)["name"] == p["calls"][0][0] else "other tool"] += 1
    assert min(kinds.values()) > n // 10, kinds


def test_bfcl_references_pass_and_corruptions_fail():
    pytest.importorskip("bfcl_eval.constants.enums")
    ds = data.DATASETS["bfcl"]()
    counts = collections.Counter(ds["test_category"])
    assert counts == {"simple_python": 400, "simple_java": 100, "simple_javascript": 50, "multiple": 200,
                      "parallel": 200, "parallel_multiple": 200, "live_simple": 258, "live_multiple": 1053,
                      "live_parallel": 16, "live_parallel_multiple": 24}
    scores = _scores(ds)
    by_cat = collections.defaultdict(list)
    for s, c in zip(scores, ds["test_category"]):
        by_cat[c].append(s)
    assert sum(scores) / len(scores) >= 0.99
    for cat in ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple"):
        assert min(by_cat[cat]) == 1.0, cat
    # the only misses: BFCL answers that no call can satisfy (see load_bfcl's docstring)
    assert {i for i, s in zip(ds["id"], scores) if s < 1} <= set(data.BFCL_UNSATISFIABLE)
    rng = random.Random(0)
    rows = ds.to_list()
    corrupted = [data.corrupt(r, r["completion"], rng) for r in rows]
    assert sum(_scores(ds, corrupted)) == 0.0
    assert ds[0]["prompt"][0]["role"] == "system" and "Functions:" in ds[0]["prompt"][0]["content"]


def test_eval_runs_on_a_tiny_model(tiny_student_dir):
    from evals.tool_use import evaluate

    out = evaluate(str(tiny_student_dir), n=4, max_new_tokens=6)
    assert out == {"domain": "tool_use", "effort": None, "dataset": "procedural", "n": 4, "score": out["score"]}
    assert 0.0 <= out["score"] <= 1.0
    with pytest.raises(ValueError, match="dataset"):
        evaluate(str(tiny_student_dir), dataset="nope")
