"""rewards/coding_agent.py: the coding environment and its reward. Tables of episodes
(the fix scores 1; no fix, edited or emptied visible tests, hostile modules score 0); the
oracle's precomputed test reports are what the sandbox really prints; a run the sandbox
stops ends that episode as failed; and 32 episodes at once, 4 of them hostile, where the
28 others score what they score alone and nothing is left behind."""
from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from experts.coding_agent import data as D
from core.agent.harness import ToolCall
from rewards import coding_agent as R
from rewards.sandbox import Limits
from rewards.workspace import WorkspaceLimits

FAST = WorkspaceLimits(sandbox=Limits(wall_s=3.0, cpu_s=3, memory_mb=1024, total_memory_mb=1536, nproc=16,
                                      fsize_mb=1, workspace_mb=8))
HIDDEN = Limits(wall_s=4.0, cpu_s=4, memory_mb=1024, total_memory_mb=1536)
H = "json_plain"


def _task(difficulty: int = 1, seed: int = 0) -> dict:
    return D.make_task(random.Random(f"test/{difficulty}/{seed}"), difficulty)


def _episode(task: dict, calls: list[ToolCall], harness: str = H) -> list[dict]:
    """The assistant messages of `calls` rendered through `harness` (what a model would write)."""
    h = R.make_env(R.harness_config(harness)).harness
    return [{"role": "assistant", "content": h.render([c])} for c in calls]


def _score(task, messages, **kw) -> float:
    return R.reward([None], [messages], task=[json.dumps(task)], harness=[H], **kw)[0]


def play(task: dict, calls: list[ToolCall], base_dir: Path) -> tuple[float, str | None]:
    """(reward, env_error) of an episode driven through the env, one call per turn."""
    env = R.make_env(R.harness_config(H), limits=FAST, hidden_limits=HIDDEN, base_dir=base_dir)
    try:
        env.reset(task)
        for c in calls:
            _obs, done, info = env.step(env.harness.render([c]))
            if done:
                return info["reward"], info.get("env_error")
        return 0.0, None
    finally:
        env.close()


# ----------------------------------------------------------------------------- the reward, by table
def test_reward_table_on_a_procedural_task():
    t = _task(3)
    fixed = {p: t["files"][p] for p in t["files"]}
    for e in t["oracle"]["edits"]:
        fixed[e["path"]] = fixed[e["path"]].replace(e["old"], e["new"])
    test = t["visible_tests"][0]
    oracle = D.oracle_calls(t)
    edits = [c for c in oracle if c.name == "replace"]
    write_all = [ToolCall("write_file", {"path": p, "content": fixed[p]}) for p in fixed if p != test]
    cases = [
        ("the oracle", oracle, 1.0),
        ("fixed by whole-file writes", write_all + [ToolCall("submit", {})], 1.0),
        ("fixed, visible tests emptied", edits + [ToolCall("write_file", {"path": test, "content": ""}),
                                                 ToolCall("submit", {})], 1.0),
        ("no fix", [ToolCall("submit", {})], 0.0),
        ("half the fix", edits[:1] + [ToolCall("submit", {})], 0.0),
        ("tests rewritten to pass", [ToolCall("write_file", {"path": test, "content": "def test_ok():\n    pass\n"}),
                                     ToolCall("run_tests", {}), ToolCall("submit", {})], 0.0),
        ("tests emptied", [ToolCall("write_file", {"path": test, "content": ""}), ToolCall("submit", {})], 0.0),
        ("fixed but never submitted", edits, 0.0),
    ]
    for name, calls, want in cases:
        assert _score(t, _episode(t, calls)) == want, name
    # a plain answer ends the episode and is judged like submit()
    assert _score(t, _episode(t, edits) + [{"role": "assistant", "content": "fixed"}]) == 1.0
    # a malformed call is an error observation; the episode goes on
    assert _score(t, [{"role": "assistant", "content": "```json\n{\"name\": \"replace\", \"arguments\": {\"path\": 3}}"
                                                       "\n```"}] + _episode(t, oracle)) == 1.0
    # calls after submit in the same message are refused, the verdict stands
    both = R.make_env(R.harness_config(H)).harness.render([ToolCall("submit", {})] + write_all)
    assert _score(t, [{"role": "assistant", "content": both}]) == 0.0


@pytest.mark.parametrize("module", [
    "print('2 passed')\n",
    "def check(candidate):\n    pass\n",
    "import sys\nsys.exit(0)\n",
    "import os\nos.write(3, b'0' * 32)\n",
    "import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n",
    "class Any:\n    def __eq__(self, o):\n        return True\n\ndef {f}(*a):\n    return Any()\n",
    "def {f}(*a):\n    raise SystemExit(0)\n",
    "import os\nos._exit(0)\n",
])
def test_hostile_modules_score_zero(module):
    t = _task(1, seed=7)
    path = t["oracle"]["edits"][0]["path"]
    name = next(line.split("(")[0][4:] for line in t["files"][path].splitlines() if line.startswith("def "))
    calls = [ToolCall("write_file", {"path": path, "content": module.replace("{f}", name)}), ToolCall("submit", {})]
    assert _score(t, _episode(t, calls)) == 0.0


def test_rows_of_other_domains_and_bad_rows():
    t = _task(1)
    out = R.reward([None, None], [_episode(t, D.oracle_calls(t))] * 2, task=[json.dumps(t)] * 2, harness=[H, H],
                   domain=["math", "coding_agent"])
    assert out == [None, 1.0]
    with pytest.raises(ValueError, match="needs the `task` column"):
        R.reward([None], ["x"])
    with pytest.raises(ValueError, match="bad task"):
        R.reward([None], ["x"], task=[json.dumps({"id": "t", "files": {}})])
    with pytest.raises(ValueError, match="visible test"):
        R.check_task({**t, "visible_tests": ["nope.py"]})
    with pytest.raises(ValueError, match="2 values of 'harness'"):
        R.reward([None], ["x"], task=[json.dumps(t)], harness=[H, H])
    assert R.reward([None], ["not a call at all"], task=[json.dumps(t)]) == [0.0]


# ----------------------------------------------------------------------------- oracle vs sandbox
def test_the_oracle_reports_are_what_the_sandbox_prints():
    for difficulty in sorted(D.DIFFICULTIES):
        t = _task(difficulty, seed=3)
        for harness in ("json_plain", "python_terse"):
            real = D.render_episode(t, D.oracle_calls(t), harness, backend=R.CodingBackend())
            assert real == D.oracle_messages(t, harness), (difficulty, harness)


@pytest.mark.parametrize("index", [0, 41, 109])
def test_humaneval_reference_passes_and_corruptions_fail(index):
    from experts.coding_agent.humaneval import humaneval_tasks

    t = humaneval_tasks()[index]
    assert _score(t, D.oracle_messages(t, H)[1:]) == 1.0
    for kind in D.CORRUPTIONS:
        assert _score(t, D.render_episode(t, D.corrupted_calls(t, kind), H)[1:]) == 0.0, kind


# ----------------------------------------------------------------------------- the env
def test_tools_through_the_env(tmp_path):
    t = _task(1)
    env = R.make_env(R.harness_config(H), base_dir=tmp_path)
    env.reset(t)
    ws = env.backend.ws
    for bad in ("../x.py", "/etc/passwd", "a/../../x"):
        obs, done, info = env.step(env.harness.render([ToolCall("read_file", {"path": bad})]))
        assert not done and info["failed_calls"] == 1 and obs.startswith("error:")
    obs, done, info = env.step(env.harness.render([ToolCall("write_file", {"path": "big.txt",
                                                                           "content": "x" * 9000})]))
    assert obs == "ok"
    obs, _, _ = env.step(env.harness.render([ToolCall("read_file", {"path": "big.txt"})]))
    assert "...(cut:" in obs and len(obs) < 4200
    obs, _, _ = env.step(env.harness.render([ToolCall("list_files", {})]))
    assert obs.splitlines() == sorted(["big.txt", *t["files"]])
    env.reset(_task(1, seed=1))   # a new task: the old workspace goes
    assert ws.closed and not ws.dir.exists()
    d = env.backend.ws.dir
    env.close()
    assert not d.exists()


def test_a_run_the_sandbox_stops_ends_the_episode_as_failed(tmp_path):
    t = _task(1)
    path = t["oracle"]["edits"][0]["path"]
    env = R.make_env(R.harness_config(H), limits=FAST, base_dir=tmp_path)
    env.reset(t)
    d = env.backend.ws.dir
    env.step(env.harness.render([ToolCall("write_file", {"path": path, "content": "while True:\n    pass\n"})]))
    obs, done, info = env.step(env.harness.render([ToolCall("run_tests", {})]))
    assert done and info["reward"] == 0.0 and not info["success"] and "timeout" in info["env_error"]
    assert not d.exists()
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("anything")


def test_quota_ends_the_episode(tmp_path):
    t = _task(1)
    env = R.make_env(R.harness_config(H), limits=WorkspaceLimits(max_files=3), base_dir=tmp_path)
    env.reset(t)
    obs, done, info = env.step(env.harness.render([ToolCall("write_file", {"path": "a.py", "content": ""})]))
    assert not done
    obs, done, info = env.step(env.harness.render([ToolCall("write_file", {"path": "b.py", "content": ""})]))
    assert done and info["reward"] == 0.0 and "QuotaExceeded" in info["env_error"]


# ----------------------------------------------------------------------------- isolation
HOSTILE = {
    "fork_flood": "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n",
    "six_gb": "x = bytearray(6 * 1024 ** 3)\n",
    "infinite_loop": "n = 0\nwhile True:\n    n += 1\n",
    "background_and_parent": (
        "import os, signal, threading, time\n"
        "for start in (lambda: __import__('subprocess').Popen(['sleep', '1000'], start_new_session=True),\n"
        "              lambda: os.kill(os.getppid(), signal.SIGKILL),\n"
        "              lambda: os.kill(-1, signal.SIGKILL)):\n"
        "    try:\n        start()\n    except Exception:\n        pass\n"
        "threading.Thread(target=time.sleep, args=(1000,)).start()\n"),
}


def _own_sandbox_processes() -> list[int]:
    """Processes started by this process's sandboxes (rewards/sandbox.py tags each run's
    environment with MOPD_SANDBOX_RUN=<host pid>-...)."""
    tag = f"MOPD_SANDBOX_RUN={os.getpid()}-".encode()
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


def test_32_episodes_at_once_4_hostile(tmp_path):
    tasks = D.make_tasks("test", 28, seed=5, difficulty=2)
    benign = []
    for i, t in enumerate(tasks):
        calls = D.oracle_calls(t) if i % 2 == 0 else D.corrupted_calls(t, D.CORRUPTIONS[i % 3])
        benign.append((t, calls))
    alone = [play(t, calls, tmp_path / "alone") for t, calls in benign]
    assert [r for r, _ in alone] == [1.0 if i % 2 == 0 else 0.0 for i in range(28)]
    hostile = []
    for k, (name, src) in enumerate(HOSTILE.items()):
        t = tasks[k]
        path = t["oracle"]["edits"][0]["path"]
        hostile.append((t, [ToolCall("write_file", {"path": path, "content": src}), ToolCall("run_tests", {}),
                            ToolCall("submit", {})]))
    episodes = benign[:7] + hostile[:1] + benign[7:14] + hostile[1:2] + benign[14:21] + hostile[2:3] + \
        benign[21:] + hostile[3:]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda e: play(e[0], e[1], tmp_path / "together"), episodes))
    hostile_at = {7, 15, 23, 31}
    others = [r for i, r in enumerate(together) if i not in hostile_at]
    assert others == alone
    for i in sorted(hostile_at):
        assert together[i][0] == 0.0
    killed = {name for name, i in zip(HOSTILE, sorted(hostile_at)) if together[i][1]}
    assert {"fork_flood", "infinite_loop", "background_and_parent"} <= killed   # stopped by the wall clock
    assert _own_sandbox_processes() == []
    for base in ("alone", "together"):
        assert not list((tmp_path / base).glob("mopd-ws-*/ep-*")), base


# ----------------------------------------------------------------------------- partial credit
def _hand_task(tests: str | None = None) -> dict:
    """f(x) should return x; the bug returns 0 from 3 on: two of the four hidden assertions pass."""
    return {"id": "hand-1", "family": "hand", "user": "Fix f, then submit.",
            "files": {"m.py": "def f(x):\n    return x if x < 3 else 0\n",
                      "test_m.py": "from m import f\n\n\ndef test_f():\n    assert f(4) == 4\n"},
            "visible_tests": ["test_m.py"],
            "hidden": {"test": tests or "def check(candidate):\n" + "".join(
                f"    assert candidate('m', 'f', {x}) == {x}\n" for x in (1, 2, 3, 4)),
                "entry_point": R.ENTRY_DISPATCH, "helper": ""}}


@pytest.mark.parametrize("name, calls, binary, fraction", [
    ("fixed", [ToolCall("replace", {"path": "m.py", "old": "x if x < 3 else 0", "new": "x"})], 1.0, 1.0),
    ("no fix", [], 0.0, 0.5),
    ("half fixed", [ToolCall("replace", {"path": "m.py", "old": "x < 3", "new": "x < 4"})], 0.0, 0.75),
    # the visible tests are replaced by fresh copies: editing or deleting them gains nothing
    ("visible tests rewritten", [ToolCall("write_file", {"path": "test_m.py", "content": "def test_ok():\n    pass\n"}),
                                 ToolCall("run_tests", {})], 0.0, 0.5),
    ("visible tests emptied", [ToolCall("write_file", {"path": "test_m.py", "content": ""})], 0.0, 0.5),
    ("module broken", [ToolCall("write_file", {"path": "m.py", "content": "def f(x:\n"})], 0.0, 0.0),
    ("f raises", [ToolCall("write_file", {"path": "m.py", "content": "def f(x):\n    raise ValueError(x)\n"})],
     0.0, 0.0),
])
def test_partial_credit_scores_the_share_of_hidden_assertions(name, calls, binary, fraction):
    t = _hand_task()
    msgs = _episode(t, calls + [ToolCall("submit", {})])
    assert _score(t, msgs) == binary, name
    assert _score(t, msgs, partial_credit="true") == pytest.approx(fraction), name   # reward_kwargs are strings
    assert _score(t, msgs, partial_credit=True) == pytest.approx(fraction), name


@pytest.mark.parametrize("module", [
    # forged counts: on stdout, and on the result channel the solution process has not got
    "import os\nprint('0' * 32 + ':4:0:0;')\ntry:\n    os.write(3, b'0' * 32 + b':4:0:0;')\nexcept OSError:\n"
    "    pass\n\ndef f(x):\n    return -1\n",
    "class Any:\n    def __eq__(self, o):\n        return True\n\ndef f(x):\n    return Any()\n",
    "def f(x):\n    raise SystemExit(0)\n",
    "import os\nos._exit(0)\n",
])
def test_partial_credit_cannot_be_forged(module):
    t = _hand_task()
    msgs = _episode(t, [ToolCall("write_file", {"path": "m.py", "content": module}), ToolCall("submit", {})])
    assert _score(t, msgs, partial_credit=True) == 0.0


def test_partial_credit_counts_asserts_in_loops_and_falls_back_without_asserts():
    looped = "def check(candidate):\n    for x in range(1, 9):\n        assert candidate('m', 'f', x) == x\n"
    t = _hand_task(looped)
    msgs = _episode(t, [ToolCall("submit", {})])
    assert _score(t, msgs, partial_credit=True) == pytest.approx(2 / 8)   # each iteration is an assertion
    # setup code that raises after two assertions: what never ran counts as failed
    early = ("def check(candidate):\n    assert candidate('m', 'f', 1) == 1\n    assert candidate('m', 'f', 2) == 2\n"
             "    raise KeyError('setup')\n    assert candidate('m', 'f', 3) == 3\n"
             "    assert candidate('m', 'f', 5) == 5\n")
    assert _score(_hand_task(early), msgs, partial_credit=True) == pytest.approx(2 / 4)
    # no assert statement: pass / fail only
    plain = "def check(candidate):\n    if candidate('m', 'f', 4) != 4:\n        raise AssertionError('no')\n"
    assert R.counted_check(plain, "s") is None
    assert _score(_hand_task(plain), msgs, partial_credit=True) == 0.0
    with pytest.raises(ValueError, match="partial_credit must be true or false"):
        _score(t, msgs, partial_credit="maybe")


def test_partial_credit_through_the_env(tmp_path):
    """make_env(partial_credit=...): the RL stage's episodes get the fraction as their reward."""
    t = _hand_task()
    calls = [ToolCall("replace", {"path": "m.py", "old": "x < 3", "new": "x < 4"}), ToolCall("submit", {})]
    for pc, want in ((False, 0.0), ("true", 0.75)):
        env = R.make_env(R.harness_config(H), limits=FAST, hidden_limits=HIDDEN, base_dir=tmp_path, partial_credit=pc)
        env.reset(t)
        info = {}
        for c in calls:
            _obs, done, info = env.step(env.harness.render([c]))
        assert done and info["reward"] == pytest.approx(want) and info["success"] is False
