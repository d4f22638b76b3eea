"""Data of the `math` domain: procedural arithmetic word problems, in two reasoning
efforts.

    Ana has 3 boxes of 4 pens and gives away 5. How many pens does Ana have left?
    low  (system: "Answer with the final number only.")        -> "Answer: 7"
    high (system: "Think step by step, then give 'Answer: N'.") -> "3 * 4 = 12. 12 - 5 = 7. Answer: 7"

The reward (rewards/math.py) checks the final answer only, for both efforts; the
effort decides the style a teacher is trained to, and each effort gets its own teacher.

Problems: one step (add, subtract, multiply) or two steps (multiply then add or
subtract, add then subtract), with names, items and containers drawn from small lists
whose words tokenize compactly. `difficulty` sets the number sizes and how many
problems have two steps (DIFFICULTY below). Difficulty 1 uses single-digit operands
(results up to 81) and one-step problems only, so every completion is under 30 tokens
and a tiny model can learn it by SFT in a few hundred steps; a random-init or
pretrained tiny base scores ~0 (docs/results/2026-11-29-code-math-domain-checks.md).

Splits: a problem belongs to `train` or `test` by a stable hash of its text (the user
message, whatever the effort), so the splits are disjoint for every n, seed, difficulty
and effort, and the same problem never shows up in train under one effort and in test
under the other. Rows are deterministic for (split, n, seed, difficulty, effort).
"""
from __future__ import annotations

import random
import re
from typing import Callable

import datasets

from core.splits import split_of

DOMAIN = "math"
EFFORTS = ("low", "high")
SYSTEM_PROMPTS = {
    "low": "Answer with the final number only.",
    "high": "Think step by step, then give 'Answer: N'.",
}
TEST_FRACTION = 0.1

# difficulty -> (largest operand, share of two-step problems). Results stay >= 0.
DIFFICULTY: dict[int, tuple[int, float]] = {1: (9, 0.0), 2: (9, 0.5), 3: (20, 0.5), 4: (99, 0.7)}

NAMES = ("Ana", "Ben", "Cal", "Dora", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Leo", "Mia")
ITEMS = ("pens", "apples", "books", "stones", "cards", "cups", "eggs", "coins", "toys", "shells")
BOXES = ("boxes", "bags", "jars", "rows", "packs")

# Real datasets shipped in PyPI packages: none for this domain.
DATASETS: dict[str, Callable[[], datasets.Dataset]] = {}


# ------------------------------------------------------------------------ problems

def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _difficulty(difficulty: int) -> tuple[int, float]:
    if not isinstance(difficulty, int) or difficulty < 1:
        raise ValueError(f"math: difficulty must be an int >= 1, got {difficulty!r}")
    return DIFFICULTY[min(difficulty, max(DIFFICULTY))]


def _problem(rng: random.Random, difficulty: int) -> tuple[str, list[str], int]:
    """(problem text, worked steps, answer)."""
    hi, two_step = _difficulty(difficulty)
    name, items, boxes = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(BOXES)
    ask = f"How many {items} does {name} have"
    if rng.random() < two_step:
        kind = rng.choice(("mul_add", "mul_sub", "add_sub"))
        a, b = rng.randint(2, hi), rng.randint(2, hi)
        if kind == "add_sub":
            s = a + b
            c = rng.randint(1, s)
            text = f"{name} has {a} {items}, gets {b} more and gives away {c}. {ask} left?"
            return text, [f"{a} + {b} = {s}.", f"{s} - {c} = {s - c}."], s - c
        p = a * b
        if kind == "mul_add":
            c = rng.randint(1, hi)
            text = f"{name} has {a} {boxes} of {b} {items} and finds {c} more. {ask} now?"
            return text, [f"{a} * {b} = {p}.", f"{p} + {c} = {p + c}."], p + c
        c = rng.randint(1, min(p, hi))
        text = f"{name} has {a} {boxes} of {b} {items} and gives away {c}. {ask} left?"
        return text, [f"{a} * {b} = {p}.", f"{p} - {c} = {p - c}."], p - c
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(2, hi), rng.randint(1, hi)
        text = f"{name} has {a} {items} and gets {b} more. {ask} now?"
        return text, [f"{a} + {b} = {a + b}."], a + b
    if kind == "sub":
        a = rng.randint(2, hi)
        b = rng.randint(1, a)
        text = f"{name} has {a} {items} and gives away {b}. {ask} left?"
        return text, [f"{a} - {b} = {a - b}."], a - b
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    text = f"{name} has {a} {boxes} of {b} {items}. {ask}?"
    return text, [f"{a} * {b} = {a * b}."], a * b


def solve(problem: str) -> int | None:
    """The answer of a problem written by `_problem` (None for other text), read back
    from its wording; tests use it to check references and pretrain rows."""
    nums = [int(x) for x in re.findall(r"[0-9]+", problem)]
    gives, more = "gives away" in problem, " more" in problem
    if " of " in problem and len(nums) >= 2:
        p = nums[0] * nums[1]
        if len(nums) == 3:
            return p + nums[2] if more else p - nums[2] if gives else None
        return p if len(nums) == 2 else None
    if len(nums) == 3 and more and gives:
        return nums[0] + nums[1] - nums[2]
    if len(nums) == 2:
        return nums[0] + nums[1] if more else nums[0] - nums[1] if gives else None
    return None


def reference_completion(steps: list[str], answer: int, effort: str) -> str:
    """The SFT target: "Answer: N" (low) or the worked steps then "Answer: N" (high)."""
    return f"Answer: {answer}" if effort == "low" else " ".join(steps) + f" Answer: {answer}"


def _check(split: str, n: int, effort: str | None) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"math: unknown split {split!r}; expected 'train' or 'test'")
    if n < 0:
        raise ValueError(f"math: n must be >= 0, got {n}")
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"math: unknown effort {effort!r}; expected one of {EFFORTS} (or None for a mix)")


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1,
                 effort: str | None = None) -> datasets.Dataset:
    """Procedural word problems. Columns: prompt (system + user messages), completion
    (the reference, one assistant message), domain, effort, answer (the gold number as
    a string). effort=None gives a seeded mix of both efforts."""
    _check(split, n, effort)
    _difficulty(difficulty)
    rng = random.Random(f"mopd-math/{split}/{seed}/{difficulty}/{effort}")
    prompts, completions, efforts, answers = [], [], [], []
    seen: set[str] = set()
    for _ in range(n):
        fallback = None  # prefer unseen problems; a split with fewer than n repeats some
        for _attempt in range(200):
            text, steps, ans = _problem(rng, difficulty)
            if _split_of(text) != split:
                continue
            fallback = (text, steps, ans)
            if text not in seen:
                break
        if fallback is None:
            raise RuntimeError(f"math: could not draw a {split} problem")
        text, steps, ans = fallback
        seen.add(text)
        eff = effort or rng.choice(EFFORTS)
        prompts.append([{"role": "system", "content": SYSTEM_PROMPTS[eff]},
                        {"role": "user", "content": text}])
        completions.append([{"role": "assistant", "content": reference_completion(steps, ans, eff)}])
        efforts.append(eff)
        answers.append(str(ans))
    return datasets.Dataset.from_dict({
        "prompt": prompts, "completion": completions, "domain": [DOMAIN] * n,
        "effort": efforts, "answer": answers,
    }, features=_features(with_effort=True))


def _features(with_effort: bool) -> datasets.Features:
    msg = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    f = {"prompt": msg, "completion": msg, "domain": datasets.Value("string")}
    if with_effort:
        f["effort"] = datasets.Value("string")
        f["answer"] = datasets.Value("string")
    return datasets.Features(f)


# ------------------------------------------------------------------------ corrupt

_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                             "*": lambda a, b: a * b}
_INT = re.compile(r"(?<![0-9])-?[0-9]+(?![0-9])")


def _user_text(row: dict) -> str:
    prompt = row.get("prompt") or []
    if isinstance(prompt, str):
        return prompt
    for msg in reversed(prompt):
        if isinstance(msg, dict) and msg.get("role") == "user":
            return str(msg.get("content", ""))
    return ""


def _wrong_answers(row: dict, gold: int) -> list[int]:
    """Off-by-one/two values and results of the wrong operation on the operands."""
    nums = [int(x) for x in _INT.findall(_user_text(row))]
    cands = {gold - 2, gold - 1, gold + 1, gold + 2}
    if len(nums) >= 2:
        a, b = nums[0], nums[1]
        cands |= {a + b, a * b, abs(a - b)}
        if len(nums) >= 3:
            c = nums[2]
            cands |= {a * b + c, abs(a * b - c), a + b + c, a * b}
    return sorted(v for v in cands if v >= 0 and v != gold)


def corrupt(row: dict, reference: str, rng: random.Random) -> str:
    """A plausible wrong completion: the reference with its final result replaced by an
    off-by-one value or the result of the wrong operation (scores 0)."""
    gold = int(str(row["answer"]).strip())
    wrong = rng.choice(_wrong_answers(row, gold))
    # Replace the final result where it is stated: after the last "=" (high effort) or
    # after "Answer:" (low effort), so the corrupted steps stay self-consistent.
    cut = reference.rfind("=")
    cut = cut if cut >= 0 else reference.find("Answer:")
    if cut < 0:
        return f"Answer: {wrong}"
    tail = re.sub(rf"(?<![0-9]){gold}(?![0-9])", str(wrong), reference[cut:])
    out = reference[:cut] + tail
    return out if out != reference else f"{reference} Answer: {wrong}"


# ------------------------------------------------------------------------ pretrain

def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows (prompt, completion, domain="pretrain") in the math format that never solve
    a problem: "Repeat the number", "Give a random number", and word problems (both
    efforts) answered with a wrong but plausible number; the high-effort ones write the
    right operands and operators with made-up results ("3 * 4 = 15. 15 - 5 = 9.
    Answer: 9"). The base learns the format, the system prompts and the tokens, and its
    samples are near misses; it learns no arithmetic fact."""
    if n < 0:
        raise ValueError(f"math: n must be >= 0, got {n}")
    rng = random.Random(f"mopd-math/pretrain/{seed}")
    prompts, completions = [], []
    for _ in range(n):
        kind = rng.random()
        eff = rng.choice(EFFORTS)
        system = {"role": "system", "content": SYSTEM_PROMPTS[eff]}
        if kind < 0.2:
            num = rng.randint(0, 99)
            prompt, comp = [system, {"role": "user", "content": f"Repeat the number: {num}"}], f"Answer: {num}"
        elif kind < 0.35:
            num = rng.randint(0, 99)
            prompt, comp = [{"role": "user", "content": "Give a random number."}], f"Answer: {num}"
        else:
            text, steps, ans = _problem(rng, rng.choice((1, 1, 2)))
            results: list[int] = []
            fake_steps: list[str] = []
            for i, step in enumerate(steps):  # made-up results: never the true value
                x, op, y = step.split(" = ")[0].split()
                if results:  # the next step starts from the previous (made-up) result
                    x = str(results[-1])
                real = _OPS[op](int(x), int(y))
                bad = {real, ans} if i == len(steps) - 1 else {real}
                fake = rng.randint(0, max(20, 2 * real))
                while fake in bad:
                    fake += 1
                results.append(fake)
                fake_steps.append(f"{x} {op} {y} = {fake}.")
            steps = fake_steps
            prompt = [system, {"role": "user", "content": text}]
            comp = reference_completion(steps, results[-1], eff)
        prompts.append(prompt)
        completions.append([{"role": "assistant", "content": comp}])
    return datasets.Dataset.from_dict({
        "prompt": prompts, "completion": completions, "domain": ["pretrain"] * n,
    }, features=_features(with_effort=False))
