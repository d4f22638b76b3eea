"""Toy domains: reward tables (with adversarial completions), splits, pretrain data."""
from __future__ import annotations

import pytest

from mopd.tiny import load_tokenizer
from mopd.toy_tasks import (
    DOMAINS, REWARDS, TOY_DEFAULTS, WORDS, make_dataset, make_pretrain_dataset, reward_add,
    reward_reverse, sft_rows,
)


def _one(reward, completion, answer):
    return reward(prompts=[[{"role": "user", "content": "q"}]], completions=[completion], answer=[answer])[0]


REVERSE_CASES = [
    # (completion, answer, expected)
    ("start order sample", "start order sample", 1.0),
    ("  start order sample \n", "start order sample", 1.0),          # surrounding whitespace
    ("start  order\tsample", "start order sample", 1.0),             # whitespace between words
    ([{"role": "assistant", "content": "start order sample"}], "start order sample", 1.0),
    ([{"role": "assistant", "content": " start order sample "}], "start order sample", 1.0),
    ("sample order start", "start order sample", 0.0),               # echo of the prompt
    ("start order", "start order sample", 0.0),                      # too short
    ("start order sample sample", "start order sample", 0.0),        # too long
    ("start sample order", "start order sample", 0.0),               # near miss
    ("Start order sample", "start order sample", 0.0),               # case matters
    ("start, order, sample", "start order sample", 0.0),             # punctuation
    ("start order sample.", "start order sample", 0.0),
    ("The answer is: start order sample", "start order sample", 0.0),  # extra text
    ("start order sample<|im_end|>", "start order sample", 0.0),     # undecoded special token
    ("", "start order sample", 0.0),                                 # empty
    ("   \n", "start order sample", 0.0),
    ([], "start order sample", 0.0),                                 # empty message list
    ([{"role": "assistant", "content": None}], "start order sample", 0.0),
    (None, "start order sample", 0.0),
    ("start order sample " * 5000, "start order sample", 0.0),       # huge
]


@pytest.mark.parametrize("completion,answer,expected", REVERSE_CASES)
def test_reward_reverse_table(completion, answer, expected):
    assert _one(reward_reverse, completion, answer) == expected


ADD_CASES = [
    ("46", "46", 1.0),
    (" 46\n", "46", 1.0),                                    # surrounding whitespace
    ([{"role": "assistant", "content": "46"}], "46", 1.0),
    ("0", "0", 1.0),
    ("198", "198", 1.0),
    ("45", "46", 0.0),                                       # near miss
    ("47", "46", 0.0),
    ("460", "46", 0.0),
    ("4", "46", 0.0),                                        # truncated
    ("046", "46", 0.0),                                      # leading zero
    ("+46", "46", 0.0),
    ("46.0", "46", 0.0),
    ("4 6", "46", 0.0),
    ("46.", "46", 0.0),
    ("The answer is 46", "46", 0.0),                         # extra text
    ("46 + 0 = 46", "46", 0.0),
    ("12 + 34", "46", 0.0),                                  # echo of the problem
    ("", "46", 0.0),
    ([], "46", 0.0),
    (None, "46", 0.0),
    ("46" * 10_000, "46", 0.0),                              # huge
    ("4" + "6" * 10_000, "46", 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", ADD_CASES)
def test_reward_add_table(completion, answer, expected):
    assert _one(reward_add, completion, answer) == expected


def test_rewards_batch_and_domain_routing():
    prompts = [[{"role": "user", "content": "q"}]] * 3
    completions = ["b a", "3", "b a"]
    answers = ["b a", "3", "a b"]
    domains = ["reverse", "add", "reverse"]
    assert reward_reverse(prompts, completions, answer=answers, domain=domains) == [1.0, None, 0.0]
    assert reward_add(prompts, completions, answer=answers, domain=domains) == [None, 1.0, None]
    # without a domain column every row is scored; extra TRL kwargs are ignored
    assert reward_add(prompts, completions, answer=answers, trainer_state=None) == [0.0, 1.0, 0.0]
    assert set(REWARDS) == set(DOMAINS)


def test_rewards_reject_bad_columns():
    with pytest.raises(ValueError, match="answer"):
        reward_add([[]], ["1"])
    with pytest.raises(ValueError, match="2 answers"):
        reward_reverse([[]], ["a"], answer=["a", "b"])


def test_gold_answers_score_one_and_echo_scores_zero():
    for domain in DOMAINS:
        ds = make_dataset(domain, "test", 50)
        gold = REWARDS[domain](ds["prompt"], list(ds["answer"]), answer=ds["answer"], domain=ds["domain"])
        assert gold == [1.0] * 50
        echo = [p[0]["content"].split(":", 1)[-1] for p in ds["prompt"]]
        assert sum(REWARDS[domain](ds["prompt"], echo, answer=ds["answer"])) == 0.0


@pytest.mark.parametrize("domain", DOMAINS)
def test_splits_disjoint_and_deterministic(domain):
    train = make_dataset(domain, "train", 3000, seed=0)
    test = make_dataset(domain, "test", 200, seed=0)
    assert train.column_names == ["prompt", "domain", "answer"]
    assert set(train["domain"]) == set(test["domain"]) == {domain}
    train_p = {r[0]["content"] for r in train["prompt"]}
    test_p = [r[0]["content"] for r in test["prompt"]]
    assert not train_p & set(test_p)
    assert len(set(test_p)) == 200  # no repeats in the held-out set
    # other seeds draw other problems but never cross the split
    other = {r[0]["content"] for r in make_dataset(domain, "train", 3000, seed=1)["prompt"]}
    assert not other & set(test_p)
    assert make_dataset(domain, "test", 200, seed=0)[:] == test[:]
    assert make_dataset(domain, "test", 200, seed=1)[:] != test[:]
    assert all(r[0]["role"] == "user" for r in test["prompt"])


def test_difficulty_scales_problems():
    def lengths(d):
        return {len(a.split()) for a in make_dataset("reverse", "train", 300, difficulty=d)["answer"]}
    assert lengths(1) == {3, 4}
    assert lengths(3) == {3, 4, 5, 6}

    def max_operand(d):
        ops = []
        for p in make_dataset("add", "train", 500, difficulty=d)["prompt"]:
            a, b = p[0]["content"].removeprefix("What is ").rstrip("?").split(" + ")
            ops += [int(a), int(b)]
        return max(ops)
    # difficulty 1: 3-digit operands without carries; d >= 2: d-digit operands with carries
    assert 100 <= max_operand(1) <= 999
    assert 10 <= max_operand(2) <= 99


def test_reverse_lists_have_distinct_words():
    for ans in make_dataset("reverse", "train", 500)["answer"]:
        words = ans.split()
        assert len(set(words)) == len(words) and all(w in WORDS for w in words)


def test_words_are_single_tokens():
    tok = load_tokenizer()
    for w in WORDS:
        assert len(tok.encode(w, add_special_tokens=False)) == 1, w
        assert len(tok.encode(" " + w, add_special_tokens=False)) == 1, w


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown toy domain 'mul'"):
        make_dataset("mul", "train", 3)
    with pytest.raises(ValueError, match="split 'dev'"):
        make_dataset("add", "dev", 3)
    with pytest.raises(ValueError, match="difficulty"):
        make_dataset("add", "train", 3, difficulty=0)


def test_sft_rows_have_gold_completion():
    ds = sft_rows("add", "train", 20, seed=3)
    assert ds.column_names == ["prompt", "domain", "answer", "completion"]
    for row in ds:
        assert row["completion"] == [{"role": "assistant", "content": row["answer"]}]


def test_pretrain_data_teaches_neither_task():
    ds = make_pretrain_dataset(2000, seed=0)
    assert ds.column_names == ["prompt", "completion", "domain"]
    assert make_pretrain_dataset(50, seed=0)[:] == ds.select(range(50))[:]
    for row in ds:
        prompt = row["prompt"][0]["content"]
        reply = row["completion"][0]["content"]
        assert row["completion"][0]["role"] == "assistant" and reply
        assert "reverse" not in prompt.lower() and "+" not in prompt
        body = prompt.split(":", 1)[-1].split()
        if len(body) > 1 and reply.split() == body[::-1]:
            pytest.fail(f"pretrain row reverses a list: {row}")


def test_toy_defaults_shape():
    assert set(TOY_DEFAULTS["difficulty"]) == set(DOMAINS)
    assert set(TOY_DEFAULTS["teacher_sft"]) == set(DOMAINS)
    for key in ("steps", "lr", "batch_size"):
        assert key in TOY_DEFAULTS["pretrain"]
        for domain in DOMAINS:
            assert key in TOY_DEFAULTS["teacher_sft"][domain]
    m = TOY_DEFAULTS["model"]
    assert m["hidden_size"] == 64 * m["num_heads"]
