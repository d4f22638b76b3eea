"""Data of the `search_agent` domain: multi-hop questions over a small corpus generated
from a seeded world, answered by calling search(query) and open(doc_id) (environment and
reward: rewards/search_agent.py).

The world of a task is a ladder of entity types, each with one attribute and one link to
the next type:

    person  --works at-->  company  --is based in-->  city  --is in-->  country
    color                  product                    river             language

Each entity has a document: its type, its attribute and its link first, in fixed
sentences, then filler sentences (a year, a pet, a count) that make `open` long:

    Ana Kell is a person. The color of Ana Kell is "red". Ana Kell works at "Brenco".
    Ana Kell was born in 1971. Ana Kell has a pet fish. Ana Kell likes chess.

A question at horizon H (difficulty, 1..4 hops) starts at an entity and asks the
attribute of the type H-1 rungs further up, in one template for every H:

    'What is the river for "Ana Kell"? Follow the links until a page gives it.'
    -> search("Ana Kell"), open("Ana Kell"), search("Brenco"), open("Brenco"),
       search("Tarvo"), open("Tarvo"), then "Mela"                                (H = 3)

so the stop is read off the documents (the first page that states the attribute asked),
never counted from the question; the agent domain's tiny models learned a loop that the
results end and not a list of steps to index into (docs/results/2026-12-01-agent-domain.md).
Next to the chain: distractor entities of every type (two or three each; person
distractors share the first or the last name of the chain's person, so a search has to
match the whole name), whose links lead only to other distractors, and news documents
that name several entities. The world is redrawn until BM25 ranks each chain entity's own
document first for a search of its name, so the oracle always opens the first hit.
Names and values are short and templated for the tiny tokenizer; values in the question
and the link sentences are in double quotes (the tokens a call copies).

Document ids are titles, as Wikipedia's are: an entity's page has its name as id, a news
page "News <n>". Why not opaque ids ("d82"): no tiny expert learned to copy them
(docs/results/2026-12-03-search-agent-title-ids.md). The price: a model that knows a title
can open it without searching (the oracle always searches first).

Task dicts (the `task` column, JSON) follow rewards/search_agent.py's format, plus the
world: `entities` ([{name, type, doc, value, link}]), `attribute`, `start`. Rows:
    prompt      [{"role": "user", "content": <the question>}]
    completion  the oracle's episode after it, through the harness named in `harness`
    domain      "search_agent"
    task        the task as JSON
    harness     the harness the completion is written in (the reward replays with it)

Splits: a task is `train` or `test` by a stable hash of its corpus and question; rows are
deterministic for (split, n, seed, difficulty).
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path
from typing import Callable

import datasets

from experts.agent_expert import AgentExpert
from experts.procedural import EpisodeTasks, episode_dataset
from core.agent.harness import HarnessConfig, ToolCall, as_harness_config
from rewards.search_agent import HARNESSES, harness_config, make_env, search_index

DOMAIN = "search_agent"
EFFORTS: tuple[str, ...] = ()
MULTI_TURN = True            # completions are whole episodes (experts/check.py scores them as message lists)
FAMILIES = ("ladder",)
HORIZONS = (1, 2, 3, 4)
MAX_HORIZON = 4
TEST_FRACTION = 0.1
N_FILLER = 3                 # filler sentences per entity document (what makes `open` long)

RUNGS = ("person", "company", "city", "country")
ATTRIBUTE = {"person": "color", "company": "product", "city": "river", "country": "language"}
LINK = {"person": "works at", "company": "is based in", "city": "is in"}

# ------------------------------------------------------------------------ value pools
FIRST = ("Ana Ben Cal Eli Fay Gus Jon Kim Leo Ned Pam Sam Tom Uma Max Liz Tim Amy Dan Lou Pat Rey Sue Ted Val "
         "Wes Yan Bo").split()
LAST = "Kell Dorr Moss Hart Reed Fox Lane Cole Park Wood Hill Ford Webb Page Nash Lowe Pike Rand Shaw Vale".split()
NAMES = {
    "company": "Acme Boltex Cardo Dynex Elco Fintra Gemco Helix Ionix Jetco Kovo Lumo Maxo Novo Orbo Pixo Radix "
               "Sumo Tekno Vexo Wizco Yoto Zenco".split(),
    "city": "Tarvo Lenby Marro Oslin Pella Rivo Sano Tulva Ulmo Varna Wexby Yarro Zelo Brin Coro Dalby Erno "
            "Fenby Galo Hanby".split(),
    "country": "Ostria Belmar Corvia Delmora Estal Fenland Gallia Hestor Ivoria Jorvik Kestria Lumora Morvia "
               "Norland Orvia Pellar".split(),
}
VALUES = {
    "color": "red blue green gold gray pink teal white black brown orange purple".split(),
    "product": "lamps cars tea shoes bikes hats books phones maps soap clocks toys".split(),
    "river": "Mela Rhun Tana Volo Arna Esk Lune Oder Pava Sava Idra Olt".split(),
    "language": "Vell Orric Tamic Lurish Sorn Kessan Mirth Pallan Doric Ennish".split(),
}
# Filler: facts nobody asks about, drawn from pools disjoint from VALUES.
PETS = "cat dog fish bird horse rabbit".split()
HOBBIES = "chess music tennis cooking painting running".split()
FILLERS = {
    "person": ("{n} was born in {year}.", "{n} has a pet {pet}.", "{n} likes {hobby}."),
    "company": ("{n} was founded in {year}.", "{n} has {k} workers.", "{n} sells in {k2} shops."),
    "city": ("{n} was built in {year}.", "{n} has {k} parks.", "{n} has {k2} bridges."),
    "country": ("{n} was founded in {year}.", "{n} has {k} cities.", "{n} has {k2} lakes."),
}
QUESTION = 'What is the {attr} for "{name}"? Follow the links until a page gives it.'
MAX_DRAWS = 200   # worlds redrawn at most this often for one task (BM25 must rank the chain's pages first)


def _doc_text(e: dict, rng: random.Random) -> str:
    n, t = e["name"], e["type"]
    parts = [f"{n} is a {t}.", f'The {ATTRIBUTE[t]} of {n} is "{e["value"]}".']
    if e["link"] is not None:
        parts.append(f'{n} {LINK[t]} "{e["link"]}".')
    fill = dict(n=n, year=rng.randint(1900, 1999), pet=rng.choice(PETS), hobby=rng.choice(HOBBIES),
                k=rng.randint(2, 90), k2=rng.randint(2, 90))
    parts += [s.format(**fill) for s in FILLERS[t][:N_FILLER]]
    return " ".join(parts)


def _person_names(rng: random.Random, n: int) -> list[str]:
    """n distinct "First Last" names; the later ones share the first or the last name of
    the first one (so a search must match the whole name to find it)."""
    first, last = rng.choice(FIRST), rng.choice(LAST)
    out = [f"{first} {last}"]
    while len(out) < n:
        f = first if len(out) == 1 else rng.choice(FIRST)
        ln = last if len(out) == 2 else rng.choice(LAST)
        name = f"{f} {ln}"
        if name not in out:
            out.append(name)
    return out


def _draw_world(rng: random.Random, horizon: int) -> dict:
    """One world and question at `horizon` (not yet checked against BM25)."""
    start = rng.randrange(0, len(RUNGS) - horizon + 1)
    chain_types = RUNGS[start:start + horizon]
    entities: dict[str, list[dict]] = {}
    for t in RUNGS:
        n = 1 + rng.randint(2, 3)                  # entity 0 is the chain's (used when t is on the chain)
        names = _person_names(rng, n) if t == "person" else rng.sample(NAMES[t], n)
        values = rng.sample(VALUES[ATTRIBUTE[t]], n)
        entities[t] = [{"name": nm, "type": t, "value": v, "chain": False} for nm, v in zip(names, values)]
    for t in chain_types:
        entities[t][0]["chain"] = True
    for i, t in enumerate(RUNGS):
        nxt = RUNGS[i + 1] if i + 1 < len(RUNGS) else None
        for e in entities[t]:
            # chain -> chain while the chain goes on; every other link -> a distractor, so a
            # wrong page never leads back onto the chain (the corrupted episodes rely on it)
            if nxt is None:
                e["link"] = None
            elif e["chain"] and entities[nxt][0]["chain"]:
                e["link"] = entities[nxt][0]["name"]
            else:
                e["link"] = rng.choice(entities[nxt][1:])["name"]
    flat = [e for t in RUNGS for e in entities[t]]
    ids = rng.sample(range(10, 100), len(flat) + 2)
    docs = []
    for e in flat:   # `ids` still drawn (for the news pages), so every world is the one drawn before titles were ids
        e["doc"] = e["name"]
        docs.append({"id": e["doc"], "title": e["name"], "text": _doc_text(e, rng)})
    for i in ids[len(flat):]:   # news: several names, no attribute, competes for name searches
        a, b, c = rng.sample(flat, 3)
        docs.append({"id": f"News {i}", "title": "News", "text": f"News about {a['name']} and {b['name']}. "
                     f"They met in {rng.randint(1900, 1999)}. They talked about {c['name']}."})
    rng.shuffle(docs)
    chain = [next(e for e in flat if e["type"] == t and e["chain"]) for t in chain_types]
    attr = ATTRIBUTE[chain_types[-1]]
    return {"entities": [{k: e[k] for k in ("name", "type", "doc", "value", "link", "chain")} for e in flat],
            "docs": docs, "chain": chain, "attribute": attr, "answer": chain[-1]["value"],
            "user": QUESTION.format(attr=attr, name=chain[0]["name"])}


def _first_hit_is_own(world: dict) -> bool:
    """BM25 ranks each chain entity's page strictly first for a search of its name."""
    idx = search_index(world["docs"])
    for e in world["chain"]:
        hits = idx.search(e["name"], k=2)
        if not hits or hits[0][0]["id"] != e["doc"] or (len(hits) > 1 and hits[1][1] >= hits[0][1]):
            return False
    return True


def _digest(body: dict) -> str:
    key = json.dumps([body["docs"], body["user"]], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def _split_of(digest: str) -> str:
    return "test" if int(digest[:8], 16) % 1000 < TEST_FRACTION * 1000 else "train"


def _call(name: str, **args) -> dict:
    return {"name": name, "args": args}


def make_task(family: str, rng: random.Random, horizon: int) -> dict:
    """One task of `family` at `horizon` hops (rewards/search_agent.py's task format)."""
    if family not in FAMILIES:
        raise ValueError(f"search_agent: unknown family {family!r}; expected one of {FAMILIES}")
    for _ in range(MAX_DRAWS):
        w = _draw_world(rng, horizon)
        if _first_hit_is_own(w):
            break
    else:
        raise RuntimeError(f"search_agent: no world in {MAX_DRAWS} draws where BM25 ranks the chain's pages first")
    gt = [c for e in w["chain"] for c in (_call("search", query=e["name"]), _call("open", doc_id=e["doc"]))]
    return {"id": f"{family}-h{horizon}-{_digest(w)[:12]}", "family": family, "horizon": horizon,
            "docs": w["docs"], "user": w["user"], "answer": w["answer"], "tools": ["search", "open"],
            "ground_truth": gt, "attribute": w["attribute"], "start": w["chain"][0]["name"],
            "entities": w["entities"]}


# every task new: a split with fewer distinct tasks than n is an error
TASKS = EpisodeTasks(DOMAIN, make_task, _split_of, FAMILIES, MAX_HORIZON, "the number of hops", repeats=False)


def make_tasks(split: str, n: int, seed: int = 0, difficulty: int = 2, families=FAMILIES,
               stream: str = "tasks") -> list[dict]:
    """n distinct tasks of `split` at `difficulty` hops, the families in turn."""
    return TASKS.draw(split, n, seed, difficulty, families, stream)


# ------------------------------------------------------------------------ oracle episodes

def _wrong_call(task: dict, call: dict) -> ToolCall:
    """A plausible call that fails and changes nothing: a near-miss title that is no page
    (a person's first name with another last name; another name of the same type), or a
    search without its query (the harness's error)."""
    if call["name"] == "open":
        used = {d["id"] for d in task["docs"]}
        name = call["args"]["doc_id"]
        first = name.split()[0]
        pool = [f"{first} {ln}" for ln in LAST] if len(name.split()) == 2 else \
            [n for t in ("company", "city", "country") if name in NAMES[t] for n in NAMES[t]]
        missing = next(n for n in pool + [f"{name} {k}" for k in range(2, 99)] if n not in used)
        return ToolCall("open", {"doc_id": missing})
    return ToolCall("search", {})


def play_calls(task: dict | str, calls: list[dict], final: str, harness_cfg=None, harnesses=None,
               inject: int | None = None) -> list[dict]:
    """An episode as chat messages, run through the real env with `harness_cfg`: the user
    message, per call an assistant message (the call as the harness renders it) and its
    observation, then `final` (the answer). `inject`: a wrong call (its error observation)
    goes before the call with that index."""
    task = json.loads(task) if isinstance(task, str) else task
    cfg = as_harness_config(harness_cfg, harnesses or HARNESSES)
    env = make_env(cfg)
    messages = [{"role": "user", "content": env.reset(task)}]
    for k, c in enumerate(calls):
        if k == inject:
            text = env.harness.render([_wrong_call(task, c)])
            obs, done, info = env.step(text)
            if done or not info["failed_calls"]:
                raise RuntimeError(f"search_agent: the injected wrong call of {task['id']} did not fail")
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": obs}]
        text = env.harness.render([ToolCall(c["name"], copy.deepcopy(c["args"]))])
        obs, done, info = env.step(text)
        if done or info["failed_calls"]:
            raise RuntimeError(f"search_agent: call {k} of an episode of {task['id']} failed: {obs[:200]}")
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": obs}]
    _obs, done, _info = env.step(final)
    if not done:
        raise RuntimeError(f"search_agent: the final message of {task['id']} did not end the episode")
    messages.append({"role": "assistant", "content": final})
    return messages


def oracle_messages(task: dict | str, harness_cfg=None, perturb: bool = False, rng: random.Random | None = None,
                    harnesses=None) -> list[dict]:
    """The oracle's episode (search and open each page of the chain, then the answer) as
    chat messages through `harness_cfg` (a HarnessConfig, a harness name, a dict entry, or
    None: the first train harness). `perturb`: one wrong call (an unknown document id or a
    search without its query) and its error observation before a random call (`rng`)."""
    task = json.loads(task) if isinstance(task, str) else task
    gt = task["ground_truth"]
    inject = (rng or random.Random(0)).randrange(len(gt)) if perturb else None
    return play_calls(task, gt, task["answer"], harness_cfg, harnesses, inject=inject)


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 2, effort: str | None = None, *,
                 families=FAMILIES, harness: str | None = None, harnesses: str | Path | None = None
                 ) -> datasets.Dataset:
    """Procedural search tasks at `difficulty` hops (1..4). Columns: prompt (the question),
    completion (the oracle's episode through `harness`, default the first train harness of
    `harnesses`), domain, task (JSON), harness (its name)."""
    TASKS.check(split, n, difficulty, effort, tuple(families))
    cfg = harness_config(harness, harnesses)
    tasks = make_tasks(split, n, seed, difficulty, families)
    return episode_dataset(DOMAIN, tasks, [cfg] * len(tasks), oracle_messages)


DATASETS: dict[str, Callable[[], datasets.Dataset]] = {}


# ------------------------------------------------------------------------ corrupt / pretrain

def wrong_turn_calls(task: dict, hop: int, rng: random.Random) -> tuple[list[dict], str]:
    """(calls, answer) of an episode that goes right up to `hop`, then opens a distractor
    page of the same type instead of the chain's, follows that page's links to the type
    asked and answers its attribute: the plausible way to get it wrong. Distractors link
    only to distractors, so the answer is another entity's value, never the reference."""
    ents = {e["name"]: e for e in task["entities"]}
    chain = [ents[c["args"]["query"]] for c in task["ground_truth"] if c["name"] == "search"]
    calls = [c for c in task["ground_truth"][: 2 * hop]]
    wrong = rng.choice([e for e in task["entities"] if e["type"] == chain[hop]["type"] and not e["chain"]])
    calls += [_call("search", query=chain[hop]["name"]), _call("open", doc_id=wrong["doc"])]
    e = wrong
    while e["type"] != chain[-1]["type"]:
        e = ents[e["link"]]
        calls += [_call("search", query=e["name"]), _call("open", doc_id=e["doc"])]
    return calls, e["value"]


def corrupt(row: dict, reference, rng: random.Random) -> list[dict]:
    """The reference episode gone wrong at a random hop (`wrong_turn_calls`), replayed through
    the env with the row's harness: must score 0 when the reward works."""
    task = json.loads(row["task"]) if isinstance(row["task"], str) else row["task"]
    calls, answer = wrong_turn_calls(task, rng.randrange(task["horizon"]), rng)
    return play_calls(task, calls, answer, row.get("harness"))[1:]


def pretrain_rows(n: int, seed: int = 0, harnesses: str | Path | None = None) -> datasets.Dataset:
    """Rows in the domain's format that do not solve it (domain="pretrain"), for the shared
    tiny base: a train harness's system prompt and a question (1 or 2 hops), answered with
    the oracle's first call only (a search for the name in the question), so the base learns
    the call syntaxes, the tool names and to copy a name from the question into a call; reading
    a page, following its link and knowing when to stop are the expert's to learn (why not
    near-miss calls: docs/results/2026-12-01-agent-domain.md)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"search_agent: n must be an int >= 0, got {n!r}")
    from core.agent.harness import load_harnesses

    mix = load_harnesses(str(harnesses or HARNESSES))
    rng = random.Random(f"mopd/{DOMAIN}/pretrain/{seed}")
    prompts, completions = [], []
    for _ in range(n):
        task = make_task(FAMILIES[0], rng, rng.choice((1, 2)))
        env = make_env(mix.sample(rng))
        user = env.reset(task)
        first = task["ground_truth"][0]
        prompts.append([env.messages[0], {"role": "user", "content": user}])
        completions.append([{"role": "assistant",
                             "content": env.harness.render([ToolCall(first["name"], dict(first["args"]))])}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n})


# ------------------------------------------------------------------------ the expert's training

def _episode_env(harness_cfg: HarnessConfig, task: dict, cfg=None):
    return make_env(harness_cfg)


# experts/run.py's SFT and RL stages for this domain
TRAINER = AgentExpert(_episode_env, oracle_messages, DOMAIN, draw_always=True)
