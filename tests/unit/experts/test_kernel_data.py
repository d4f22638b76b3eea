"""experts/kernel/data.py and evals/kernel.py: splits, difficulty, the families' references
and expert kernels (right, and far apart in speed), corrupt, pretrain rows, the check's
extras."""
from __future__ import annotations

import json
import random

import pytest

from experts.kernel import data
from experts.kernel.data import (CHECK_EXTRAS, CHEAT_KINDS, DOMAIN, EFFORTS, FAMILIES, corrupt, make_dataset,
                                 pretrain_rows, task_of_row)
from rewards.kernel import FLOOR, NOISE_BAND, score_kernels

COLS = ("reference", "expert", "spec", "domain")


def _user(row):
    return row["prompt"][-1]["content"]


def _ref(row):
    return row["completion"][0]["content"]


def _score(rows, completions, **kw):
    return score_kernels(None, completions, **{c: [r[c] for r in rows] for c in COLS}, **kw)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_splits_disjoint_and_deterministic(difficulty):
    train = make_dataset("train", 600, seed=0, difficulty=difficulty)
    test = make_dataset("test", 100, seed=0, difficulty=difficulty)
    assert not {_user(r) for r in train} & {_user(r) for r in test}
    assert all(data._split_of(_user(r)) == "test" for r in test)
    assert make_dataset("test", 100, seed=0, difficulty=difficulty).to_list() == test.to_list()
    assert make_dataset("test", 100, seed=1, difficulty=difficulty).to_list() != test.to_list()
    assert len({_user(r) for r in test}) > 80   # enough distinct held-out tasks


def test_columns_and_contract():
    assert DOMAIN == "kernel" and EFFORTS == () and data.DATASETS == {}
    ds = make_dataset("test", 20)
    assert set(ds.column_names) == {"prompt", "completion", "domain", "reference", "expert", "spec", "task"}
    for r in ds:
        task = task_of_row(r)
        assert r["domain"] == "kernel" and [m["role"] for m in r["prompt"]] == ["user"]
        assert _ref(r) == f"```python\n{r['expert']}```" and r["expert"].startswith(f"def kernel({task.signature}):")
        assert r["reference"].startswith(f"def reference({task.signature}):") and r["reference"] in _user(r)
        assert f"Write kernel({task.signature})" in _user(r)
        spec = json.loads(r["spec"])
        assert spec["time"] in spec["shapes"] and spec["dtypes"] == ["float32", "float64"]
    assert len(make_dataset("train", 0)) == 0
    with pytest.raises(ValueError, match="split"):
        make_dataset("dev", 3)
    with pytest.raises(ValueError, match="effort"):
        make_dataset("train", 3, effort="high")
    with pytest.raises(ValueError, match="difficulty"):
        make_dataset("train", 3, difficulty=0)


def test_difficulty_knob():
    def fams(ds):
        return {task_of_row(r).family for r in ds}

    level = {f.key: f.level for f in FAMILIES}
    one, two, three = (make_dataset("train", 400, difficulty=d) for d in (1, 2, 3))
    assert {level[k] for k in fams(one)} == {1} and len(fams(one)) == 10
    assert 2 in {level[k] for k in fams(two)} and 3 not in {level[k] for k in fams(two)}
    assert 3 in {level[k] for k in fams(three)}
    rows = lambda ds: max(json.loads(r["spec"])["time"].get("R", 0) for r in ds)  # noqa: E731
    assert rows(one) <= 64 < rows(three)


def test_prompt_names_the_op_and_its_parameter():
    """The kernel follows from the prompt: the parameter in the op line is the one in the code."""
    for r in make_dataset("train", 200, difficulty=3):
        task = task_of_row(r)
        first = _user(r).splitlines()[0]
        for _name, value in task.params:
            assert value in first and value in r["expert"], (first, r["expert"])


def test_short_completions():
    from tokenizers import Tokenizer

    from core.tiny import TOKENIZER_DIR

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ds = make_dataset("train", 150, difficulty=3)
    assert max(len(tok.encode(_ref(r)).ids) for r in ds) <= 96          # evals/kernel.py's budget
    assert max(len(tok.encode(_user(r)).ids) + 96 for r in ds) <= 512    # experts/run.py's max_length


def _one_per_family():
    rng = random.Random(3)
    return [data._row(data.draw_task(rng, 3, families=(f,))) for f in FAMILIES]


def test_every_family_expert_scores_above_the_floor_below_its_speed_of_light():
    rows = _one_per_family()
    res = _score(rows, [_ref(r) for r in rows], trials=9)
    for r, x in zip(rows, res):
        # not the ceiling any more: 1.0 is the task's speed of light, which no one-line torch
        # call reaches on CPU (docs/results/2026-12-05-kernel-speed-of-light.md)
        assert x["reason"] == "ok" and FLOOR < x["score"] < 1.0, (task_of_row(r).family, x)
        assert 0 < x["frac_sol_expert"] < 1 / (1 + NOISE_BAND), (task_of_row(r).family, x)
        # the reference really is slower, by more than the noise band at both ends (unloaded
        # the experts are 5-100x faster; on a machine with 8x more runnable tasks than cores
        # the gap shrinks to ~3x for the cheapest ops)
        assert x["r_expert"] > (1 + NOISE_BAND) ** 2, (task_of_row(r).family, x)


@pytest.mark.ci   # second tier: times every kernel family's reference (~16 s); the fast tier stays under 10 minutes
def test_every_family_reference_is_the_floor_and_corrupt_scores_zero():
    rows = _one_per_family()
    rng = random.Random(0)
    bad = [corrupt(r, _ref(r), rng) for r in rows]
    assert all(b != _ref(r) for b, r in zip(bad, rows))
    # the reward's own trial count: a median of 5 trials was seen to put the reference at
    # r = 0.62, outside the noise band (segment_sum, fresh-clone CI rehearsal 2026-12-03)
    for r, x in zip(rows, _score(rows, [data.reference_completion(r) for r in rows])):
        assert x["score"] == pytest.approx(FLOOR), (task_of_row(r).family, x)
    for r, x in zip(rows, _score(rows, bad, trials=5)):
        # a changed number of segments also gives a wrong shape, or an index out of range
        assert x["score"] == 0.0 and x["reason"] in ("mismatch", "wrong_shape", "exception"), (task_of_row(r).family, x)


def test_pretrain_rows_never_solve_their_prompt():
    pre = pretrain_rows(200, seed=0)
    assert set(pre["domain"]) == {"pretrain"} and len(pre) == 200
    test_prompts = {_user(r) for r in make_dataset("test", 300)}
    assert not {_user(r) for r in pre} & test_prompts
    train = make_dataset("train", 1500, difficulty=3)
    solved = {_ref(r) for r in train}
    pairs = {(_user(r), _ref(r)) for r in train}
    for r in pre:
        assert (_user(r), _ref(r)) not in pairs
        if not _user(r).startswith("Copy this code"):
            assert _ref(r).startswith("```python\ndef kernel(")
    assert any(_ref(r) in solved for r in pre)   # near misses: real kernels, of another task
    assert pretrain_rows(20, seed=0).to_list() == pretrain_rows(20, seed=0).to_list()


def test_check_extras_cover_every_cheat_kind():
    assert set(CHECK_EXTRAS) == {"floor:reference_as_kernel"} | {f"cheat:{k}" for k in CHEAT_KINDS}
    rows = [dict(r) for r in make_dataset("test", 200)]
    rng = random.Random(0)
    counts = {k: sum(CHECK_EXTRAS[f"cheat:{k}"](r, _ref(r), rng) is not None for r in rows) for k in CHEAT_KINDS}
    assert min(counts.values()) >= 3 and sum(counts.values()) == len(rows)   # each row runs one cheat
    assert all(CHECK_EXTRAS["floor:reference_as_kernel"](r, _ref(r), rng) is not None for r in rows)


def test_rewards_check_scores_a_domains_extras(monkeypatch):
    """experts/check.py's CHECK_EXTRAS hook, generic: each extra is scored on the rows it
    returns a completion for (None: skipped) and reported with n, mean, min, max."""
    import types

    import datasets

    from experts import check as check_mod

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "completion": [{"role": "assistant", "content": "ok"}],
             "domain": "fake"} for i in range(4)]
    fake = types.SimpleNamespace(
        make_dataset=lambda split, n, seed=0: datasets.Dataset.from_list(rows[:n]),
        corrupt=lambda row, ref, rng: "bad",
        CHECK_EXTRAS={"half": lambda row, ref, rng: "meh" if row["prompt"][0]["content"] in ("q0", "q1") else None,
                      "never": lambda row, ref, rng: None})
    seen = []

    def reward(prompts, completions, **cols):
        seen.append(len(completions))
        return [{"ok": 1.0, "bad": 0.0, "meh": -0.5}[c[-1]["content"]] for c in completions]

    monkeypatch.setattr(check_mod, "data_module", lambda d: fake)
    monkeypatch.setattr(check_mod, "reward_function", lambda d: reward)
    res = check_mod.check("fake", n=4, progress=False)
    assert res["reference_mean"] == 1.0 and res["corrupted_mean"] == 0.0
    assert res["extras"]["half"] == {"n": 2, "mean": -0.5, "min": -0.5, "max": -0.5}
    assert res["extras"]["never"]["n"] == 0 and seen == [4, 4, 2]
