"""experts/search_agent/: deterministic disjoint splits, difficulty = hops (each page read
names the next search), BM25 ranks the chain's pages first, oracle episodes that succeed
through every harness (also perturbed) and fit the recipes' budgets, corrupted episodes
that fail, pretrain rows that never solve the task, `mopd rewards check`'s numbers, and
the domain's own SFT/RL loop for two steps on a tiny model."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from experts import registry
from experts.check import check
from experts.run import ExpertConfig, build_dataset, load_model, train
from experts.search_agent import data
from experts.search_agent.data import TRAINER as T
from core.agent.harness import load_harnesses
from core.agent.transcript import encode_segments
from core.config import load_config
from core.tiny import build_tiny_model, load_tokenizer
from rewards.search_agent import HARNESSES, make_env, reward, search_index

REPO = Path(__file__).resolve().parents[3]
MIX = load_harnesses(HARNESSES)
ALL_HARNESSES = MIX.harnesses + MIX.held_out


def _scores(rows, completions=None):
    comps = completions if completions is not None else [r["completion"] for r in rows]
    return reward([r["prompt"] for r in rows], comps, task=[r["task"] for r in rows],
                  harness=[r["harness"] for r in rows], domain=[r["domain"] for r in rows])


def _quoted(text: str) -> set[str]:
    return set(re.findall(r'"([^"]+)"', text))


# ----------------------------------------------------------------------------- tasks

def test_splits_are_deterministic_and_disjoint():
    train_ds = data.make_dataset("train", 40, seed=0, difficulty=2)
    test_ds = data.make_dataset("test", 20, seed=0, difficulty=2)
    assert train_ds.to_list() == data.make_dataset("train", 40, seed=0, difficulty=2).to_list()
    assert train_ds.to_list() != data.make_dataset("train", 40, seed=1, difficulty=2).to_list()
    ids = lambda ds: {json.loads(t)["id"] for t in ds["task"]}  # noqa: E731
    assert not ids(train_ds) & ids(test_ds)
    assert not ids(test_ds) & ids(data.make_dataset("train", 40, seed=1, difficulty=2))
    assert len(ids(train_ds)) == 40 and len(ids(test_ds)) == 20
    assert set(train_ds.column_names) == {"prompt", "completion", "domain", "task", "harness"}
    assert set(train_ds["domain"]) == {"search_agent"} and set(train_ds["harness"]) == {MIX.harnesses[0].name}
    row = train_ds[0]
    assert row["prompt"] == [{"role": "user", "content": json.loads(row["task"])["user"]}]
    assert row["completion"][-1] == {"role": "assistant", "content": json.loads(row["task"])["answer"]}


@pytest.mark.parametrize("hops", data.HORIZONS)
def test_difficulty_is_the_number_of_pages_read_in_turn(hops):
    for task in data.make_tasks("train", 12, seed=0, difficulty=hops):
        gt = task["ground_truth"]
        assert task["horizon"] == hops and len(gt) == 2 * hops
        assert [c["name"] for c in gt] == ["search", "open"] * hops
        docs = {d["id"]: d for d in task["docs"]}
        names = [c["args"]["query"] for c in gt[0::2]]
        pages = [docs[c["args"]["doc_id"]] for c in gt[1::2]]
        assert names[0] == task["start"] and f'"{names[0]}"' in task["user"]
        for i in range(1, hops):
            # the next name comes from the page just read, and from nowhere the model saw before
            assert names[i] in _quoted(pages[i - 1]["text"]), (task["id"], i)
            assert names[i] not in task["user"]
        # the answer is stated by the last page only, and never by a search snippet
        assert task["answer"] in _quoted(pages[-1]["text"]) and task["attribute"] in pages[-1]["text"]
        assert not any(task["answer"] in d["text"] for d in task["docs"] if d is not pages[-1])
        assert all(f"The {task['attribute']} of" not in p["text"] for p in pages[:-1])
        assert task["answer"] not in task["user"]


def test_bm25_ranks_each_chain_page_first_and_distractors_stay_off_the_chain():
    for hops in data.HORIZONS:
        for task in data.make_tasks("test", 8, seed=2, difficulty=hops):
            idx = search_index(task["docs"])
            gt = task["ground_truth"]
            for s, o in zip(gt[0::2], gt[1::2]):
                hits = idx.search(s["args"]["query"])
                assert hits[0][0]["id"] == o["args"]["doc_id"] and (len(hits) == 1 or hits[1][1] < hits[0][1])
            ents = {e["name"]: e for e in task["entities"]}
            assert sum(e["chain"] for e in task["entities"]) == hops
            for e in task["entities"]:
                if not e["chain"] and e["link"]:
                    assert not ents[e["link"]]["chain"], e   # a wrong page never leads back to the chain
            people = [e["name"].split() for e in task["entities"] if e["type"] == "person"]
            first = people[0]
            # person distractors share a first or a last name: a search must match the whole name
            assert any(p[0] == first[0] and p != first for p in people) and any(
                p[1] == first[1] and p != first for p in people)
            assert any(d["title"] == "News" for d in task["docs"])


def test_bad_arguments_are_named():
    for kw, msg in (({"difficulty": 0}, "hops"), ({"difficulty": 5}, "hops"), ({"effort": "high"}, "efforts"),
                    ({"families": ("nosuch",)}, "families")):
        with pytest.raises(ValueError, match=msg):
            data.make_dataset("train", 2, **kw)
    with pytest.raises(ValueError, match="split"):
        data.make_dataset("dev", 2)


# ----------------------------------------------------------------------------- oracle and corrupt

@pytest.mark.parametrize("hops", [1, 4])
def test_oracle_succeeds_through_every_harness_and_corrupted_fails(hops):
    rng = random.Random(0)
    for task in data.make_tasks("test", 5, seed=3, difficulty=hops):
        for h in ALL_HARNESSES:
            msgs = data.oracle_messages(task, h)
            assert msgs[0] == {"role": "user", "content": task["user"]}
            assert sum(m["role"] == "assistant" for m in msgs) == 2 * hops + 1
            row = {"prompt": msgs[:1], "task": json.dumps(task), "harness": h.name, "domain": "search_agent"}
            assert _scores([row], [msgs[1:]]) == [1.0]
            bad = data.corrupt(row, msgs[1:], rng)
            assert bad[-1]["content"] != task["answer"] and _scores([row], [bad]) == [0.0]


def test_document_ids_are_titles_and_a_wrong_open_is_a_near_miss_title():
    for task in data.make_tasks("train", 10, seed=0, difficulty=3):
        ids = {d["id"] for d in task["docs"]}
        for d in task["docs"]:
            assert d["id"] == d["title"] if d["title"] != "News" else re.fullmatch(r"News \d+", d["id"]), d
        for c in task["ground_truth"][1::2]:    # the oracle opens the title it just searched
            wrong = data._wrong_call(task, c).args["doc_id"]
            assert wrong not in ids and wrong != c["args"]["doc_id"]
            # same first name (a person) or a name of the same type: a plausible slip, not noise
            assert wrong.split()[0] == c["args"]["doc_id"].split()[0] or \
                any(wrong in v and c["args"]["doc_id"] in v for v in data.NAMES.values()), (wrong, c)


def test_perturbed_oracle_has_an_error_then_recovers():
    kinds = set()
    for task in data.make_tasks("train", 10, seed=0, difficulty=2):
        for h in ALL_HARNESSES:
            msgs = data.oracle_messages(task, h, perturb=True, rng=random.Random(task["id"] + h.name))
            errors = [m["content"] for m in msgs if m["role"] == "tool" and m["content"].startswith("error:")]
            assert len(errors) == 1, msgs
            kinds.add("document" if "no document" in errors[0] else "argument")
            assert sum(m["role"] == "assistant" for m in msgs) == 2 * 2 + 2
            row = {"prompt": msgs[:1], "task": json.dumps(task), "harness": h.name, "domain": "search_agent"}
            assert _scores([row], [msgs[1:]]) == [1.0]
    assert kinds == {"document", "argument"}
    task = data.make_tasks("train", 1, seed=0)[0]
    assert data.oracle_messages(task, "json_plain", perturb=True, rng=random.Random(5)) == \
        data.oracle_messages(task, "json_plain", perturb=True, rng=random.Random(5))


def test_truncating_harness_keeps_the_facts_of_every_page():
    h = next(h for h in MIX.harnesses if h.context.kind == "truncate_obs")
    env = make_env(h)
    pages = cut = 0
    for task in data.make_tasks("test", 10, seed=1, difficulty=4):
        for d in task["docs"]:
            if d["title"] == "News":
                continue
            shown = env.harness.format_observation([d["text"]])
            facts = _quoted(d["text"])
            assert facts and all(f'"{x}"' in shown for x in facts), (shown, d["text"])
            pages += 1
            cut += shown.endswith("...(cut)")
    assert cut > pages / 2   # the policy does cut: the filler is what goes


def test_episodes_fit_the_recipes_budgets():
    tok = load_tokenizer()
    cfg = load_config(ExpertConfig, REPO / "recipes" / "experts" / "search_agent" / "sft.yaml")
    longest = 0
    for task in data.make_tasks("test", 4, seed=0, difficulty=data.MAX_HORIZON):
        for h in ALL_HARNESSES:
            env = make_env(h)
            env.reset(task)
            msgs = [env.messages[0]] + data.oracle_messages(task, h, perturb=True, rng=random.Random(1))
            for p, c, _m in encode_segments(tok, msgs, env.harness.apply_context):
                longest = max(longest, len(p) + len(c))
            for m in msgs:
                if m["role"] == "assistant":
                    assert len(tok.encode(m["content"], add_special_tokens=False)) < cfg.agent.max_new_tokens
            assert sum(m["role"] == "assistant" for m in msgs) <= cfg.agent.max_turns
    assert longest <= min(cfg.agent.max_context_tokens, cfg.train.max_length)


def test_rewards_check_reference_is_1_and_corrupted_0():
    res = check("search_agent", n=40, progress=False)
    assert res["n"] == 40 and res["reference_mean"] == 1.0 and res["corrupted_mean"] == 0.0
    assert res["none"] == {"reference": 0, "corrupted": 0}


def test_pretrain_rows_teach_the_format_not_the_task():
    pre = data.pretrain_rows(30, seed=0)
    assert pre.to_list() == data.pretrain_rows(30, seed=0).to_list()
    assert set(pre["domain"]) == {"pretrain"} and len(pre) == 30
    systems = set()
    for p, c in zip(pre["prompt"], pre["completion"]):
        assert [m["role"] for m in p] == ["system", "user"] and len(c) == 1
        systems.add(p[0]["content"])
        start = re.search(r'"([^"]+)"', p[1]["content"]).group(1)
        assert start in c[0]["content"]   # a search for the name in the question, in some harness's syntax
        assert any(t in c[0]["content"] for t in ("search", "query"))
    assert len(systems) == len(MIX.harnesses)


# ----------------------------------------------------------------------------- registry and training

def test_registry_knows_the_domain():
    assert "search_agent" in registry.all_domains()
    assert registry.is_agent_domain("search_agent") and registry.domain_trainer("search_agent") is T
    d = registry.load_domain("search_agent")
    assert d.reward.__name__ == "reward_search_agent" and d.data is data
    assert registry.teacher_keys("search_agent") == [("search_agent", None)]
    for stage in ("sft", "rl"):
        cfg = load_config(ExpertConfig, registry.expert_recipe(registry.RECIPES, "search_agent", None, stage))
        assert cfg.domain == "search_agent" and cfg.stage == stage
        assert load_harnesses(cfg.agent.harnesses).held_out


def test_mopd_loads_the_domain_from_its_rl_recipe():
    """What the pipeline builds for MOPD and seq-KD (pipeline/stages/mopd.py's agent_domains):
    the env factory rewards.search_agent:make_env with the RL recipe's harnesses and budgets."""
    from types import SimpleNamespace

    from mopd.distill.agents import load_agents
    from mopd.distill.config import AgentDomainConfig

    a = load_config(ExpertConfig, REPO / "recipes" / "experts" / "search_agent" / "rl.yaml").agent
    spec = AgentDomainConfig(env="rewards.search_agent:make_env", harnesses=a.harnesses, max_turns=a.max_turns,
                             max_context_tokens=a.max_context_tokens, max_new_tokens=a.max_new_tokens)
    agents = load_agents(SimpleNamespace(agents={"search_agent": spec}, model=SimpleNamespace(path="a-text-student")),
                         load_tokenizer())
    dom = agents["search_agent"]
    assert {h.name for h in dom.mix.harnesses} == {h.name for h in MIX.harnesses}
    env = dom.factory(harness_cfg=dom.mix.harnesses[0], memory=dom.memory)
    task = data.make_tasks("train", 1, seed=0)[0]
    assert env.reset(json.loads(json.dumps(task))) == task["user"]


SMALL = ["train.max_steps=2", "data.n_train=6", "train.batch_size=2", "rl.num_generations=2", "agent.max_turns=2",
         "agent.max_new_tokens=8", "train.logging_steps=1", "data.difficulty=1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("search_expert") / "base", seed=0, max_position_embeddings=1536)


def _cfg(stage, model_dir, *extra):
    return load_config(ExpertConfig, REPO / "recipes" / "experts" / "search_agent" / f"{stage}.yaml",
                       [f"model.path={model_dir}", f"model.base={model_dir}", *SMALL, *extra])


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _changed(before, model):
    return [k for k, v in model.named_parameters() if not torch.equal(before[k], v.detach())]


@pytest.mark.usefixtures("one_torch_thread")
def test_sft_transcripts_and_two_sft_steps(model_dir, tmp_path):
    cfg = _cfg("sft", model_dir, "agent.perturb=0.5")
    domain = registry.load_domain("search_agent")
    model, tok = load_model(cfg)
    ds = build_dataset(cfg, domain, "train", cfg.data.n_train)
    rows = T.sft_transcripts(cfg, tok, ds)
    assert len(rows) >= len(ds)
    for p, c, m in rows:
        assert len(c) == len(m) and 0 < sum(m) < len(m)   # the student's tokens carry loss, observations not
    with pytest.raises(ValueError, match="max_length"):
        T.sft_transcripts(_cfg("sft", model_dir, "train.max_length=64"), tok, ds)
    before = _params(model)
    out = train(cfg, domain, model, tok, ds, tmp_path)   # experts/run.py dispatches to the domain's TRAINER
    assert _changed(before, model) and (out / "config.json").exists()
    assert not (tmp_path / "trainer").exists()          # TRL's SFTTrainer never ran


@pytest.mark.usefixtures("one_torch_thread")
def test_two_rl_steps_play_this_domains_episodes(model_dir, tmp_path, monkeypatch):
    cfg = _cfg("rl", model_dir)
    domain = registry.load_domain("search_agent")
    model, tok = load_model(cfg)
    ds = build_dataset(cfg, domain, "train", cfg.data.n_train)
    import core.agent.grpo as grpo

    played = []
    real = grpo.play_groups

    def graded(rollout, tokenizer, groups, **kw):
        """The real episodes (the RL loop's, core/agent/grpo.py); a random model never
        answers right, so every other one is graded 1."""
        done, rest, n = real(rollout, tokenizer, groups, **kw)
        runs = [r for g in done for r in g.runs]
        for i, r in enumerate(runs):
            r.ep.reward = float(i % 2)
        played.append(([r.env for r in runs], [g.task for g in done for _ in g.runs], [r.ep for r in runs]))
        return done, rest, n

    monkeypatch.setattr(grpo, "play_groups", graded)
    before = _params(model)
    train(cfg, domain, model, tok, ds, tmp_path)
    assert len(played) == 2 and _changed(before, model)
    envs, tasks, eps = played[0]
    assert len(eps) == cfg.train.batch_size * cfg.rl.num_generations
    assert all(type(e.backend).__name__ == "SearchBackend" for e in envs)
    assert all(1 <= e.turns <= 2 and e.segments for e in eps)
    assert all(t["user"] in tok.decode(e.segments[0].prompt_ids) for t, e in zip(tasks, eps))
