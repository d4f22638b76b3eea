"""Reward for the `math` domain: 1.0 when the completion's final numeric answer equals
the reference `answer` column, else 0.0.

Both reasoning efforts are scored the same way, on the final answer only: `low`
(answer only) and `high` (worked steps, then the answer). The steps of a high-effort
completion are not checked and there is no format bonus, so scores stay in {0, 1};
each effort's style comes from its own teacher and system prompt, not from the reward.

Which number is the final answer:
  1. After the last "Answer:" marker (any case, also "answer is"), if there is one.
  2. Else inside the last `\\boxed{...}`, if there is one.
  3. Else the last number anywhere in the text ("3 * 4 = 12. 12 - 5 = 7" -> 7).
In cases 1 and 2 the marked region must name one value: "Answer: 7 pens." is 7,
"Answer: 7 or 8" is ambiguous and scores 0 (hedging never pays), "Answer: 7 (7 pens)"
is 7. A marker followed by no number ("Answer: none") scores 0; the text before the
marker is not searched.

What counts as a number (ASCII digits only; "٧" or fullwidth "７" are not numbers):
  12, -12 (also with the Unicode minus "−"), 12.0 (== 12), 1,234 (thousands groups of
  exactly three digits), $12, 12%, 3/4 (a fraction, compared by value). A "-" right
  after a digit, letter or ")" is an operator, not a sign ("12-5" -> 12 and 5).
  "nan" and "inf" are not numbers; "1e3" reads as 1 (no exponents). Values are compared
  exactly as fractions. Numbers of more than 40 digits, completions longer than
  MAX_COMPLETION_CHARS, and anything the parser cannot read score 0; the reward never
  raises on model output.
"""
from __future__ import annotations

import re
from fractions import Fraction

from core.completions import completion_text

DOMAIN = "math"
MAX_COMPLETION_CHARS = 10_000  # longer completions score 0 without being parsed
MAX_DIGITS = 40                # longer numbers are garbage, not answers

# A number: optional sign (not preceded by a word character or ")"), optional "$",
# then digits with optional thousands groups, an optional decimal part or "/denominator".
_NUMBER = re.compile(
    r"(?<![0-9A-Za-z_)\]])(?P<sign>[-\u2212])?\$?"
    r"(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
    r"(?:(?P<frac>\.[0-9]+)|\s?/\s?(?P<den>[0-9]+))?"
    r"(?![0-9])"
)
_MARKER = re.compile(r"answer\s*(?:is\s*)?[:=]|the answer is", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def _value(m: re.Match) -> Fraction | None:
    digits = m.group("int").replace(",", "")
    frac, den = m.group("frac"), m.group("den")
    if len(digits) + len(frac or "") + len(den or "") > MAX_DIGITS:
        return None
    try:
        if den is not None:
            if int(den) == 0:
                return None
            v = Fraction(int(digits), int(den))
        else:
            v = Fraction(digits + (frac or ""))
    except (ValueError, ZeroDivisionError):
        return None
    return -v if m.group("sign") else v


def _numbers(text: str) -> list[Fraction | None]:
    return [_value(m) for m in _NUMBER.finditer(text)]


def _single_value(region: str) -> Fraction | None:
    """The one value named in a marked region; None when it names none, several
    different ones, or one the parser rejects."""
    values = _numbers(region)
    if not values or any(v is None for v in values):
        return None
    return values[0] if all(v == values[0] for v in values) else None


def extract_answer(text: str) -> Fraction | None:
    """The final numeric answer of `text` (rules in the module docstring), or None."""
    if not isinstance(text, str) or len(text) > MAX_COMPLETION_CHARS:
        return None
    markers = list(_MARKER.finditer(text))
    if markers:
        return _single_value(text[markers[-1].end():])
    boxed = _BOXED.findall(text)
    if boxed:
        return _single_value(boxed[-1])
    values = _numbers(text)
    return values[-1] if values else None


def parse_reference(answer) -> Fraction | None:
    """The gold value from the `answer` column (an int, a float or a string)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(answer) if answer == answer and abs(answer) != float("inf") else None
    values = _numbers(str(answer))
    return values[0] if len(values) == 1 else None


def score(text: str, answer) -> float:
    """1.0 when the final answer of `text` equals `answer`, else 0.0."""
    try:
        gold = parse_reference(answer)
        got = extract_answer(text)
    except Exception:  # never raise on model output
        return 0.0
    return 1.0 if gold is not None and got is not None and got == gold else 0.0


def reward(prompts, completions, answer=None, domain=None, **columns) -> list[float | None]:
    """TRL reward: 1.0 for a correct final answer, 0.0 otherwise, None for rows whose
    `domain` is not "math". Needs the `answer` column."""
    completions = list(completions)
    if answer is None:
        raise ValueError("rewards.math.reward needs the `answer` column (the gold number per row)")
    answer = list(answer)
    if len(answer) != len(completions):
        raise ValueError(f"rewards.math.reward: {len(completions)} completions but {len(answer)} answers")
    domains = list(domain) if domain is not None else [None] * len(completions)
    if len(domains) != len(completions):
        raise ValueError(f"rewards.math.reward: {len(completions)} completions but {len(domains)} domains")
    out: list[float | None] = []
    for comp, ans, dom in zip(completions, answer, domains):
        if dom is not None and dom != DOMAIN:
            out.append(None)
            continue
        out.append(score(completion_text(comp), ans))
    return out
