"""Data of the `unitconv` domain: convert a whole quantity from one unit to another.

    system: "Answer with the number only."   user: "Convert 7 km to m."   -> "7000"

`difficulty` picks the conversions: 1 multiplies by 10, 100 or 1000 (the tokens of the
value, then zeros: a tiny model learns it by SFT), 2 adds the clock and imperial factors
(60, 24, 12) and 3 adds the reverse conversions (values that divide exactly). Answers are
whole numbers, stored as strings in the `answer` column the reward reads.

Splits: a task is `train` or `test` by a stable hash of its text (core.splits), so the
held-out suite never sees a training task; rows are deterministic for (split, n, seed,
difficulty). The training file files/train.jsonl is `write_jsonl` of the train split, in
the form a team's own file has (chat `messages` and an `expected` column the recipes map
to `answer`: experts/files.py in mopd).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import datasets

from core.splits import split_of
from experts.procedural import check_split_n_effort

DOMAIN = "unitconv"
EFFORTS: tuple[str, ...] = ()
DATASETS: dict = {}
SYSTEM = "Answer with the number only."
TEST_FRACTION = 0.1

# (from, to, factor): value in `from` * factor = value in `to`
EASY = [("km", "m", 1000), ("m", "cm", 100), ("cm", "mm", 10), ("kg", "g", 1000), ("L", "mL", 1000)]
CLOCK = [("h", "min", 60), ("min", "s", 60), ("day", "h", 24), ("ft", "in", 12)]
CONVERSIONS = {1: EASY, 2: EASY + CLOCK, 3: EASY + CLOCK}


def task(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """(the user's question, the whole-number answer)."""
    src, dst, factor = rng.choice(CONVERSIONS[difficulty])
    value = rng.randint(1, 99)
    if difficulty >= 3 and rng.random() < 0.5:   # the reverse way, on a value that divides exactly
        return f"Convert {value * factor} {dst} to {src}.", value
    return f"Convert {value} {src} to {dst}.", value * factor


def _check(split: str, n, difficulty, effort) -> None:
    check_split_n_effort(DOMAIN, split, n, effort)   # mopd's shared checks of make_dataset's arguments
    if difficulty not in CONVERSIONS:
        raise ValueError(f"unitconv: difficulty must be one of {sorted(CONVERSIONS)}, got {difficulty!r}")


FEATURES = datasets.Features({
    "prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "completion": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "domain": datasets.Value("string"), "answer": datasets.Value("string")})


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1, effort: str | None = None) -> datasets.Dataset:
    """n distinct tasks of `split` (fewer distinct ones than n: some repeat). Columns:
    prompt (system + user), completion (the answer), domain, answer."""
    _check(split, n, difficulty, effort)
    rng = random.Random(f"unitconv/{split}/{seed}/{difficulty}")
    rows, seen = [], set()
    for _ in range(n):
        last = None
        for _attempt in range(500):
            text, ans = task(rng, difficulty)
            if split_of(text, TEST_FRACTION) != split:
                continue
            last = (text, ans)
            if text not in seen:
                break
        if last is None:
            raise RuntimeError(f"unitconv: no {split} task drawn in 500 tries")
        seen.add(last[0])
        rows.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": last[0]}],
                     "completion": [{"role": "assistant", "content": str(last[1])}],
                     "domain": DOMAIN, "answer": str(last[1])})
    return datasets.Dataset.from_list(rows, features=FEATURES) if rows else \
        datasets.Dataset.from_dict({k: [] for k in FEATURES}, features=FEATURES)


def corrupt(row: dict, reference: str, rng: random.Random) -> str:
    """A plausible wrong answer: the factor applied the wrong way or off by a zero, or one off."""
    gold = int(row["answer"])
    return str(rng.choice([v for v in (gold * 10, gold // 10, gold + 1, gold - 1) if v != gold]))


def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows in the domain's format that never convert: "Repeat the number" and conversions
    answered with a wrong number. The base learns the format and the unit tokens, not the
    factors."""
    rng = random.Random(f"unitconv/pretrain/{seed}")
    prompts, completions = [], []
    for _ in range(n):
        if rng.random() < 0.3:
            v = rng.randint(0, 999)
            user, answer = f"Repeat the number: {v}", v
        else:
            user, gold = task(rng, rng.choice((1, 2)))
            answer = rng.randint(0, 2 * gold + 20)
            answer += answer == gold
        prompts.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
        completions.append([{"role": "assistant", "content": str(answer)}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n})


def write_jsonl(path: str | Path, n: int = 450, seed: int = 0, difficulty: int = 1) -> Path:
    """The train split as a team's file: {"messages": [system, user, assistant], "expected": "7000"}."""
    path = Path(path)
    with path.open("w") as f:
        for r in make_dataset("train", n, seed=seed, difficulty=difficulty):
            f.write(json.dumps({"messages": r["prompt"] + r["completion"], "expected": r["answer"]}) + "\n")
    return path


if __name__ == "__main__":   # python -m mopd_unitconv.data: rewrite files/train.jsonl
    print(write_jsonl(Path(__file__).resolve().parent / "files" / "train.jsonl"))
