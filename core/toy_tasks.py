"""Two toy domains for `mopd toy`: `reverse` (reverse a list of words) and `rotate` (move
the first word to the end), plus generic chat data for pretraining a tiny base model
that can do neither.

The toy pipeline builds a random-init tiny model, pretrains it on `make_pretrain_dataset`
(chat format, ending turns with EOS, copying and counting; the two toy instructions
answered with random word orders), fine-tunes one teacher per domain on `sft_rows`,
then distills both teachers into one student. Everything here is seeded and cheap, so the whole pipeline
runs in minutes on a laptop CPU. TOY_DEFAULTS holds the tuned settings.

Splits: every problem is assigned to `train` or `test` by a hash of its prompt text, so
the two splits are disjoint whatever `n`, `seed` or `difficulty` is asked for, and a
given (domain, split, n, seed, difficulty) always yields the same rows.

Rewards follow the project's signature `reward(prompts, completions, **columns)`: scores
in [0, 1], `None` for rows of another domain (when a `domain` column is passed).
"""
from __future__ import annotations

import random
from typing import Callable

import datasets

from core.completions import completion_text
from core.splits import split_of

DOMAINS = ("reverse", "rotate")

# Words that are one token both at the start of a line and after a space in the project
# tokenizer (checked by tests), so a list of k words is exactly k tokens and reversing
# it is a pure copy-in-another-order task for a tiny model. Instruction words such as
# "reverse", "move" or "end" are left out on purpose.
WORDS = (
    "cloud day down data code key line name item group heap index month week year order "
    "part place range sample set size space start state string text tool value way form "
    "field header object class long old right low next mean max log quote sort width"
).split()

TEST_FRACTION = 0.1  # share of all problems that belong to the test split
MAX_COMPLETION_CHARS = 10_000  # longer completions score 0 without being parsed

# Settings for `mopd toy`, tuned on a 2-core CPU.
#   model:       kwargs of core.tiny.build_tiny_model (2 layers x 128 wide, 1.05M params)
#   difficulty:  per domain, for make_dataset / sft_rows (1: lists of 3-4 words)
#   pretrain:    n rows of make_pretrain_dataset + the core.sft.sft kwargs
#   teacher_sft: per domain, n rows of sft_rows(domain, "train") + the sft kwargs
#   eval:        n_test held-out rows per domain + the core.evaluate.evaluate kwargs
# num_threads=1: for a model this small one torch thread is 3-5x more CPU-efficient than
# two (0.1 vs 0.3-0.7 CPU-s per step of 64 rows).
TOY_DEFAULTS: dict = {
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 2},
    "difficulty": {"reverse": 1, "rotate": 1},
    "pretrain": {"n": 20_000, "steps": 800, "lr": 3e-3, "batch_size": 64, "warmup": 20, "num_threads": 1},
    "teacher_sft": {
        "reverse": {"n": 20_000, "steps": 300, "lr": 2e-3, "batch_size": 64, "warmup": 20, "num_threads": 1},
        "rotate": {"n": 20_000, "steps": 300, "lr": 2e-3, "batch_size": 64, "warmup": 20, "num_threads": 1},
    },
    "eval": {"n_test": 200, "max_new_tokens": 12, "batch_size": 100},
}


def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _reverse_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    # difficulty d: lists of 3 .. d+3 distinct words (d=1: 3-4). Distinct words mean a
    # list never equals its reverse, so echoing the prompt never scores.
    k = rng.randint(3, difficulty + 3)
    words = rng.sample(WORDS, min(k, len(WORDS)))
    return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))


def _operand(rng: random.Random, max_digits: int) -> int:
    k = rng.randint(1, max_digits)
    return rng.randint(0 if k == 1 else 10 ** (k - 1), 10 ** k - 1)


def _rotate_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    # Same lists as `reverse` (3 .. d+3 distinct words), a different rearrangement: the
    # first word moves to the end. For 3+ distinct words the rotation differs from both
    # the list itself and its reverse, so neither echoing nor reversing scores.
    k = rng.randint(3, difficulty + 3)
    words = rng.sample(WORDS, min(k, len(WORDS)))
    return f"Move the first word to the end: {' '.join(words)}", " ".join(words[1:] + words[:1])


_PROBLEMS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "reverse": _reverse_problem,
    "rotate": _rotate_problem,
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
        # Prefer unseen problems; a split with fewer than n problems repeats some.
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
    """Generic chat data for the base. Columns: prompt, completion (chat messages),
    domain ("pretrain").

    It teaches the chat format, the word and digit tokens, copying, counting and to end
    the turn with EOS. It also holds the two toy instructions, "Reverse the words: ..."
    and "Move the first word to the end: ...", answered with a *uniformly random order*
    of the given words. So the base knows what such a request looks like and that the
    answer is an arrangement of those words, but not which one: it answers at chance
    (1 in k! for k words), and the teachers have to learn the actual skill.

    That is how a real pretrained model stands to a skill its experts sharpen, and it is
    what on-policy distillation needs. The student learns from the teacher's log-probs
    of the tokens it samples itself; a base that puts ~e^-7 on the right word (what
    echo-and-count pretraining alone gives) almost never samples it, and the dense
    reward has nothing to push up. A base at chance samples the right next word about
    1 time in k, and distillation converges in a few dozen steps."""
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
        if kind < 0.2:
            words = rng.sample(WORDS, rng.randint(1, 6))
            p, c = f"Repeat the words: {' '.join(words)}", " ".join(words)
        elif kind < 0.4:
            words = rng.sample(WORDS, rng.randint(3, 5))
            p, c = f"Reverse the words: {' '.join(words)}", " ".join(rng.sample(words, len(words)))
        elif kind < 0.6:
            words = rng.sample(WORDS, rng.randint(3, 5))
            p = f"Move the first word to the end: {' '.join(words)}"
            c = " ".join(rng.sample(words, len(words)))
        elif kind < 0.7:
            num = _operand(rng, 3)
            p, c = f"Repeat the number: {num}", str(num)
        elif kind < 0.85:
            words = rng.sample(WORDS, rng.randint(1, 6))
            p, c = f"How many words: {' '.join(words)}", str(len(words))
        else:
            p, c = rng.choice(phrases)
        prompts.append([{"role": "user", "content": p}])
        completions.append([{"role": "assistant", "content": c}])
    return datasets.Dataset.from_dict({
        "prompt": prompts, "completion": completions, "domain": ["pretrain"] * n,
    })


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


def _score_words(text: str, answer: str) -> float:
    # Exact word sequence; whitespace between and around the words does not matter.
    return 1.0 if text.split() == answer.split() else 0.0


def reward_reverse(prompts, completions, answer=None, domain=None, **kw) -> list[float | None]:
    """1.0 when the completion is exactly the reversed word list, else 0.0."""
    return _per_row("reverse", completions, answer, domain, _score_words)


def reward_rotate(prompts, completions, answer=None, domain=None, **kw) -> list[float | None]:
    """1.0 when the completion is exactly the word list with its first word moved last."""
    return _per_row("rotate", completions, answer, domain, _score_words)


REWARDS: dict[str, Callable[..., list[float | None]]] = {"reverse": reward_reverse, "rotate": reward_rotate}
