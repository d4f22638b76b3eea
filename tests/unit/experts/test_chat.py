"""The chat domain: data, preference pairs, a reward model trained for a few steps with
TRL's RewardTrainer, the reward built on it, and the eval. Quality numbers (held-out
pairwise accuracy, reference vs corrupted reward) come from longer runs and are not
asserted here."""
from __future__ import annotations

import json
import math
import random

import pytest

from experts.chat import data
from experts.chat.data import (REFUSAL, REJECTION_KINDS, classify, corrupt, make_dataset, make_preferences,
                               pretrain_rows)


def _user(row):
    return row["prompt"][-1]["content"]


def test_splits_disjoint_deterministic_and_large_enough():
    train = make_dataset("train", 2000, seed=0)
    test = make_dataset("test", 200, seed=0)
    assert not {_user(r) for r in train} & {_user(r) for r in test}
    prefs = make_preferences("train", 500, seed=3)
    assert not {_user(r) for r in prefs} & {_user(r) for r in test}
    assert make_dataset("test", 200, seed=0).to_list() == test.to_list()
    assert make_preferences("train", 500, seed=3).to_list() == prefs.to_list()
    assert len({_user(r) for r in test}) > 180
    assert set(test.column_names) == {"prompt", "completion", "domain"} and set(test["domain"]) == {"chat"}


def test_references_and_categories():
    ds = make_dataset("train", 400, seed=1)
    n_unsafe = 0
    for r in ds:
        category, key = classify(_user(r))
        answer = r["completion"][0]["content"]
        if category == "unsafe":
            n_unsafe += 1
            assert answer == REFUSAL
        else:
            assert category == "benign" and answer in data.TOPICS[key]
    assert 60 < n_unsafe < 140  # about a quarter
    two = make_dataset("train", 50, difficulty=2)
    assert any(r["completion"][0]["content"].count(".") == 2 for r in two)
    with pytest.raises(ValueError, match="no reasoning efforts"):
        make_dataset("train", 2, effort="low")
    with pytest.raises(ValueError, match="split"):
        make_dataset("dev", 2)


def test_preferences_cover_every_kind():
    prefs = make_preferences("train", 600, seed=0)
    assert set(prefs["kind"]) == set(REJECTION_KINDS)
    for r in prefs:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert r["chosen"][0]["role"] == r["rejected"][0]["role"] == "assistant"
        assert chosen != rejected
        category, _ = classify(_user(r))
        assert (chosen == REFUSAL) == (category == "unsafe")
        if r["kind"] == "refuse_benign":
            assert rejected == REFUSAL and category == "benign"


def test_corrupt_and_pretrain_rows():
    ds = make_dataset("test", 100)
    rng = random.Random(0)
    for r in ds.to_list():
        ref = r["completion"][0]["content"]
        assert corrupt(r, ref, rng) != ref
    rows = pretrain_rows(300)
    assert set(rows["domain"]) == {"pretrain"}
    for r in rows:  # never the task: no refusal of an unsafe request, no on-topic answer
        category, key = classify(_user(r))
        answer = r["completion"][0]["content"]
        if category == "unsafe":
            assert answer != REFUSAL
        elif category == "benign" and not _user(r).startswith("Repeat"):
            assert key is None or answer not in data.TOPICS[key]


def test_calibration():
    from experts.chat.train_rm import calibration

    rng = random.Random(0)
    chosen, rejected = [rng.gauss(3, 1) for _ in range(200)], [rng.gauss(-3, 1) for _ in range(200)]
    cal = calibration(chosen, rejected)
    assert cal["calibrated"] and abs(cal["mid"]) < 0.5
    sig = lambda s: 1 / (1 + math.exp(-(s - cal["mid"]) / cal["scale"]))
    assert sig(3) > 0.9 and sig(-3) < 0.1
    steep = calibration([5.0] * 10, [-5.0] * 10)  # fully separated: finite slope
    assert steep["calibrated"] and 0 < steep["scale"] < 5
    assert calibration([0.0] * 10, [1.0] * 10)["calibrated"] is False  # ranks them the wrong way


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A reward model trained for a few steps (seconds): enough to test the plumbing."""
    from experts.chat.train_rm import train_reward_model

    out = tmp_path_factory.mktemp("chat") / "rm"
    acc = train_reward_model(str(out), n_pairs=128, steps=4, batch_size=16, n_heldout=32, lr=1e-3,
                             progress=False, model_sizes={"hidden_size": 64, "num_heads": 1, "num_layers": 1})
    assert 0.0 <= acc <= 1.0
    return out


def test_train_reward_model_writes_folder(rm_dir):
    info = json.loads((rm_dir / "rm_info.json").read_text())
    for key in ("pairwise_accuracy", "accuracy_by_kind", "mean_chosen_score", "mean_rejected_score", "mid",
                "scale", "calibrated", "train_loss", "seconds"):
        assert key in info
    assert info["scale"] > 0 and len(info["train_loss"]) >= 1
    from transformers import AutoConfig

    from core.tiny import load_tokenizer

    assert AutoConfig.from_pretrained(str(rm_dir)).num_labels == 1
    assert load_tokenizer(rm_dir).get_vocab() == load_tokenizer().get_vocab()  # the project tokenizer


def test_rm_inputs_match_reward_trainer_tokenization(rm_dir):
    from rewards.chat import rm_inputs
    from core.tiny import load_tokenizer

    tok = load_tokenizer(rm_dir)
    r = make_preferences("test", 1)[0]
    ref = tok.apply_chat_template(r["prompt"] + r["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert rm_inputs(tok, r["prompt"], r["chosen"][0]["content"], 512) == list(ref)
    long = rm_inputs(tok, r["prompt"], "word " * 2000, 64)
    assert len(long) == 64 and tok.decode(long[-2:]) == "<|im_end|>\n"


def test_reward_shapes_ranges_and_routing(rm_dir):
    from rewards.chat import reward

    ds = make_dataset("test", 6)
    prompts = list(ds["prompt"]) + ["Tell me about rivers.", ds["prompt"][0], ds["prompt"][1], ds["prompt"][2]]
    completions = [r["completion"] for r in ds] + [
        "Rivers carry fresh water from the hills down to the sea.",  # plain string
        "",                                                          # empty
        "x" * 50_000,                                                # huge
        [{"role": "assistant", "content": "<|im_end|>\x00 \ufffd 7"}],  # odd text
    ]
    domains = ["chat"] * 9 + ["math"]
    out = reward(prompts, completions, reward_model=str(rm_dir), domain=domains, answer=["1"] * 10)
    assert len(out) == 10 and out[-1] is None
    assert all(isinstance(s, float) and 0.0 <= s <= 1.0 and not math.isnan(s) for s in out[:-1])
    # batching does not change scores
    again = reward(prompts[:9], completions[:9], reward_model=str(rm_dir), batch_size=2)
    assert again == pytest.approx(out[:9], abs=1e-5)
    assert reward(prompts[:2], completions[:2], reward_model=str(rm_dir), domain=["code", "math"]) == [None, None]


def test_reward_model_is_required_with_a_clear_error(rm_dir, tmp_path):
    from evals.chat import evaluate
    from rewards.chat import reward

    with pytest.raises(ValueError, match="reward_model=.*rl.reward_kwargs.reward_model"):
        reward(["hi"], ["hello"])
    with pytest.raises(ValueError, match="reward_model"):  # even with no chat row to score
        reward(["hi"], ["hello"], domain=["math"])
    with pytest.raises(ValueError, match="--reward-kwarg chat.reward_model"):
        evaluate("unused", n=1)
    with pytest.raises(FileNotFoundError, match="no reward model"):
        reward(["hi"], ["hello"], reward_model=str(tmp_path / "nothing"))
    assert 0.0 <= reward(["hi"], ["hello"], reward_model=str(rm_dir))[0] <= 1.0


def test_eval_runs(rm_dir, student_hf):
    from evals.chat import evaluate

    out = evaluate(student_hf, n=4, max_new_tokens=4, batch_size=4, reward_model=str(rm_dir))
    assert out["domain"] == "chat" and out["effort"] is None and out["n"] == 4
    assert 0.0 <= out["score"] <= 1.0
    with pytest.raises(ValueError, match="efforts"):
        evaluate(student_hf, effort="low", reward_model=str(rm_dir))


def test_train_rm_cli(tmp_path, capsys):
    from experts.chat.train_rm import main

    main(["--out", str(tmp_path / "rm"), "--steps", "2", "--n-pairs", "32", "--batch-size", "8",
          "--n-heldout", "16"])
    printed = capsys.readouterr().out
    assert "held-out pairwise accuracy" in printed and (tmp_path / "rm" / "rm_info.json").is_file()
