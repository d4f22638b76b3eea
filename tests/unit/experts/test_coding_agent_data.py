"""experts/coding_agent: procedural tasks (templates, the difficulty knob, splits, the
oracle's edits and reports), HumanEval with injected bugs, corrupt / pretrain_rows, the
domain's place in the registry and its recipes, and its own SFT / RL stages for a step
or two on a tiny model."""
from __future__ import annotations

import ast
import json
import os
import random
import tempfile
from pathlib import Path

import pytest
import torch

from experts import registry
from experts.coding_agent import data as D
from experts.coding_agent import humaneval as HE
from experts.coding_agent.edits import fix_edit
from core.agent.harness import Harness, load_harnesses
from rewards.coding_agent import TOOLS

REPO = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- templates
@pytest.mark.parametrize("t", D.TEMPLATES, ids=lambda t: t.key)
def test_each_template_and_its_bug(t):
    src = t.src.format(f="f", g="h")
    good, bug = t.good.format(g="h"), t.bug.format(g="h")
    assert src.count(good) == 1 and t.kind in HE.KINDS
    ns_good, ns_bug = {}, {}
    exec(compile(src, "good.py", "exec"), ns_good)   # the project's own templates, not model output
    exec(compile(src.replace(good, bug, 1), "bug.py", "exec"), ns_bug)
    rng = random.Random(t.key)
    cases = D._draw_cases(rng, t, 3, 3)
    for i, args in enumerate(cases):
        # the Python twins are what the code does (the oracle's reports rely on it)
        assert D._outcome(ns_good["f"], args) == D._outcome(t.ref, args)
        assert D._outcome(ns_bug["f"], args) == D._outcome(t.buggy, args)
        if i < 3:
            assert D._outcome(t.ref, args) != D._outcome(t.buggy, args)   # exposing cases expose


@pytest.mark.parametrize("difficulty", sorted(D.DIFFICULTIES))
def test_the_difficulty_knob(difficulty):
    bugs, files = D.DIFFICULTIES[difficulty]
    for seed in range(5):
        t = D.make_task(random.Random(seed), difficulty)
        modules = [p for p in t["files"] if p != D.TEST_FILE]
        assert len(modules) == files and len(t["bug_kinds"]) == bugs == len(t["oracle"]["edits"])
        before, after = t["oracle"]["reports"]["before"], t["oracle"]["reports"]["after"]
        assert before.count("FAIL ") == bugs and before.endswith(f"{bugs} failed, {max(bugs, files) - bugs} passed")
        assert after == f"{max(bugs, files)} passed"
        fixed = dict(t["files"])
        for e in t["oracle"]["edits"]:
            assert fixed[e["path"]].count(e["old"]) == 1
            fixed[e["path"]] = fixed[e["path"]].replace(e["old"], e["new"])
        for p, text in fixed.items():
            ast.parse(text)
        assert fixed != t["files"]
    with pytest.raises(ValueError, match="difficulty"):
        D.make_task(random.Random(0), 9)
    t = D.make_task(random.Random(0), 1, n_bugs=2, n_files=3)
    assert len(t["oracle"]["edits"]) == 2 and len(t["files"]) == 4


def test_dataset_rows_splits_and_determinism():
    a = D.make_dataset("train", 6, seed=1, difficulty=2)
    b = D.make_dataset("train", 6, seed=1, difficulty=2)
    assert a.to_list() == b.to_list()
    assert set(a.column_names) == set(D.COLUMNS)
    test_ids = {json.loads(x)["id"] for x in D.make_dataset("test", 20, seed=1, difficulty=2)["task"]}
    train_ids = {json.loads(x)["id"] for x in D.make_dataset("train", 60, seed=1, difficulty=2)["task"]}
    assert not test_ids & train_ids and len(train_ids) == 60
    row = a[0]
    assert row["domain"] == "coding_agent" and row["prompt"][0]["role"] == "user"
    roles = [m["role"] for m in row["completion"]]
    assert roles[0] == "assistant" and roles[-1] == "assistant" and "tool" in roles
    with pytest.raises(ValueError, match="efforts"):
        D.make_dataset("train", 1, effort="high")
    with pytest.raises(ValueError, match="split"):
        D.make_dataset("dev", 1)


def test_fix_edit_is_unique_and_undoes_the_bug():
    buggy = "a = 1\nb = 1\nc = a - 2\n"
    old, new = fix_edit(buggy, buggy.index("a - 2"), "a - 2", "a - 1")
    assert (old, new) == ("a - 2", "a - 1")
    old, new = fix_edit(buggy, buggy.index("1\nb"), "1", "2")   # "1" is not unique: whole lines
    assert buggy.count(old) == 1 and buggy.replace(old, new) == "a = 2\nb = 1\nc = a - 2\n"
    dup = "x = 0\ny = 1\nx = 0\nz = 1\n"
    start = dup.index("x = 0", 1)
    old, new = fix_edit(dup, start, "", "w = 5\n")            # an insertion: anchored on unique lines
    assert dup.count(old) == 1 and dup.replace(old, new) == "x = 0\ny = 1\nw = 5\nx = 0\nz = 1\n"
    with pytest.raises(ValueError):
        fix_edit(dup, 0, "nope", "x")


# ----------------------------------------------------------------------------- HumanEval
def test_humaneval_tasks_carry_a_bug_the_oracle_undoes():
    tasks = HE.humaneval_tasks()
    assert len(tasks) == 164
    kinds = {k: 0 for k in HE.KINDS}
    for t in tasks:
        src = t["files"]["solution.py"]
        ast.parse(src)
        ast.parse(t["files"]["test_solution.py"])
        (edit,) = t["oracle"]["edits"]
        assert src.count(edit["old"]) == 1
        assert src.replace(edit["old"], edit["new"]) == t["canonical"] != src
        assert "def check" in t["hidden"]["test"] and t["hidden"]["helper"]
        kinds[t["bug_kinds"][0]] += 1
    assert all(kinds.values()), kinds   # every kind of bug occurs


def test_mutations_of_each_kind():
    src = ("def f(xs, t):\n    if not xs:\n        return 0\n    n = 0\n    for x in xs:\n        if x > t:\n"
           "            n += max(x, t) - t\n    return n\n")
    muts = HE.mutations(src, 2)
    texts = {k: [b for _s, _g, b in v] for k, v in muts.items()}
    assert "1" in texts["off_by_one"]
    assert " >= " in texts["wrong_comparison"]
    assert "t, x" in texts["swapped_arguments"] and "t - max(x, t)" in texts["swapped_arguments"]
    assert "" in texts["dropped_edge_case"]
    assert "xs" in texts["wrong_return"]
    for kind, items in muts.items():
        for s, g, b in items:
            assert src[s:s + len(g)] == g


def test_visible_asserts_use_only_the_function():
    test = ("def check(candidate):\n    x = 3\n    assert candidate(1) == 2\n    assert candidate(x) == 4\n"
            "    assert abs(candidate(2) - 1) < 1e-6\n    assert True\n")
    assert HE.visible_asserts(test, "g") == ["assert g(1) == 2", "assert abs(g(2) - 1) < 1e-6"]


def test_humaneval_rows_load():
    ds = D.load_humaneval()
    mix = load_harnesses(D.HARNESSES)   # train and held_out_novel in turn: every call syntax is replayed
    assert len(ds) == 164 and set(ds["harness"]) == {h.name for h in mix.harnesses + mix.held_out}


def test_perturbed_oracle_episode_carries_one_failed_call_then_recovers():
    """agent.perturb: the injected call fails in the real environment (its error is the
    observation), the oracle's episode around it is unchanged, and it still passes."""
    from rewards.coding_agent import make_env
    hc = load_harnesses(str(D.HARNESSES)).harnesses[0]
    harness = Harness(hc, dict(TOOLS))
    tasks = ([json.loads(t) for t in D.make_dataset("test", 4, seed=0, difficulty=3)["task"]]
             + [json.loads(D.load_humaneval()[i]["task"]) for i in (0, 50)])
    kinds = set()
    for task in tasks:
        plain = D.oracle_messages(task, hc)
        for seed in range(4):
            msgs = D.oracle_messages(task, hc, perturb=True, rng=random.Random(seed))
            assert len(msgs) == len(plain) + 2
            at = next(i for i in range(len(plain)) if msgs[i] != plain[i])
            assert msgs[:at] + msgs[at + 2:] == plain
            (call,) = harness.parse(msgs[at]["content"])
            assert call.name == harness.parse(plain[at]["content"])[0].name   # a wrong version of the oracle's call
            kinds.add(call.name)
            assert msgs[at + 1]["content"] != plain[at + 1]["content"]
    assert kinds == {"replace", "read_file"}
    # the real environment refuses the wrong call once, and the episode still passes the hidden tests
    env = make_env(hc)
    env.reset(tasks[0])
    failed = 0
    try:
        for m in D.oracle_messages(tasks[0], hc, perturb=True, rng=random.Random(1))[1:]:
            if m["role"] == "assistant":
                _, done, info = env.step(m["content"])
                failed += info["failed_calls"]
    finally:
        env.close()
    assert failed == 1 and done and info["reward"] == 1.0


# ----------------------------------------------------------------------------- corrupt / pretrain
def test_corrupt_and_pretrain_rows():
    row = D.make_dataset("test", 1, seed=0)[0]
    seen = set()
    for seed in range(12):
        msgs = D.corrupt(row, row["completion"], random.Random(seed))
        assert msgs and msgs[-1]["role"] == "assistant" and "submit" in msgs[-1]["content"]
        seen.add(len(msgs))
    assert len(seen) == 2   # submit alone, or a test rewrite then submit
    pre = D.pretrain_rows(12, seed=0)
    assert pre.num_rows == 12 and set(pre["domain"]) == {"pretrain"}
    mix = load_harnesses(str(D.HARNESSES))
    for p, c in zip(pre["prompt"], pre["completion"]):
        assert [m["role"] for m in p] == ["system", "user"] and len(c) == 1
        parsed = [_parse_ok(Harness(h, dict(TOOLS)), c[0]["content"]) for h in mix.harnesses]
        assert any(calls and [x.name for x in calls] == ["run_tests"] for calls in parsed)
    assert D.pretrain_rows(3, seed=1).to_list() == D.pretrain_rows(3, seed=1).to_list()


# ----------------------------------------------------------------------------- registry and recipes
def test_registry_and_recipes():
    from experts.coding_agent.data import TRAINER as T
    from experts.run import ExpertConfig
    from core.config import load_config

    assert "coding_agent" in registry.all_domains()
    assert registry.is_agent_domain("coding_agent")
    assert registry.domain_trainer("coding_agent") is T
    assert registry.reward_function("coding_agent").__name__ == "reward_coding_agent"
    assert "humaneval" in D.DATASETS
    for stage in ("sft", "rl"):
        cfg = load_config(ExpertConfig, REPO / "recipes" / "experts" / "coding_agent" / f"{stage}.yaml")
        assert cfg.domain == "coding_agent" and cfg.stage == stage
        assert cfg.agent.harnesses == "recipes/harnesses/coding_agent.yaml"
    mix = load_harnesses(REPO / "recipes" / "harnesses" / "coding_agent.yaml")
    for h in mix.harnesses + mix.held_out:
        Harness(h, dict(TOOLS))   # every harness fits the tools


def _parse_ok(h, text):
    try:
        return h.parse(text)
    except Exception:
        return None


# ----------------------------------------------------------------------------- training stages
SMALL = ["train.max_steps=2", "data.n_train=4", "train.batch_size=2", "rl.num_generations=2", "agent.max_turns=2",
         "agent.max_new_tokens=8", "train.logging_steps=1", "train.max_length=1024"]


@pytest.mark.usefixtures("one_torch_thread")
def test_sft_and_rl_stages_take_steps(tmp_path):
    from experts.run import ExpertConfig, build_dataset, load_model, train
    from core.config import load_config
    from core.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "base", seed=0, max_position_embeddings=1536)
    for stage in ("sft", "rl"):
        cfg = load_config(ExpertConfig, REPO / "recipes" / "experts" / "coding_agent" / f"{stage}.yaml",
                          [f"model.path={base}", f"model.base={base}", *SMALL])
        domain = registry.load_domain("coding_agent")
        ds = build_dataset(cfg, domain, "train", cfg.data.n_train)
        model, tok = load_model(cfg)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        out = tmp_path / stage
        out.mkdir()
        model_dir = train(cfg, domain, model, tok, ds, out)
        assert (model_dir / "config.json").exists()
        if stage == "sft":   # RL on a random model may see equal rewards in every group (no step)
            assert any(not torch.equal(before[k], v.detach()) for k, v in model.named_parameters())
    # every episode's workspace went when its turn loop ended (cut episodes included)
    assert not list(Path(tempfile.gettempdir()).glob(f"mopd-ws-{os.getpid()}-*/ep-*"))
