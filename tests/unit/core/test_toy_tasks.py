"""Toy domains: reward tables (with adversarial completions), splits, pretrain data."""
from __future__ import annotations

import pytest

from core.tiny import load_tokenizer
from core.toy_tasks import (
    DOMAINS, REWARDS, TOY_DEFAULTS, WORDS, make_dataset, make_pretrain_dataset, reward_reverse,
    reward_rotate, sft_rows,
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


ROTATE_CASES = [
    ("order sample start", "order sample start", 1.0),
    (" order sample start\n", "order sample start", 1.0),
    ([{"role": "assistant", "content": "order sample start"}], "order sample start", 1.0),
    ("start order sample", "order sample start", 0.0),     # echo of the prompt
    ("sample order start", "order sample start", 0.0),     # the reverse (the other domain)
    ("sample start order", "order sample start", 0.0),     # rotated the wrong way
    ("order sample", "order sample start", 0.0),           # dropped the moved word
    ("order sample start.", "order sample start", 0.0),
    ("", "order sample start", 0.0),
    ([], "order sample start", 0.0),
    (None, "order sample start", 0.0),
    ("order sample start " * 5000, "order sample start", 0.0),  # huge
]


@pytest.mark.parametrize("completion,answer,expected", ROTATE_CASES)
def test_reward_rotate_table(completion, answer, expected):
    assert _one(reward_rotate, completion, answer) == expected


def test_rewards_batch_and_domain_routing():
    prompts = [[{"role": "user", "content": "q"}]] * 3
    completions = ["b a", "b c a", "b a"]
    answers = ["b a", "b c a", "a b"]
    domains = ["reverse", "rotate", "reverse"]
    assert reward_reverse(prompts, completions, answer=answers, domain=domains) == [1.0, None, 0.0]
    assert reward_rotate(prompts, completions, answer=answers, domain=domains) == [None, 1.0, None]
    # without a domain column every row is scored; extra TRL kwargs are ignored
    assert reward_rotate(prompts, completions, answer=answers, trainer_state=None) == [1.0, 1.0, 0.0]
    assert set(REWARDS) == set(DOMAINS)


def test_rewards_reject_bad_columns():
    with pytest.raises(ValueError, match="answer"):
        reward_rotate([[]], ["1"])
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
    for domain in DOMAINS:
        def lengths(d):
            return {len(a.split()) for a in make_dataset(domain, "train", 300, difficulty=d)["answer"]}
        assert lengths(1) == {3, 4}
        assert lengths(3) == {3, 4, 5, 6}


def test_rotate_moves_the_first_word_last():
    for p, ans in zip(*(lambda ds: (ds["prompt"], ds["answer"]))(make_dataset("rotate", "train", 200))):
        words = p[0]["content"].split(":", 1)[1].split()
        assert ans.split() == words[1:] + words[:1]
        assert ans.split() != words[::-1] and ans.split() != words


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
        make_dataset("rotate", "dev", 3)
    with pytest.raises(ValueError, match="difficulty"):
        make_dataset("rotate", "train", 3, difficulty=0)


def test_sft_rows_have_gold_completion():
    ds = sft_rows("rotate", "train", 20, seed=3)
    assert ds.column_names == ["prompt", "domain", "answer", "completion"]
    for row in ds:
        assert row["completion"] == [{"role": "assistant", "content": row["answer"]}]


def test_pretrain_data_answers_toy_instructions_at_chance():
    """The base sees the toy instructions, answered with a uniformly random order of the
    given words: it learns the answer's shape, not the skill (see make_pretrain_dataset)."""
    ds = make_pretrain_dataset(3000, seed=0)
    assert ds.column_names == ["prompt", "completion", "domain"]
    assert make_pretrain_dataset(50, seed=0)[:] == ds.select(range(50))[:]
    hits = {"Reverse the words": [0, 0], "Move the first word to the end": [0, 0]}
    for row in ds:
        prompt = row["prompt"][0]["content"]
        reply = row["completion"][0]["content"]
        assert row["completion"][0]["role"] == "assistant" and reply
        instr, _, body = prompt.partition(": ")
        if instr in hits:
            words = body.split()
            assert sorted(reply.split()) == sorted(words)          # an arrangement of them
            right = words[::-1] if instr.startswith("Reverse") else words[1:] + words[:1]
            hits[instr][0] += reply.split() == right
            hits[instr][1] += 1
    for instr, (right, n) in hits.items():
        # 3-5 words in random order: right 1/6, 1/24 or 1/120 of the time, ~7% overall
        assert n > 400 and right / n < 0.15, (instr, right, n)


def test_toy_defaults_shape():
    assert set(TOY_DEFAULTS["difficulty"]) == set(DOMAINS)
    assert set(TOY_DEFAULTS["teacher_sft"]) == set(DOMAINS)
    for key in ("steps", "lr", "batch_size"):
        assert key in TOY_DEFAULTS["pretrain"]
        for domain in DOMAINS:
            assert key in TOY_DEFAULTS["teacher_sft"][domain]
    m = TOY_DEFAULTS["model"]
    assert m["hidden_size"] == 64 * m["num_heads"]
