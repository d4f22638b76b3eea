"""Data of the `agent` domain: multi-turn tasks over BFCL's stateful simulators, solved by
calling tools turn after turn (environment and reward: rewards/agent.py).

Procedural families, each with a horizon H = the number of calls of the oracle's
solution, every call after the first needing a value an earlier call returned (the
values are random, so they cannot be guessed from the prompt):

    files     GorillaFileSystem, tools ls / cat / echo. A pointer chase: each file of the
              chain holds the name of the next one, the last holds a word; H-1 cats, then
              echo the word into answer.txt (which exists, empty). Distractor files hold
              other words. Checked on the final file system.
              'Follow the files from "ab.txt" and write the last text to answer.txt.'
    math      MathAPI, tools add / subtract / multiply. A loop that the results end: add a
              step until the result has three digits, or subtract one until it has one
              (start and step drawn so that it takes exactly H calls); the final assistant
              message states the result.
              "Start with 64. Add 9 until the result is over 99. Give the result."
              -> add(64, 9), add(73, 9), add(82, 9), add(91, 9), then "100"
    messages  MessageAPI, tools get_user_id / send_message. The ids of a user map are other
              users' names until the last, an id like U42: H-1 lookups, then send_message
              to that id. Checked on the final inbox.
              'Look up "Ana". While the id is a name, look it up. Send "hi" to the last id.'

A wrong call is a recoverable error: a file or user that does not exist is the simulator's
{"error": ...} result, a missing or wrongly typed argument is the harness's error; the
state is unchanged and the model may call again (`perturb` injects one of these). Names
and values are short for the tiny tokenizer (file names: 2-letter stem + ".txt", 4 tokens; words, names: 1-3 tokens).
Values in the task text are in double quotes: a name after a space tokenizes differently
(" l", "d") from the same name inside a call ('"', "ld"), and a tiny model copies tokens,
not characters.

Task dicts (the `task` column, JSON) follow rewards/agent.py's format; rows are
    prompt      [{"role": "user", "content": <the task's first user message>}]
    completion  the oracle's episode after that message (assistant / tool turns, then the
                final answer), rendered through the harness named in `harness`
    domain      "agent"
    task        the task as JSON
    harness     the harness the completion is written in (the reward replays with it)

`oracle_messages(task, harness_cfg, perturb=False, rng=None)` renders an oracle episode
through any harness (the agent SFT samples one per episode); `perturb` injects one wrong
call, its error observation, then the oracle's recovery.

BFCL (DATASETS["bfcl_multi_turn"], needs `bfcl-eval`): the 200 tasks of BFCL v4
multi_turn_base with their ground truth (possible_answer), several user turns each, on
BFCL's own tool docs (toolset "bfcl"); the reference is the ground truth rendered through
the harnesses in turn (every train and held-out harness, so every call syntax), replayed
by `mopd rewards check --domain agent --dataset bfcl_multi_turn`.

Splits: a task is `train` or `test` by a stable hash of its family, initial state and
user message; rows are deterministic for (split, n, seed, difficulty).
"""
from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import json
import random
from pathlib import Path
from typing import Callable

import datasets

from experts.agent_expert import AgentExpert
from experts.procedural import EpisodeTasks, episode_dataset
from core.agent.harness import HarnessConfig, ToolCall, as_harness_config
from rewards.agent import (HARNESSES, bfcl_data_dir, bfcl_tool_specs, harness_config, make_env, simulator_class,
                           task_turns)

DOMAIN = "agent"
EFFORTS: tuple[str, ...] = ()
MULTI_TURN = True            # completions are whole episodes (experts/check.py scores them as message lists)
FAMILIES = ("files", "math", "messages")
HORIZONS = (2, 4, 8, 16)     # the horizons the recipes and evals use; any 1..MAX_HORIZON works
MAX_HORIZON = 16
TEST_FRACTION = 0.1
FINAL_TEXT = "done"          # the oracle's closing message of a turn without an answer to state
BFCL_FINAL_TEXT = "Done."

FAMILY_TOOLS = {"files": ["ls", "cat", "echo"], "math": ["add", "subtract", "multiply"],
                "messages": ["get_user_id", "send_message"]}
FAMILY_CLASSES = {"files": ["GorillaFileSystem"], "math": ["MathAPI"], "messages": ["MessageAPI"]}

# ------------------------------------------------------------------------ value pools
# Two-letter stems that are one token of the tiny tokenizer ("ab.txt" is 4 tokens).
STEMS = ("ab ac ad af ag al am ap ar av ay bb br by cc ce ch ci ck cl co cs ct cy da db dd de di "
         "du ed ee el ep er es et ex ff ft ge gh gn gr ha he ic ig ik il im ip ir iv ix iz ke ks kw "
         "ld le lf ll lo lt ly").split()
WORDS = ("lime plum pear fig lemon apple grape red green gold gray sand snow rain wind moon star sun "
         "salt corn rice milk tea jam").split()
NAMES = ("Ana Ben Cal Eli Fay Gus Jon Kim Leo Ned Pam Sam Tom Uma Max Liz Tim Amy Dan Lou Mo Oz Pat "
         "Rey Sue Ted Val Wes Yan Bo").split()
MESSAGES = ("hi", "ok", "thanks", "see you", "on my way", "call me", "all good", "got it")
ANSWER_FILE = "answer.txt"


def _dir(files: dict[str, str]) -> dict:
    return {"root": {"w": {"type": "directory", "contents": {
        n: {"type": "file", "content": c} for n, c in files.items()}}}}


def _call(name: str, **args) -> dict:
    return {"name": name, "args": args}


def files_task(rng: random.Random, horizon: int) -> dict:
    n_chain = horizon - 1
    stems = rng.sample(STEMS, n_chain + rng.randint(2, 3))
    chain = [s + ".txt" for s in stems[:n_chain]]
    word = rng.choice(WORDS)
    files = {f: (chain[i + 1] if i + 1 < n_chain else word) for i, f in enumerate(chain)}
    for s in stems[n_chain:]:
        files[s + ".txt"] = rng.choice([w for w in WORDS if w != word])
    files[ANSWER_FILE] = ""
    names = list(files)
    rng.shuffle(names)
    user = (f'Write "{word}" to {ANSWER_FILE}.' if horizon == 1 else
            f'Follow the files from "{chain[0]}" and write the last text to {ANSWER_FILE}.')
    gt = [_call("cat", file_name=f) for f in chain] + [_call("echo", content=word, file_name=ANSWER_FILE)]
    return {"initial_config": {"GorillaFileSystem": _dir({n: files[n] for n in names})}, "user": user,
            "ground_truth": gt}


def math_task(rng: random.Random, horizon: int) -> dict:
    # A loop whose end the environment decides: add a step until the result has three
    # digits, or subtract one until it has one. Every call needs the last result, and the
    # stop is read off that result (its number of digits), not counted from the prompt
    # (why not a fixed list of operations: docs/results/2026-12-01-agent-domain.md).
    if rng.random() < 0.5:
        step = rng.randint(2, max(2, min(12, 98 // max(1, horizon - 1))))
        x0 = rng.randint(max(1, 100 - horizon * step), 99 - (horizon - 1) * step)
        op, sign, cond = "add", 1, "is over 99"
    else:
        step = rng.randint(2, max(2, min(9, 89 // horizon)))
        x0 = rng.randint(10 + (horizon - 1) * step, min(99, 9 + horizon * step))
        op, sign, cond = "subtract", -1, "is below 10"
    gt, x = [], x0
    for _ in range(horizon):
        gt.append(_call(op, a=x, b=step))
        x += sign * step
    return {"initial_config": {}, "ground_truth": gt, "answer": str(x),
            "user": f"Start with {x0}. {op.capitalize()} {step} until the result {cond}. Give the result."}


def messages_task(rng: random.Random, horizon: int) -> dict:
    n_chain = horizon - 1
    names = rng.sample(NAMES, n_chain + rng.randint(2, 3))
    chain = names[:n_chain]
    ids = rng.sample(range(10, 100), len(names) - n_chain + 1)
    final = f"U{ids[0]}"
    user_map = {n: (chain[i + 1] if i + 1 < n_chain else final) for i, n in enumerate(chain)}
    for n, i in zip(names[n_chain:], ids[1:]):
        user_map[n] = f"U{i}"
    keys = list(user_map)
    rng.shuffle(keys)
    msg = rng.choice(MESSAGES)
    config = {"user_map": {k: user_map[k] for k in keys}, "user_count": len(keys), "inbox": [],
              "message_count": 0, "current_user": "U00", "random_seed": rng.randint(1, 10**6)}
    user = (f'Send "{msg}" to "{final}".' if horizon == 1 else
            f'Look up "{chain[0]}". While the id is a name, look it up. Send "{msg}" to the last id.')
    gt = [_call("get_user_id", user=n) for n in chain] + [_call("send_message", receiver_id=final, message=msg)]
    return {"initial_config": {"MessageAPI": config}, "user": user, "ground_truth": gt}


MAKERS: dict[str, Callable[[random.Random, int], dict]] = {
    "files": files_task, "math": math_task, "messages": messages_task}


def _digest(family: str, body: dict) -> str:
    key = json.dumps([family, body["initial_config"], body["user"]], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def _split_of(digest: str) -> str:
    return "test" if int(digest[:8], 16) % 1000 < TEST_FRACTION * 1000 else "train"


def make_task(family: str, rng: random.Random, horizon: int) -> dict:
    """One procedural task of `family` at `horizon` (rewards/agent.py's task format)."""
    body = MAKERS[family](rng, horizon)
    d = _digest(family, body)
    return {"id": f"{family}-h{horizon}-{d[:12]}", "family": family, "toolset": "procedural", "horizon": horizon,
            "initial_config": body["initial_config"], "involved_classes": list(FAMILY_CLASSES[family]),
            "tools": list(FAMILY_TOOLS[family]), "user": body["user"], "ground_truth": body["ground_truth"],
            **({"answer": body["answer"]} if "answer" in body else {})}


# a split with fewer distinct tasks than n repeats some
TASKS = EpisodeTasks(DOMAIN, make_task, _split_of, FAMILIES, MAX_HORIZON,
                     f"the horizon (calls per task; the recipes use {HORIZONS})", repeats=True)


def make_tasks(split: str, n: int, seed: int = 0, difficulty: int = 2, families=FAMILIES,
               stream: str = "tasks") -> list[dict]:
    """n distinct tasks of `split` at horizon `difficulty`, the families in turn."""
    return TASKS.draw(split, n, seed, difficulty, families, stream)


# ------------------------------------------------------------------------ oracle episodes

def _wrong_call(task: dict, call: dict, rng: random.Random) -> ToolCall:
    """A plausible call that fails (a file or user that does not exist, a forgotten
    argument) and changes nothing."""
    family = task.get("family")
    if family == "files":
        files = task["initial_config"]["GorillaFileSystem"]["root"]["w"]["contents"]
        return ToolCall("cat", {"file_name": rng.choice([s for s in STEMS if s + ".txt" not in files]) + ".txt"})
    if family == "messages":
        known = task["initial_config"]["MessageAPI"]["user_map"]
        return ToolCall("get_user_id", {"user": rng.choice([n for n in NAMES if n not in known])})
    if family == "math":
        return ToolCall(call["name"], {"a": call["args"]["a"]})   # "b" forgotten: the harness's error
    raise ValueError(f"agent: perturb is for the procedural families {FAMILIES}, not {family!r}")


def final_text(task: dict, turn: int) -> str:
    """The oracle's closing message of a turn: the answer on the last turn of a task that
    has one, else FINAL_TEXT (BFCL_FINAL_TEXT for BFCL tasks)."""
    users, _gt = task_turns(task)
    if task.get("answer") is not None and turn == len(users) - 1:
        return str(task["answer"])
    return BFCL_FINAL_TEXT if task.get("toolset") == "bfcl" else FINAL_TEXT


def oracle_messages(task: dict | str, harness_cfg=None, perturb: bool = False, rng: random.Random | None = None,
                    drop: int | None = None, harnesses=None) -> list[dict]:
    """The oracle's episode as chat messages, run through the real env with `harness_cfg`
    (a HarnessConfig, a harness name, a dict entry, or None: the first train harness): the
    first user message, then per ground-truth call an assistant message (the call as the
    harness renders it) and its observation, the turn's closing assistant message, the next
    user message, ..., ending with the final assistant answer. `perturb`: one wrong call
    (its error observation) is injected before a random call (`rng`). `drop`: the
    ground-truth call with that index (over all turns) is left out (a corrupted reference)."""
    task = json.loads(task) if isinstance(task, str) else task
    cfg = as_harness_config(harness_cfg, harnesses or HARNESSES)
    env = make_env(cfg, toolset=task.get("toolset", "procedural"))
    users, turns = task_turns(task)
    n_calls = sum(len(t) for t in turns)
    rng = rng or random.Random(0)
    inject = rng.randrange(n_calls) if perturb and n_calls else None
    messages = [{"role": "user", "content": env.reset(task)}]
    done, k = False, 0

    def step(text: str) -> dict:
        nonlocal done
        obs, done, info = env.step(text)
        messages.append({"role": "assistant", "content": text})
        if not done:
            messages.append({"role": info["obs_role"], "content": obs})
        return info

    for ti, calls in enumerate(turns):
        for c in calls:
            if k == inject:
                info = step(env.harness.render([_wrong_call(task, c, rng)]))
                if not info["failed_calls"]:
                    raise RuntimeError(f"agent: the injected wrong call of {task['id']} did not fail")
            if k != drop:
                step(env.harness.render([ToolCall(c["name"], copy.deepcopy(c.get("args", {})))]))
            k += 1
        step(final_text(task, ti))
        if done != (ti == len(turns) - 1):
            raise RuntimeError(f"agent: the oracle episode of {task['id']} ended at turn {ti} of {len(turns)}")
    return messages


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 2, effort: str | None = None, *,
                 families=FAMILIES, harness: str | None = None, harnesses: str | Path | None = None
                 ) -> datasets.Dataset:
    """Procedural agent tasks at horizon `difficulty` (1..16; 2, 4, 8, 16 in the recipes),
    the families in turn. Columns: prompt (the first user message), completion (the oracle's
    episode through `harness`, default the first train harness of `harnesses`), domain,
    task (JSON), harness (its name)."""
    TASKS.check(split, n, difficulty, effort, tuple(families))
    cfg = harness_config(harness, harnesses)
    tasks = make_tasks(split, n, seed, difficulty, families)
    return episode_dataset(DOMAIN, tasks, [cfg] * len(tasks), oracle_messages)


# ------------------------------------------------------------------------ BFCL multi-turn

def _bfcl_call(text: str, classes: list[str]) -> dict:
    """One ground-truth call string of BFCL ("cd(folder='x')", "sort('a.pdf')") as a call
    dict, positional arguments named from the method's signature; parsed, never evaluated."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"BFCL ground truth {text!r} is not a plain call")
    name = node.func.id
    owner = next((c for c in classes if name in bfcl_tool_specs(c)), None)
    if owner is None:
        raise ValueError(f"BFCL ground truth {text!r}: no involved class documents {name!r}")
    params = [p for p in inspect.signature(getattr(simulator_class(owner), name)).parameters if p != "self"]
    if len(node.args) > len(params):
        raise ValueError(f"BFCL ground truth {text!r}: too many positional arguments")
    args = {p: ast.literal_eval(a) for p, a in zip(params, node.args)}
    for kw in node.keywords:
        args[kw.arg] = ast.literal_eval(kw.value)
    return {"name": name, "args": json.loads(json.dumps(args))}   # tuples -> lists, as a parser gives


def bfcl_task(entry: dict, ground_truth: list[list[str]]) -> dict:
    """A BFCL multi-turn entry and its ground truth as a task dict (toolset "bfcl")."""
    classes = list(entry["involved_classes"])
    excluded = set(entry.get("excluded_function") or [])
    tools = [t for c in classes for t in bfcl_tool_specs(c) if t not in excluded]
    users = ["\n".join(m["content"] for m in turn if m.get("role") == "user") for turn in entry["question"]]
    gt = [[_bfcl_call(s, classes) for s in turn] for turn in ground_truth]
    return {"id": entry["id"], "family": "bfcl", "toolset": "bfcl", "horizon": sum(len(t) for t in gt),
            "initial_config": entry.get("initial_config") or {}, "involved_classes": classes, "tools": tools,
            "user": users, "ground_truth": gt}


def bfcl_tasks() -> list[dict]:
    """The 200 tasks of BFCL v4 multi_turn_base, with their ground truth."""
    data = bfcl_data_dir()
    name = "BFCL_v4_multi_turn_base.json"

    def lines(p: Path) -> list[dict]:
        return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]

    answers = {a["id"]: a["ground_truth"] for a in lines(data / "possible_answer" / name)}
    return [bfcl_task(q, answers[q["id"]]) for q in lines(data / name) if q["id"] in answers]


def load_bfcl_multi_turn(harnesses: str | Path | None = None) -> datasets.Dataset:
    """BFCL's multi-turn base tasks as rows, each reference rendered through the next harness
    of the mix (train and held-out in turn, so every call syntax is replayed)."""
    from core.agent.harness import load_harnesses

    mix = load_harnesses(str(harnesses or HARNESSES))
    cfgs = mix.harnesses + mix.held_out
    tasks = bfcl_tasks()
    return episode_dataset(DOMAIN, tasks, [cfgs[i % len(cfgs)] for i in range(len(tasks))], oracle_messages)


DATASETS: dict[str, Callable[[], datasets.Dataset]] = {"bfcl_multi_turn": load_bfcl_multi_turn}

# BFCL tasks whose ground truth the env cannot replay, kept (they score 0): in
# multi_turn_base_173 the last turn's call close_ticket(ticket_id='ticket_001') passes a
# string where the doc says integer; the harness refuses it, and BFCL's check needs that
# call's (error) result among the model's.
BFCL_UNSATISFIABLE = ("multi_turn_base_173",)

# `mopd rewards check` also scores with bfcl's own multi_turn_checker (experts/check.py).
CHECK_VARIANTS = {"bfcl_checker": {"checker": "bfcl"}}


# ------------------------------------------------------------------------ corrupt / pretrain

def corrupt(row: dict, reference, rng: random.Random) -> list[dict]:
    """The reference episode with one ground-truth call (drawn with `rng`) left out, run
    through the env again (later calls may now fail): must score 0 when the reward works."""
    task = json.loads(row["task"]) if isinstance(row["task"], str) else row["task"]
    n = sum(len(t) for t in task_turns(task)[1])
    return oracle_messages(task, row.get("harness"), drop=rng.randrange(n))[1:]


def pretrain_rows(n: int, seed: int = 0, harnesses: str | Path | None = None) -> datasets.Dataset:
    """Rows in the domain's format that do not solve it (domain="pretrain"), for the shared
    tiny base: a train harness's system prompt and a task (horizon 1, 2 or 4), answered with
    the oracle's first call only, so the base learns the call syntaxes, the tool names and
    to copy a value from the task into a call, not the tasks: reading a result and using it
    in the next call, and knowing when to stop, are the expert's to learn (why not near-miss
    calls on values from nowhere: docs/results/2026-12-01-agent-domain.md)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"agent: n must be an int >= 0, got {n!r}")
    from core.agent.harness import load_harnesses

    mix = load_harnesses(str(harnesses or HARNESSES))
    rng = random.Random(f"mopd/{DOMAIN}/pretrain/{seed}")
    prompts, completions = [], []
    for i in range(n):
        task = make_task(FAMILIES[i % len(FAMILIES)], rng, rng.choice((1, 2, 4)))
        env = make_env(mix.sample(rng))
        user = env.reset(task)
        system = env.messages[0]
        prompts.append([system, {"role": "user", "content": user}])
        first = task["ground_truth"][0]
        completions.append([{"role": "assistant", "content": env.harness.render([ToolCall(first["name"],
                                                                                         dict(first["args"]))])}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n})


# ------------------------------------------------------------------------ the expert's training

def _episode_env(harness_cfg: HarnessConfig, task: dict, cfg=None):
    return make_env(harness_cfg, toolset=task.get("toolset", "procedural"))   # BFCL tasks use BFCL's tool docs


# experts/run.py's SFT and RL stages for this domain
TRAINER = AgentExpert(_episode_env, oracle_messages, DOMAIN, draw_always=True)
