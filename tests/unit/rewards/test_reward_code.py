"""rewards/code.py: HumanEval-style tests run in the sandbox; tables of honest, wrong and
adversarial completions; HumanEval's canonical solutions all score 1."""
from __future__ import annotations

import random

import pytest

from rewards.code import build_program, prompt_code_of, reward

TEST = """def check(candidate):
    assert candidate(1) == 8
    assert candidate(-7) == 0
    assert candidate(10) == 17
"""
PROMPT = [{"role": "user", "content": "Write a Python function add_k(x) that returns x plus 7."}]
FAST = {"timeout_s": 2.0, "wall_timeout_s": 3.0}


def score(completion, *, test=TEST, entry="add_k", prompt=PROMPT, prompt_code="", **kw):
    cols = {"test": [test], "entry_point": [entry], "domain": ["code"]}
    if prompt_code is not None:
        cols["prompt_code"] = [prompt_code]
    return reward([prompt], [completion], **cols, **{**FAST, **kw})[0]


HONEST = {
    "fenced": "```python\ndef add_k(x):\n    return x + 7\n```",
    "fenced_py_with_prose": "Here you go:\n```py\ndef add_k(x):\n    return x + 7\n```\nIt adds seven.",
    "plain_def": "def add_k(x):\n    return x + 7\n",
    "fence_never_closed": "```python\ndef add_k(x):\n    return x + 7\n",
    "two_blocks_second_defines": "```python\nimport math\n```\n```python\ndef add_k(x):\n    return x + 7\n```",
    "helper_and_main_guard": ("```python\ndef _seven():\n    return 7\n\ndef add_k(x):\n    return x + _seven()\n\n"
                              "if __name__ == '__main__':\n    while True:\n        pass\n```"),
    "chat_messages": [{"role": "assistant", "content": "```python\ndef add_k(x):\n    return 7 + x\n```"}],
    "prints_too": "```python\ndef add_k(x):\n    print('computing', x)\n    return x + 7\n```",
}

WRONG = {
    "empty": "",
    "whitespace": "   \n\t",
    "wrong_constant": "```python\ndef add_k(x):\n    return x + 8\n```",
    "wrong_name": "```python\ndef add_seven(x):\n    return x + 7\n```",
    "syntax_error": "```python\ndef add_k(x:\n    return x + 7\n```",
    "prose_only": "The answer is x + 7.",
    "huge": "```python\ndef add_k(x):\n    return x + 7\n" + "# pad\n" * 10_000 + "```",
    "nul_byte": "```python\ndef add_k(x):\n    return x + 7\x00\n```",
    "lone_surrogate": "```python\ndef add_k(x):\n    return x + 7 # \udc80\n```",
    "not_a_function": "```python\nadd_k = 15\n```",
    "raises": "```python\ndef add_k(x):\n    raise ValueError('no')\n```",
    "returns_string": "```python\ndef add_k(x):\n    return str(x + 7)\n```",
    "returns_float_close": "```python\ndef add_k(x):\n    return x + 7.0000001\n```",
    "infinite_loop": "```python\ndef add_k(x):\n    while True:\n        pass\n```",
    "import_hangs": "```python\nimport time\ntime.sleep(60)\ndef add_k(x):\n    return x + 7\n```",
    "memory_bomb": "```python\nx = bytearray(1 << 34)\ndef add_k(x):\n    return x + 7\n```",
    "recursion": "```python\ndef add_k(x):\n    return add_k(x)\n```",
    # reward hacks
    "prints_passed": "```python\nprint('PASSED')\nprint('ok')\nimport sys\nsys.exit(0)\n```",
    "prints_expected_outputs": "```python\nprint(8)\nprint(0)\nprint(17)\n```",
    "sys_exit_early": "```python\nimport sys\nsys.exit(0)\ndef add_k(x):\n    return x + 8\n```",
    "os_exit_early": "```python\nimport os\nos._exit(0)\n```",
    "os_exit_in_call": "```python\nimport os\ndef add_k(x):\n    os._exit(0)\n```",
    "sys_exit_in_call": "```python\nimport sys\ndef add_k(x):\n    sys.exit(0)\n```",
    "defines_check": ("```python\ndef check(candidate):\n    pass\n\ndef add_k(x):\n    return 0\n\n"
                      "check(add_k)\n```"),
    "always_equal": ("```python\nclass Eq:\n    def __eq__(self, other):\n        return True\n"
                     "    __hash__ = object.__hash__\n\ndef add_k(x):\n    return Eq()\n```"),
    "int_subclass_eq": ("```python\nclass I(int):\n    def __eq__(self, other):\n        return True\n"
                        "def add_k(x):\n    return I(0)\n```"),
    "monkeypatch_builtins": ("```python\nimport builtins\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
                             "builtins.isinstance = lambda *a: True\ndef add_k(x):\n    return 0\n```"),
    "disable_asserts": ("```python\nimport sys\nsys.flags = None\n__debug__ = False\n"
                        "def add_k(x):\n    return 0\n```"),
    "reads_harness_files": ("```python\nimport os\nsrc = ''.join(open(f).read() for f in os.listdir('.') "
                            "if os.path.isfile(f))\ndef add_k(x):\n    return 0 if 'assert' in src else -1\n```"),
    "reads_stdin_for_tests": ("```python\nimport sys\ndata = sys.stdin.read()\nimport os\n"
                              "try:\n    os.write(3, data.encode())\nexcept OSError:\n    pass\n"
                              "def add_k(x):\n    return 0\n```"),
    "kills_parent": ("```python\nimport os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\n"
                     "except Exception:\n    pass\ndef add_k(x):\n    return 0\n```"),
    "forks": "```python\nimport os\nos.fork()\ndef add_k(x):\n    return x + 7\n```",
    "writes_fd3": "```python\nimport os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'x' * 32)\n    except OSError:\n        pass\ndef add_k(x):\n    return 0\n```",
}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_completions_score_one(name):
    assert score(HONEST[name]) == 1.0


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_and_adversarial_completions_score_zero(name):
    assert score(WRONG[name]) == 0.0


def test_base_model_continuation_of_the_signature():
    sig = "def add_k(x):\n    \"\"\"Return x plus 7.\"\"\"\n"
    assert score("    return x + 7\n", prompt=sig, prompt_code=None) == 1.0      # prompt string is the code
    assert score("    return x + 7\n", prompt_code=sig) == 1.0                   # the prompt_code column
    chat = [{"role": "user", "content": f"Complete the following Python function.\n```python\n{sig}```"}]
    assert score("    return x + 7\n", prompt=chat, prompt_code=None) == 1.0     # fenced in the user message
    assert score("    return x + 6\n", prompt_code=sig) == 0.0
    assert score("return x + 7\n", prompt_code=sig) == 0.0                       # not indented: the stub returns None
    # a chat model that rewrites the whole function after such a prompt
    assert score("```python\ndef add_k(x):\n    return x + 7\n```", prompt=chat, prompt_code=None) == 1.0


def test_build_program_cases():
    sig = "from typing import List\n\ndef f(xs: List[int]) -> int:\n    \"\"\"doc\"\"\"\n"
    assert build_program("    return 1\n", sig, "f") == sig + "    return 1\n"
    fenced = build_program("```python\ndef f(xs: List[int]) -> int:\n    return 1\n```", sig, "f")
    assert fenced.startswith(sig) and fenced.endswith("return 1\n")   # the prompt's imports come first
    assert build_program("def f(xs):\n    return 1\n", "", "f") == "def f(xs):\n    return 1\n"
    assert prompt_code_of("def g():\n") == "def g():\n"
    assert prompt_code_of([{"role": "user", "content": "no code here"}]) == ""


def test_values_cross_the_process_boundary_exactly():
    ret = ("{'a': (1, [1.5, float('inf'), None, {1, 2}, frozenset({3})]), 2: b'\\x00\\xff', "
           "'c': 3j, 'big': 10 ** 40, 'neg': -0.0, 'u': 'h\\u00e9llo \\U0001F600', 'nested': [[[]]]}")
    test = f"""def check(candidate):
    r = candidate(0)
    assert r == {ret}
    assert type(r['a']) is tuple and type(r['a'][1][3]) is set and type(r[2]) is bytes
    nan = candidate(1)
    assert nan != nan
    assert candidate(2) is None and candidate(3) is True and type(candidate(4)) is float
"""
    code = f"""```python
def f(k):
    return [{ret}, float('nan'), None, True, 4.0][k]
```"""
    assert score(code, test=test, entry="f") == 1.0
    opaque = "```python\ndef f(k):\n    return (i for i in range(3))\n```"
    assert score(opaque, test="def check(c):\n    assert list(c(0)) == [0, 1, 2]\n", entry="f") == 0.0


def test_exceptions_and_kwargs_pass_through():
    test = """def check(candidate):
    try:
        candidate(-1)
    except ValueError:
        pass
    else:
        raise AssertionError('expected ValueError')
    assert candidate(2, scale=3) == 6
"""
    code = ("```python\ndef f(x, scale=1):\n    if x < 0:\n        raise ValueError('negative')\n"
            "    return x * scale\n```")
    assert score(code, test=test, entry="f") == 1.0


def test_domains_rows_and_bad_input():
    comps = [HONEST["fenced"], "anything", WRONG["wrong_constant"]]
    out = reward([PROMPT] * 3, comps, test=[TEST] * 3, entry_point=["add_k"] * 3,
                 domain=["code", "math", "code"], **FAST)
    assert out == [1.0, None, 0.0]
    # no domain column: every row is ours; completions of odd types never raise
    assert reward([PROMPT] * 3, [None, 42, {"content": 1}], test=[TEST] * 3, entry_point=["add_k"] * 3) == [0.0] * 3
    with pytest.raises(ValueError, match="test"):
        reward([PROMPT], [HONEST["fenced"]], entry_point=["add_k"], domain=["code"])
    with pytest.raises(ValueError, match="completions"):
        reward([PROMPT], [HONEST["fenced"]], test=[TEST, TEST], entry_point=["add_k"])
    assert reward([PROMPT], [HONEST["fenced"]], test=[None], entry_point=[None], domain=["math"]) == [None]


def test_many_rows_keep_their_order():
    rng = random.Random(0)
    ks = [rng.randint(2, 9) for _ in range(8)]
    tests = [f"def check(c):\n    assert c(1) == {1 + k}\n" for k in ks]
    comps = [f"```python\ndef f(x):\n    return x + {k if i % 2 == 0 else k + 1}\n```" for i, k in enumerate(ks)]
    out = reward([PROMPT] * 8, comps, test=tests, entry_point=["f"] * 8, domain=["code"] * 8, **FAST)
    assert out == [1.0 if i % 2 == 0 else 0.0 for i in range(8)]


def _humaneval_scores(rows):
    cols = {c: [r[c] for r in rows] for c in ("test", "entry_point", "prompt_code", "domain")}
    refs = [r["completion"] for r in rows]
    return reward([r["prompt"] for r in rows], refs, **cols)


def test_humaneval_canonical_solutions_fast_sample():
    from experts.code.data import load_humaneval

    ds = load_humaneval()
    rows = ds.select([0, 11, 32, 33, 38, 50, 53, 100, 129, 163]).to_list()  # incl. helper-using tests
    assert _humaneval_scores(rows) == [1.0] * len(rows)


@pytest.mark.slow
def test_humaneval_all_164_canonical_solutions_pass_and_corruptions_fail():
    from experts.code.data import corrupt, load_humaneval

    rows = load_humaneval().to_list()
    assert len(rows) == 164
    scores = _humaneval_scores(rows)
    assert scores == [1.0] * 164, [r["task_id"] for r, s in zip(rows, scores) if s != 1.0]
    rng = random.Random(0)
    bad = [dict(r, completion=[{"role": "assistant", "content": corrupt(r, r["completion"][0]["content"], rng)}])
           for r in rows]
    scores = _humaneval_scores(bad)
    assert sum(scores) / len(scores) <= 0.05



def test_a_setup_failure_stops_the_run_only_when_a_trivial_program_fails_too(monkeypatch):
    # The bootstrap's "could not build the sandbox" is an exit code plus a message, which a
    # program that got hold of the process could imitate: then the row scores 0.0 and the
    # run goes on; a sandbox that cannot run print('ok') either stops the run.
    import rewards.code as code
    from rewards.sandbox import SandboxResult

    faked = SandboxResult(ok=False, returncode=125, stdout="", stderr="sandbox setup failed: x", timed_out=False,
                          reason="setup_failed", result=b"", isolation="none", wall_s=0.0)
    monkeypatch.setattr(code, "run_tests", lambda *a, **k: (False, faked))
    assert reward([PROMPT], [HONEST["fenced"]], test=[TEST], entry_point=["add_k"], domain=["code"], **FAST) == [0.0]
    monkeypatch.setattr(code, "run_python", lambda *a, **k: faked)
    with pytest.raises(RuntimeError, match="could not be built"):
        reward([PROMPT], [HONEST["fenced"]], test=[TEST], entry_point=["add_k"], domain=["code"], **FAST)


def test_loading_the_code_reward_checks_the_sandbox_before_any_model(monkeypatch):
    from core.config import ConfigError
    from mopd.distill.data import load_reward_fn

    monkeypatch.setenv("MOPD_SANDBOX_ISOLATION", "usrns")
    with pytest.raises(ValueError, match="MOPD_SANDBOX_ISOLATION"):
        load_reward_fn("rewards.code:reward")
    monkeypatch.delenv("MOPD_SANDBOX_ISOLATION")
    with pytest.raises((ValueError, ConfigError), match="isolation"):
        load_reward_fn("rewards.code:reward", {"isolation": "nope"})
    assert load_reward_fn("rewards.code:reward", {"timeout_s": 2.0}) is not None
