"""experts/agent/data.py: deterministic disjoint splits, horizon = number of dependent calls,
oracle episodes that succeed through every harness (also perturbed), dropped calls that
fail, pretrain rows that never solve the task, BFCL's multi-turn tasks replayed through
`mopd rewards check`."""
from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")

from experts.agent import data  # noqa: E402
from experts.check import check  # noqa: E402
from core.agent.harness import ToolCall, load_harnesses  # noqa: E402
from rewards.agent import HARNESSES, execute, harness_config, make_env, new_instances, reward  # noqa: E402

MIX = load_harnesses(HARNESSES)
ALL_HARNESSES = MIX.harnesses + MIX.held_out


def _scores(rows, completions=None, **kw):
    comps = completions if completions is not None else [r["completion"] for r in rows]
    return reward([r["prompt"] for r in rows], comps, task=[r["task"] for r in rows],
                  harness=[r["harness"] for r in rows], domain=[r["domain"] for r in rows], **kw)


def test_splits_are_deterministic_and_disjoint():
    train = data.make_dataset("train", 60, seed=0, difficulty=4)
    test = data.make_dataset("test", 30, seed=0, difficulty=4)
    assert train.to_list() == data.make_dataset("train", 60, seed=0, difficulty=4).to_list()
    assert train.to_list() != data.make_dataset("train", 60, seed=1, difficulty=4).to_list()
    ids = lambda ds: {json.loads(t)["id"] for t in ds["task"]}  # noqa: E731
    assert not ids(train) & ids(test)
    assert not ids(test) & ids(data.make_dataset("train", 60, seed=1, difficulty=4))
    assert len(ids(train)) == 60 and len(ids(test)) == 30
    assert set(train.column_names) == {"prompt", "completion", "domain", "task", "harness"}
    assert set(train["domain"]) == {"agent"} and set(train["harness"]) == {MIX.harnesses[0].name}
    fams = [json.loads(t)["family"] for t in train["task"]]
    assert fams[:3] == list(data.FAMILIES) and {fams.count(f) for f in data.FAMILIES} == {20}
    row = train[0]
    assert row["prompt"] == [{"role": "user", "content": json.loads(row["task"])["user"]}]
    assert row["completion"][-1]["role"] == "assistant"


def _values(result) -> set:
    out = set()
    if isinstance(result, dict):
        for v in result.values():
            out |= _values(v)
    elif isinstance(result, list):
        for v in result:
            out |= _values(v)
    else:
        out.add(result)
    return out


@pytest.mark.parametrize("horizon", data.HORIZONS)
@pytest.mark.parametrize("family", data.FAMILIES)
def test_horizon_is_the_number_of_dependent_calls(family, horizon):
    for task in data.make_tasks("train", 10, seed=0, difficulty=horizon, families=[family]):
        gt = task["ground_truth"]
        assert task["horizon"] == horizon and len(gt) == horizon
        inst = new_instances(task)
        offered = {t: task["involved_classes"][0] for t in task["tools"]}
        prev = None
        for i, call in enumerate(gt):
            if i:   # each later call passes a value the previous call returned
                assert _values(call["args"]) & _values(prev), (task["id"], i, call, prev)
            prev, _text, err = execute(inst, offered, call["name"], call["args"])
            assert err is None
        # the value the chain starts from is in the prompt, the ones it needs later are not
        later = {v for c in gt[1:] for v in _values(c["args"]) if isinstance(v, str) and v != data.ANSWER_FILE}
        if family != "math":
            tokens = re.findall(r"[\w.]+", task["user"])
            words = set(tokens) | {w.rstrip(".") for w in tokens}
            assert not (later - set(data.MESSAGES)) & words, task


@pytest.mark.parametrize("horizon", [1, 2, 8, 16])
def test_oracle_succeeds_through_every_harness_and_a_dropped_call_fails(horizon):
    tasks = data.make_tasks("test", 6, seed=3, difficulty=horizon)
    rng = random.Random(0)
    for task in tasks:
        for h in ALL_HARNESSES:
            msgs = data.oracle_messages(task, h)
            assert msgs[0] == {"role": "user", "content": task["user"]} and msgs[-1]["role"] == "assistant"
            assert sum(m["role"] == "assistant" for m in msgs) == horizon + 1
            row = {"prompt": msgs[:1], "task": json.dumps(task), "harness": h.name, "domain": "agent"}
            assert _scores([row], [msgs[1:]]) == [1.0]
            assert _scores([row], [msgs[1:]], checker="bfcl") == [1.0]
            bad = data.oracle_messages(task, h, drop=rng.randrange(horizon))
            assert _scores([row], [bad[1:]]) == [0.0]
            assert _scores([row], [bad[1:]], checker="bfcl") == [0.0]


def test_perturbed_oracle_has_an_error_then_recovers():
    kinds = set()
    for task in data.make_tasks("train", 30, seed=0, difficulty=4):
        for h in ALL_HARNESSES:
            msgs = data.oracle_messages(task, h, perturb=True, rng=random.Random(task["id"] + h.name))
            errors = [m for m in msgs if m["role"] == "tool" and m["content"].startswith("error:")]
            assert len(errors) == 1, msgs
            kinds.add(errors[0]["content"].split()[1])
            assert sum(m["role"] == "assistant" for m in msgs) == 4 + 2
            row = {"prompt": msgs[:1], "task": json.dumps(task), "harness": h.name, "domain": "agent"}
            assert _scores([row], [msgs[1:]]) == [1.0]
    assert len(kinds) >= 3, kinds   # file, user, missing-argument errors
    task = data.make_tasks("train", 1, seed=0, difficulty=4)[0]
    assert data.oracle_messages(task, "json_plain", perturb=True, rng=random.Random(5)) == \
        data.oracle_messages(task, "json_plain", perturb=True, rng=random.Random(5))


def test_malformed_call_is_an_error_observation_and_episode_goes_on():
    task = data.make_tasks("train", 1, seed=0, difficulty=2, families=["files"])[0]
    for h in ALL_HARNESSES:
        env = make_env(h)
        env.reset(task)
        text = env.harness.render([ToolCall("cat", {"file_name": "x.txt"})])
        obs, done, info = env.step(text[: len(text) // 2])     # cut in the middle: unparseable or no call
        if info["failed_calls"]:
            assert obs.startswith("error:") and not done
        msgs = data.oracle_messages(task, h)
        broken = [{"role": "assistant", "content": '```json\n{"name": "cat"'}] if h.syntax == "json" else []
        row = {"prompt": msgs[:1], "task": json.dumps(task), "harness": h.name, "domain": "agent"}
        assert _scores([row], [broken + msgs[1:]]) == [1.0]


def test_corrupt_and_rewards_check_on_procedural_rows():
    for difficulty in (2, 8):
        ds = data.make_dataset("test", 30, seed=0, difficulty=difficulty)
        rows = ds.to_list()
        assert _scores(rows) == [1.0] * len(rows)
        rng = random.Random(0)
        assert _scores(rows, [data.corrupt(r, r["completion"], rng) for r in rows]) == [0.0] * len(rows)
    res = check("agent", "procedural", n=60, progress=False)
    assert res["reference_mean"] == 1.0 and res["corrupted_mean"] == 0.0
    assert res["variants"]["bfcl_checker"] == {"reference_mean": 1.0, "corrupted_mean": 0.0}


def test_pretrain_rows_have_the_format_but_never_the_answer():
    n = 60
    ds = data.pretrain_rows(n, seed=0)
    assert len(ds) == n and set(ds["domain"]) == {"pretrain"}
    assert set(ds.column_names) == {"prompt", "completion", "domain"}
    assert ds.to_list() == data.pretrain_rows(n, seed=0).to_list()
    systems = set()
    for row in ds.to_list():
        system, user = row["prompt"]
        assert system["role"] == "system" and user["role"] == "user"
        systems.add(system["content"])
        (msg,) = row["completion"]
        assert msg["role"] == "assistant" and msg["content"]
    assert len(systems) > 3   # several harnesses and families


def test_difficulty_one_prompts_are_short():
    from tokenizers import Tokenizer

    from core.tiny import TOKENIZER_DIR

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    n_tokens = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    for difficulty in (1, 2, 16):
        ds = data.make_dataset("train", 30, seed=0, difficulty=difficulty)
        limit = 40 if difficulty < 16 else 80
        assert max(n_tokens(p[0]["content"]) for p in ds["prompt"]) <= limit
        env = make_env(harness_config())
        env.reset(json.loads(ds["task"][0]))
        assert n_tokens(env.messages[0]["content"]) <= 150   # the system prompt of one family's tools


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        data.make_dataset("dev", 3)
    for d in (0, 17, 2.0):
        with pytest.raises(ValueError, match="difficulty"):
            data.make_dataset("train", 3, difficulty=d)
    with pytest.raises(ValueError, match="effort"):
        data.make_dataset("train", 3, effort="high")
    with pytest.raises(ValueError, match="families"):
        data.make_dataset("train", 3, families=["web"])
    with pytest.raises(ValueError, match="perturb"):
        data.oracle_messages(data.bfcl_tasks()[0], perturb=True)
    assert data.EFFORTS == () and data.MULTI_TURN


def test_bfcl_multi_turn_references_pass_and_dropped_calls_fail():
    ds = data.DATASETS["bfcl_multi_turn"]()
    assert len(ds) == 200 and {r for r in ds["harness"]} == {h.name for h in ALL_HARNESSES}
    tasks = [json.loads(t) for t in ds["task"]]
    assert sum(len(turn) for t in tasks for turn in t["ground_truth"]) == 1142
    assert all(t["toolset"] == "bfcl" and len(t["user"]) == len(t["ground_truth"]) for t in tasks)
    # positional ground truth ("sort('final_report.pdf')") is named from the signature
    assert tasks[0]["ground_truth"][2] == [{"name": "sort", "args": {"file_name": "final_report.pdf"}}]
    res = check("agent", "bfcl_multi_turn", progress=False)
    assert res["reference_mean"] >= 0.99 and res["corrupted_mean"] <= 0.2, res
    assert {tasks[i]["id"] for i in res["reference_below_1"]} <= set(data.BFCL_UNSATISFIABLE)
    assert res["variants"]["bfcl_checker"]["reference_mean"] == res["reference_mean"]
    assert res["variants"]["bfcl_checker"]["corrupted_mean"] <= 0.2
