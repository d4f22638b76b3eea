"""Reward of the `unitconv` domain, TRL's signature: 1.0 when the last number of the
completion equals the `answer` column numerically ("7000", "7,000", "7000.0", "7e3",
"Answer: 7000 m" all count), else 0.0; None for rows of other domains. It never raises on
model output: text it cannot read scores 0."""
from __future__ import annotations

import math
import re

from core.completions import completion_text

DOMAIN = "unitconv"
MAX_CHARS = 2_000
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def number(text: str) -> float | None:
    """The last number of `text`, or None."""
    if len(text) > MAX_CHARS:
        return None
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        v = float(found[-1].replace(",", ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def score(completion, answer) -> float:
    v, gold = number(completion_text(completion)), float(answer)
    return float(v is not None and math.isclose(v, gold, rel_tol=1e-9, abs_tol=1e-9))


def reward(prompts, completions, answer=None, domain=None, **_columns) -> list[float | None]:
    if answer is None or len(answer) != len(completions):
        raise ValueError(f"unitconv reward: needs the `answer` column, one per completion "
                         f"({len(completions)} completions)")
    domains = domain or [DOMAIN] * len(completions)
    return [score(c, a) if d == DOMAIN else None for c, a, d in zip(completions, answer, domains)]
