"""Reward for the `instruction_following` domain: the fraction of a prompt's verifiable
constraints that the completion meets (IFEval-style, deterministic, no model).

The constraints come in the `constraints` column: a JSON string (or an already parsed
list) of objects {"type": ..., params}. Types (CHECKS below):

    lowercase                          no uppercase letter, at least one letter
    uppercase                          no lowercase letter, at least one letter
    word_count        relation, n      number of words  (relation: "at least" / "at most" / "exactly")
    sentence_count    relation, n      number of sentences (ended by . ! or ?, or the end of the text)
    include_keywords  keywords         every keyword appears as a whole word (any case)
    exclude_keywords  keywords         none of them appears as a whole word (any case)
    keyword_frequency keyword, relation, n   occurrences of one keyword
    json                               the whole answer is a JSON object or array (a ```json fence is fine)
    bullets           n                exactly n lines are bullets ("- " or "* ")
    start_with        phrase           the answer starts with the phrase (any case)
    end_with          phrase           the answer ends with the phrase (any case)
    no_commas                          no comma anywhere
    quotation                          the whole answer is wrapped in double quotes

Words are runs of letters and digits (an apostrophe inside a word keeps it one word).
An empty (or whitespace-only) completion meets nothing, and so does one longer than
MAX_COMPLETION_CHARS; a constraint whose check fails on odd input counts as not met.
An unknown constraint type is a data error and raises.
"""
from __future__ import annotations

import json
import re
from typing import Callable

from core.completions import completion_text

DOMAIN = "instruction_following"
MAX_COMPLETION_CHARS = 20_000
RELATIONS = ("at least", "at most", "exactly")


_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z0-9]+)*")
_SENTENCE_END = re.compile(r"[.!?]+")
_BULLET = re.compile(r"^\s*[-*]\s+\S")
_FENCE = re.compile(r"\A```(?:json)?\s*\n?(.*?)\n?\s*```\Z", re.S | re.I)


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def count_sentences(text: str) -> int:
    """Pieces between sentence-ending punctuation that contain a word."""
    return sum(1 for piece in _SENTENCE_END.split(text) if _WORD.search(piece))


def count_keyword(text: str, keyword: str) -> int:
    """Whole-word occurrences of `keyword` (any case)."""
    kw = keyword.strip()
    if not kw:
        return 0
    return len(re.findall(r"(?<![A-Za-z0-9])" + re.escape(kw) + r"(?![A-Za-z0-9])", text, flags=re.I))


def count_bullets(text: str) -> int:
    return sum(1 for line in text.splitlines() if _BULLET.match(line))


def compare(value: int, relation: str, n: int) -> bool:
    if relation == "at least":
        return value >= n
    if relation == "at most":
        return value <= n
    if relation == "exactly":
        return value == n
    raise ValueError(f"unknown relation {relation!r}; expected one of {RELATIONS}")


def _is_json(text: str) -> bool:
    t = text.strip()
    m = _FENCE.match(t)
    if m:
        t = m.group(1).strip()
    try:
        return isinstance(json.loads(t), (dict, list))
    except (ValueError, RecursionError):
        return False


def _has_letters(text: str) -> bool:
    return any(c.isalpha() for c in text)


def _norm(s: str) -> str:
    return " ".join(s.split()).lower()


CHECKS: dict[str, Callable[..., bool]] = {
    "lowercase": lambda t: _has_letters(t) and t == t.lower(),
    "uppercase": lambda t: _has_letters(t) and t == t.upper(),
    "word_count": lambda t, relation, n: compare(len(words(t)), relation, n),
    "sentence_count": lambda t, relation, n: compare(count_sentences(t), relation, n),
    "include_keywords": lambda t, keywords: all(count_keyword(t, k) > 0 for k in keywords),
    "exclude_keywords": lambda t, keywords: not any(count_keyword(t, k) > 0 for k in keywords),
    "keyword_frequency": lambda t, keyword, relation, n: compare(count_keyword(t, keyword), relation, n),
    "json": _is_json,
    "bullets": lambda t, n: count_bullets(t) == n,
    "start_with": lambda t, phrase: _norm(t).startswith(_norm(phrase)),
    "end_with": lambda t, phrase: _norm(t).endswith(_norm(phrase)),
    "no_commas": lambda t: "," not in t,
    "quotation": lambda t: len(t.strip()) >= 2 and t.strip()[0] == '"' and t.strip()[-1] == '"',
}


# Parameters each type needs, and their Python types (checked when a row is read).
PARAMS: dict[str, dict[str, type | tuple]] = {
    "lowercase": {}, "uppercase": {}, "json": {}, "no_commas": {}, "quotation": {},
    "word_count": {"relation": str, "n": int},
    "sentence_count": {"relation": str, "n": int},
    "include_keywords": {"keywords": list},
    "exclude_keywords": {"keywords": list},
    "keyword_frequency": {"keyword": str, "relation": str, "n": int},
    "bullets": {"n": int},
    "start_with": {"phrase": str},
    "end_with": {"phrase": str},
}
assert set(PARAMS) == set(CHECKS)


def check(text: str, constraint: dict) -> bool:
    """Whether `text` meets one constraint; False on any error in the check."""
    kind = constraint["type"]
    params = {k: v for k, v in constraint.items() if k != "type"}
    try:
        return bool(CHECKS[kind](text, **params))
    except Exception:
        return False


def parse_constraints(value, row: int | None = None) -> list[dict]:
    """The constraint list of a row (JSON string or list), validated: a data error
    raises ValueError naming the row."""
    where = f"row {row}: " if row is not None else ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"reward_instruction_following: {where}`constraints` is not valid JSON ({e})") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"reward_instruction_following: {where}`constraints` must be a non-empty list, got {value!r}")
    for c in value:
        if not isinstance(c, dict) or c.get("type") not in CHECKS:
            raise ValueError(f"reward_instruction_following: {where}unknown constraint {c!r}; "
                             f"types: {sorted(CHECKS)}")
        want = PARAMS[c["type"]]
        got = {k for k in c if k != "type"}
        bad = [k for k, t in want.items() if k not in c or not isinstance(c[k], t) or isinstance(c[k], bool)]
        if got != set(want) or bad or ("relation" in c and c["relation"] not in RELATIONS):
            raise ValueError(f"reward_instruction_following: {where}constraint {c!r} needs exactly the "
                             f"parameters {want} (relation one of {RELATIONS})")
    return value


def score_text(text: str, constraints: list[dict]) -> float:
    """Fraction of `constraints` met by `text` (0 for empty or over-long text)."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_COMPLETION_CHARS:
        return 0.0
    return sum(check(text, c) for c in constraints) / len(constraints)


def reward(prompts, completions, constraints=None, domain=None, **kwargs) -> list[float | None]:
    """TRL-style reward: the fraction of the row's constraints the completion meets;
    None for rows of another domain."""
    completions = list(completions)
    n = len(completions)
    domains = list(domain) if domain is not None else [None] * n
    if len(domains) != n:
        raise ValueError(f"reward_instruction_following: {n} completions but {len(domains)} domains")
    mine = [d is None or d == DOMAIN for d in domains]
    if any(mine) and constraints is None:
        raise ValueError("reward_instruction_following needs the `constraints` column "
                         "(a JSON list of {\"type\": ..., params} per row)")
    constraints = list(constraints) if constraints is not None else [None] * n
    if len(constraints) != n:
        raise ValueError(f"reward_instruction_following: {n} completions but {len(constraints)} constraint lists")
    out: list[float | None] = []
    for i in range(n):
        if not mine[i]:
            out.append(None)
            continue
        cons = parse_constraints(constraints[i], i)
        out.append(score_text(completion_text(completions[i]), cons))
    return out


reward.__name__ = "reward_instruction_following"
