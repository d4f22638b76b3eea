"""Two toy domains for `mopd toy`: `reverse` (reverse a list of words) and `add` (add two
numbers), plus generic chat data for pretraining a tiny base model that can do neither.

The toy pipeline builds a random-init tiny model, pretrains it on `make_pretrain_dataset`
(chat format, ending turns with EOS, copying and counting), fine-tunes one teacher per
domain on `sft_rows`, then distills both teachers into one student. Everything here is
seeded and cheap, so the whole pipeline runs in minutes on a laptop CPU.

Splits: every problem is assigned to `train` or `test` by a hash of its prompt text, so
the two splits are disjoint whatever `n`, `seed` or `difficulty` is asked for, and a
given (domain, split, n, seed, difficulty) always yields the same rows.

Rewards follow the project's signature `reward(prompts, completions, **columns)`: scores
in [0, 1], `None` for rows of another domain (when a `domain` column is passed).
"""
from __future__ import annotations

import hashlib
import random
import re
from typing import Callable

import datasets

DOMAINS = ("reverse", "add")

# Words that are one token both at the start of a line and after a space in the project
# tokenizer (checked by tests), so a list of k words is exactly k tokens and reversing
# it is a pure copy-in-reverse-order task for a tiny model. Instruction words such as
# "reverse", "add" or "sum" are left out on purpose.
WORDS = (
    "cloud day down data code key line name item group heap index month week year order "
    "part place range sample set size space start state string text tool value way form "
    "field header object class long old right low end next mean max log quote sort width"
).split()

TEST_FRACTION = 0.1  # share of all problems that belong to the test split
MAX_COMPLETION_CHARS = 10_000  # longer completions score 0 without being parsed

# Settings `mopd toy` uses, tuned on a 2-core CPU (see the report under "measured").
# The numbers under "measured" are what one run of /tmp-style tuning gave on that
# machine (wall seconds are noisy: the cores were shared); they document the choice
# and are not asserted anywhere.
TOY_DEFAULTS: dict = {
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 2},
    "difficulty": {"reverse": 1, "add": 1},
    "pretrain": {"n": 20_000, "steps": 600, "lr": 3e-3, "batch_size": 64, "warmup": 30},
    "teacher_sft": {
        "reverse": {"n": 20_000, "steps": 600, "lr": 2e-3, "batch_size": 64, "warmup": 30},
        "add": {"n": 20_000, "steps": 600, "lr": 2e-3, "batch_size": 64, "warmup": 30},
    },
    "eval": {"n_test": 200, "max_new_tokens": 16, "batch_size": 100},
    "measured": {},
}


# ----------------------------------------------------------------------------- problems

def _split_of(key: str) -> str:
    """train/test by a stable hash of the problem text (Python's hash() is salted)."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "test" if (h % 10_000) < TEST_FRACTION * 10_000 else "train"


def _reverse_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    # difficulty d: lists of 3 .. d+3 distinct words (d=1: 3-4, d=2: 3-5). Distinct words
    # mean a list never equals its reverse, so echoing the prompt never scores.
    k = rng.randint(3, difficulty + 3)
    words = rng.sample(WORDS, min(k, len(WORDS)))
    return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)  # uniform over the number of digits, then value
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(lo, 10 ** digits - 1)


def _add_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    """difficulty 1: two 3-digit numbers whose digits never carry (314 + 452 = 766);
    difficulty d >= 2: two d-digit numbers, carries allowed (47 + 85 = 132).

    Carrying is what makes addition slow for a tiny model: the units digit is a sum mod
    10, a 100-entry table that a 3-layer, 128-wide model only picks up after ~500-1000
    SFT steps of 64 rows, and abruptly. Without carries every answer digit is the sum of
    the two digits above it (a monotone 55-entry table), which the same model learns in
    ~200 steps; 3 digits keep ~100k distinct problems, so 200 held-out ones are easy.
    """
    if difficulty == 1:
        while True:
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            if all(int(x) + int(y) <= 9 for x, y in zip(str(a), str(b))):
                break
    else:
        lo, hi = 10 ** (difficulty - 1), 10 ** difficulty - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return f"What is {a} + {b}?", str(a + b)


_PROBLEMS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "reverse": _reverse_problem,
    "add": _add_problem,
}


def _check_args(domain: str, split: str, n: int, difficulty: int) -> None:
    if domain not in _PROBLEMS:
        raise ValueError(f"unknown toy domain {domain!r}; expected one of {DOMAINS}")
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")


def _problems(domain: str, split: str, n: int, seed: int, difficulty: int) -> list[tuple[str, str]]:
    _check_args(domain, split, n, difficulty)
    rng = random.Random(f"mopd-toy/{domain}/{split}/{seed}/{difficulty}")  # str seeds are stable
    make = _PROBLEMS[domain]
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()
    for _ in range(n):
        # Prefer unseen problems; a split smaller than n (e.g. 1-digit sums) repeats.
        fallback = None
        for _attempt in range(200):
            prompt, answer = make(rng, difficulty)
            if _split_of(prompt) != split:
                continue
            fallback = (prompt, answer)
            if prompt not in seen:
                break
        else:
            if fallback is None:
                raise RuntimeError(f"could not draw a {split} problem for {domain!r}")
            prompt, answer = fallback
        seen.add(prompt)
        rows.append((prompt, answer))
    return rows


def make_dataset(domain: str, split: str, n: int, seed: int = 0, difficulty: int = 1) -> datasets.Dataset:
    """Prompts for one toy domain: columns prompt (chat messages), domain, answer."""
    rows = _problems(domain, split, n, seed, difficulty)
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for p, _ in rows],
        "domain": [domain] * len(rows),
        "answer": [a for _, a in rows],
    })


def sft_rows(domain: str, split: str, n: int, seed: int = 0, difficulty: int = 1) -> datasets.Dataset:
    """make_dataset plus a gold `completion` (one assistant message) for teacher SFT."""
    ds = make_dataset(domain, split, n, seed=seed, difficulty=difficulty)
    return ds.add_column("completion", [[{"role": "assistant", "content": a}] for a in ds["answer"]])


def make_pretrain_dataset(n: int, seed: int = 0) -> datasets.Dataset:
    """Generic chat data for the base: echo a word list, echo a number, count words, say a
    fixed phrase. It teaches the chat format, the word and digit tokens, copying, and to
    end the turn with EOS, but never reversing or adding, so the base scores ~0 on both
    toy domains. Columns: prompt, completion (chat messages), domain ("pretrain")."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"mopd-toy/pretrain/{seed}")
    phrases = [
        ("Say hello.", "Hello!"),
        ("Say goodbye.", "Goodbye!"),
        ("Are you ready?", "Yes, I am ready."),
        ("What is your name?", "I am a tiny model."),
        ("Thank you.", "You are welcome."),
    ]
    prompts, completions = [], []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            words = rng.sample(WORDS, rng.randint(1, 6))
            p, c = f"Repeat the words: {' '.join(words)}", " ".join(words)
        elif kind < 0.65:
            num = _operand(rng, 3)
            p, c = f"Repeat the number: {num}", str(num)
        elif kind < 0.9:
            words = rng.sample(WORDS, rng.randint(1, 6))
            p, c = f"How many words: {' '.join(words)}", str(len(words))
        else:
            p, c = rng.choice(phrases)
        prompts.append([{"role": "user", "content": p}])
        completions.append([{"role": "assistant", "content": c}])
    return datasets.Dataset.from_dict({
        "prompt": prompts, "completion": completions, "domain": ["pretrain"] * n,
    })


# ------------------------------------------------------------------------------ rewards

def completion_text(completion) -> str:
    """The text of a completion given as a string or as chat messages (the last
    assistant message's content); anything else reads as empty."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content")
        return content if isinstance(content, str) else ""
    if isinstance(completion, (list, tuple)):
        for msg in reversed(completion):
            if isinstance(msg, dict) and msg.get("role", "assistant") == "assistant":
                content = msg.get("content")
                return content if isinstance(content, str) else ""
        return ""
    return ""


def _per_row(name: str, completions, answer, domain, score: Callable[[str, str], float]) -> list[float | None]:
    completions = list(completions)
    if answer is None:
        raise ValueError(f"reward_{name} needs the `answer` column")
    answer = list(answer)
    if len(answer) != len(completions):
        raise ValueError(f"reward_{name}: {len(completions)} completions but {len(answer)} answers")
    domains = list(domain) if domain is not None else [None] * len(completions)
    out: list[float | None] = []
    for comp, ans, dom in zip(completions, answer, domains):
        if dom is not None and dom != name:
            out.append(None)  # not this domain's row
            continue
        text = completion_text(comp)
        out.append(0.0 if len(text) > MAX_COMPLETION_CHARS else float(score(text, str(ans))))
    return out


def _score_reverse(text: str, answer: str) -> float:
    # Exact word sequence; whitespace between and around the words does not matter.
    return 1.0 if text.split() == answer.split() else 0.0


_INT = re.compile(r"[+-]?\d+")


def _score_add(text: str, answer: str) -> float:
    # The whole completion must be the number (surrounding whitespace allowed). No extra
    # text, no leading zeros, no "+"; a near miss is a miss.
    t = text.strip()
    return 1.0 if _INT.fullmatch(t) and t == answer.strip() else 0.0


def reward_reverse(prompts, completions, answer=None, domain=None, **kw) -> list[float | None]:
    """1.0 when the completion is exactly the reversed word list, else 0.0."""
    return _per_row("reverse", completions, answer, domain, _score_reverse)


def reward_add(prompts, completions, answer=None, domain=None, **kw) -> list[float | None]:
    """1.0 when the completion is exactly the sum (digits only), else 0.0."""
    return _per_row("add", completions, answer, domain, _score_add)


REWARDS: dict[str, Callable[..., list[float | None]]] = {"reverse": reward_reverse, "add": reward_add}
