"""Data of the `instruction_following` domain: a short text on a topic that meets a few
verifiable constraints (IFEval-style).

    user: Write about the ocean. Use the word "deep". End with "The end."
    ->    The ocean is deep. The ocean feels calm. The end.

rewards/instruction_following.py scores the fraction of constraints met. The
constraints are stored per row in the `constraints` column as a JSON list of
{"type": ..., params} (the types and their checks are in the reward module), so scoring
is deterministic and needs no model.

Reference completions are built programmatically from the topic's sentences, then
formatted (bullets, JSON, quotes), framed (start/end phrases) and cased, and the count
constraints (words, sentences, keyword frequency) take their numbers from the finished
reference, so a reference meets all of its constraints by construction (tests check
it). They are short: 1-3 sentences of 3-5 words, 5-42 tokens of the tiny tokenizer at
difficulty 1 (mean ~21), up to ~80 at difficulty 4.

`difficulty` is the number of constraints: difficulty d has d + 1 of them (capped at
5). Difficulty 1 draws its two from the constraints an untrained model almost never
meets by accident and a tiny model can learn by copying from the prompt (use a word,
start/end with a phrase, bullets, JSON, quotes); from difficulty 2 on every type can
appear (case, counts, forbidden words, no commas), at most one of the LOOSE types that
plain prose meets by accident. Incompatible pairs (JSON and a start phrase, two formats,
upper and lower case, ...) are never drawn together. An answer that ignores the
constraints (plain on-topic sentences) scores 0.0 at difficulty 1 and ~0.2 above.

Splits: a prompt belongs to `train` or `test` by a stable hash of its text; rows are
deterministic for (split, n, seed, difficulty).
"""
from __future__ import annotations

import json
import random
import re
from typing import Callable

import datasets

from experts.procedural import check_split_n_effort
from core.splits import split_of
from rewards.instruction_following import check, count_keyword, count_sentences, score_text, words

DOMAIN = "instruction_following"
EFFORTS: tuple[str, ...] = ()
TEST_FRACTION = 0.1

# Real datasets shipped in PyPI packages: none for this domain.
DATASETS: dict[str, Callable[[], datasets.Dataset]] = {}

# topic phrase -> (its head noun, adjectives that fit it)
TOPICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "the ocean": ("ocean", ("blue", "deep", "cold", "wide", "calm", "dark")),
    "summer": ("summer", ("warm", "long", "bright", "green", "slow", "hot")),
    "winter": ("winter", ("cold", "dark", "white", "quiet", "long", "grey")),
    "music": ("music", ("loud", "soft", "happy", "old", "sweet", "free")),
    "the garden": ("garden", ("green", "quiet", "small", "bright", "wild", "fresh")),
    "the river": ("river", ("long", "cold", "fast", "clear", "wide", "calm")),
    "the moon": ("moon", ("bright", "pale", "round", "quiet", "far", "white")),
    "coffee": ("coffee", ("hot", "dark", "strong", "bitter", "fresh", "rich")),
    "rain": ("rain", ("cold", "soft", "grey", "heavy", "light", "fresh")),
    "the city": ("city", ("loud", "busy", "big", "bright", "old", "fast")),
    "the forest": ("forest", ("green", "dark", "old", "quiet", "deep", "wild")),
    "snow": ("snow", ("white", "cold", "soft", "deep", "clean", "light")),
    "tea": ("tea", ("hot", "green", "sweet", "calm", "light", "warm")),
    "the night": ("night", ("dark", "long", "quiet", "cold", "calm", "still")),
    "the sun": ("sun", ("hot", "bright", "yellow", "big", "warm", "far")),
    "bread": ("bread", ("fresh", "warm", "soft", "brown", "good", "plain")),
    "the sky": ("sky", ("blue", "wide", "clear", "grey", "high", "open")),
    "the mountain": ("mountain", ("high", "cold", "old", "steep", "quiet", "white")),
    "the train": ("train", ("fast", "long", "loud", "old", "red", "busy")),
    "paper": ("paper", ("white", "thin", "light", "plain", "smooth", "old")),
}
ASKS = ("Write about {t}.", "Describe {t}.", "Tell me about {t}.")
TEMPLATES = ("{S} is {a}.", "{S} feels {a}.", "{S} looks {a}.", "{S} seems {a}.")
START_PHRASES = ("Sure", "Here it is", "Well", "Okay", "Hello", "In short", "Dear reader", "Listen")
END_PHRASES = ("That is all.", "Thank you.", "The end.", "Any questions?", "Goodbye.", "Have a nice day.")
FILLERS = ("nice", "fine", "good", "okay")  # corrupt/pretrain: words no constraint ever asks for

BASIC = ("include_keywords", "start_with", "end_with", "bullets", "json", "quotation")
ALL = BASIC + ("lowercase", "uppercase", "word_count", "sentence_count", "exclude_keywords",
               "keyword_frequency", "no_commas")
FORMATS = {"json", "bullets", "quotation"}
# pairs never drawn together: they contradict, or one makes the other ill-defined
CONFLICTS = {frozenset(p) for p in [
    ("json", "bullets"), ("json", "quotation"), ("bullets", "quotation"), ("lowercase", "uppercase"),
    ("json", "start_with"), ("json", "end_with"), ("json", "sentence_count"), ("json", "word_count"),
    ("quotation", "start_with"), ("quotation", "end_with"), ("bullets", "sentence_count"),
]}
# Types that plain prose often meets by accident; at most one per prompt, so that an
# answer that ignores the instructions stays well below full marks.
LOOSE = {"no_commas", "exclude_keywords", "lowercase", "word_count", "sentence_count"}
# difficulty -> (number of constraints, types to draw from)
DIFFICULTY: dict[int, tuple[int, tuple[str, ...]]] = {1: (2, BASIC), 2: (3, ALL), 3: (4, ALL), 4: (5, ALL)}


# ------------------------------------------------------------------------ problems

def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _config(difficulty: int) -> tuple[int, tuple[str, ...]]:
    if not isinstance(difficulty, int) or isinstance(difficulty, bool) or difficulty < 1:
        raise ValueError(f"instruction_following: difficulty must be an int >= 1, got {difficulty!r}")
    return DIFFICULTY[min(difficulty, max(DIFFICULTY))]


def _draw_types(rng: random.Random, k: int, pool: tuple[str, ...]) -> list[str]:
    while True:
        types = rng.sample(pool, k)
        if sum(t in LOOSE for t in types) > 1:
            continue
        if not any(frozenset((a, b)) in CONFLICTS for i, a in enumerate(types) for b in types[i + 1:]):
            return types


def _quote_list(ws: list[str]) -> str:
    q = [f'"{w}"' for w in ws]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " and " + q[-1]


def _phrase(c: dict) -> str:
    """The instruction that asks for constraint `c`."""
    t = c["type"]
    if t == "include_keywords":
        return f"Use the word{'s' if len(c['keywords']) > 1 else ''} {_quote_list(c['keywords'])}."
    if t == "exclude_keywords":
        return f"Do not use the word{'s' if len(c['keywords']) > 1 else ''} {_quote_list(c['keywords'])}."
    if t == "keyword_frequency":
        return f"Use the word \"{c['keyword']}\" {c['relation']} {c['n']} times."
    if t == "word_count":
        return f"Use {c['relation']} {c['n']} words."
    if t == "sentence_count":
        return f"Write {c['relation']} {c['n']} sentence{'s' if c['n'] != 1 else ''}."
    if t == "bullets":
        return f"Use exactly {c['n']} bullet points."
    if t in ("start_with", "end_with"):
        dot = "" if c["phrase"][-1:] in ".?!" else "."
        return f"{'Start' if t == 'start_with' else 'End'} with \"{c['phrase']}\"{dot}"
    return {
        "lowercase": "Use only lowercase letters.",
        "uppercase": "Write in capital letters only.",
        "json": "Answer in JSON.",
        "no_commas": "Do not use commas.",
        "quotation": "Wrap your answer in double quotes.",
    }[t]


def _count_constraint(rng: random.Random, kind: str, value: int, **extra) -> dict:
    """A count constraint that `value` meets: at least / at most a nearby number, or
    exactly. "at least" only with n >= 2: "at least 1" is met by any answer at all."""
    relation = rng.choice(("at least", "at most", "exactly") if value >= 2 else ("at most", "exactly"))
    if relation == "at least":
        n = max(2, value - rng.randint(0, 2))
    elif relation == "at most":
        n = value + rng.randint(0, 3)
    else:
        n = value
    return {"type": kind, **extra, "relation": relation, "n": n}


def _problem(rng: random.Random, difficulty: int) -> tuple[str, str, list[dict]]:
    """(prompt text, reference completion, constraints)."""
    k, pool = _config(difficulty)
    types = _draw_types(rng, k, pool)
    topic = rng.choice(sorted(TOPICS))
    noun, adjectives = TOPICS[topic]
    subject = topic[0].upper() + topic[1:]
    if "bullets" in types:
        n_sent = rng.randint(2, 3)
    elif "keyword_frequency" in types:
        n_sent = 2  # the topic noun is in every sentence: used twice
    else:
        n_sent = rng.randint(1, 2)
    adjs = rng.sample(adjectives, n_sent + 1)
    used, spare = adjs[:n_sent], adjs[n_sent]
    sentences = [rng.choice(TEMPLATES).format(S=subject, a=a) for a in used]

    # format
    if "bullets" in types:
        text = "\n".join("- " + s for s in sentences)
    elif "json" in types:
        text = json.dumps({"answer": " ".join(sentences)})
    elif "quotation" in types:
        text = '"' + " ".join(sentences) + '"'
    else:
        text = " ".join(sentences)
    # frame
    sep = "\n" if "bullets" in types else " "
    start = rng.choice(START_PHRASES) if "start_with" in types else None
    end = rng.choice(END_PHRASES) if "end_with" in types else None
    if start:
        text = f"{start}.{sep}{text}"
    if end:
        text = f"{text}{sep}{end}"
    # case
    if "uppercase" in types:
        text = text.upper()
    elif "lowercase" in types:
        text = text.lower()

    constraints: list[dict] = []
    for t in types:
        if t == "include_keywords":
            c = {"type": t, "keywords": rng.sample(used, rng.randint(1, min(2, len(used))))}
        elif t == "exclude_keywords":
            c = {"type": t, "keywords": [spare]}
        elif t == "keyword_frequency":
            c = _count_constraint(rng, t, count_keyword(text, noun), keyword=noun)
            if c["relation"] == "at most":  # "at most" a word is met by leaving it out: ask for "at least"
                c = {"type": t, "keyword": noun, "relation": "at least", "n": count_keyword(text, noun)}
        elif t == "word_count":
            c = _count_constraint(rng, t, len(words(text)))
        elif t == "sentence_count":
            c = _count_constraint(rng, t, count_sentences(text))
        elif t == "bullets":
            c = {"type": t, "n": n_sent}
        elif t == "start_with":
            c = {"type": t, "phrase": start}
        elif t == "end_with":
            c = {"type": t, "phrase": end}
        else:
            c = {"type": t}
        constraints.append(c)
    prompt = rng.choice(ASKS).format(t=topic) + " " + " ".join(_phrase(c) for c in constraints)
    return prompt, text, constraints


def _problems(split: str, n: int, seed: int, difficulty: int, stream: str = "tasks") -> list[tuple[str, str, list[dict]]]:
    _config(difficulty)
    rng = random.Random(f"mopd/{DOMAIN}/{stream}/{split}/{seed}/{difficulty}")  # str seeds are stable
    out = []
    seen: set[str] = set()
    for _ in range(n):
        fallback = None  # prefer unseen prompts; a split with fewer than n repeats some
        for _attempt in range(200):
            p = _problem(rng, difficulty)
            if _split_of(p[0]) != split:
                continue
            fallback = p
            if p[0] not in seen:
                break
        else:
            if fallback is None:
                raise RuntimeError(f"instruction_following: could not draw a {split} problem")
            p = fallback
        seen.add(p[0])
        out.append(p)
    return out


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1,
                 effort: str | None = None) -> datasets.Dataset:
    """Procedural constrained-writing tasks. Columns: prompt (one user message),
    completion (the reference), domain, constraints (JSON string)."""
    check_split_n_effort(DOMAIN, split, n, effort)
    rows = _problems(split, n, seed, difficulty)
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for p, _, _ in rows],
        "completion": [[{"role": "assistant", "content": r}] for _, r, _ in rows],
        "domain": [DOMAIN] * len(rows),
        "constraints": [json.dumps(c) for _, _, c in rows],
    })


# ------------------------------------------------------------------- corrupt / pretrain

def _text_of(reference) -> str:
    if isinstance(reference, str):
        return reference
    if isinstance(reference, list) and reference and isinstance(reference[-1], dict):
        return str(reference[-1].get("content", ""))
    return str(reference)


def _unwrap(text: str) -> str:
    """Plain prose from a formatted reference: JSON value, quotes and bullets removed."""
    t = text.strip()
    try:
        v = json.loads(t)
        if isinstance(v, dict):
            t = " ".join(str(x) for x in v.values())
        elif isinstance(v, list):
            t = " ".join(str(x) for x in v)
    except ValueError:
        pass
    if len(t) >= 2 and t[0] == '"' and t[-1] == '"':
        t = t[1:-1]
    return " ".join(re.sub(r"^\s*[-*]\s+", "", line) for line in t.splitlines() if line.strip())


def _replace_word(text: str, word: str, new: str) -> str:
    return re.sub(r"(?<![A-Za-z0-9])" + re.escape(word) + r"(?![A-Za-z0-9])", new, text, flags=re.I)


def _break(text: str, c: dict, rng: random.Random) -> str:
    """`text` changed so that it no longer meets constraint `c` (when that is possible)."""
    t = c["type"]
    filler = rng.choice(FILLERS)
    if t == "lowercase":
        return text[:1].upper() + text[1:] if text[:1].isalpha() else "It " + text
    if t == "uppercase":
        return text.lower()
    if t == "include_keywords":
        return _replace_word(text, c["keywords"][0], filler)
    if t == "exclude_keywords":
        return f"{text} It is {c['keywords'][0]}."
    if t == "keyword_frequency":
        return _replace_word(text, c["keyword"], "thing") if c["relation"] != "at most" else \
            f"{text} " + " ".join([c["keyword"]] * (c["n"] + 1)) + "."
    if t in ("word_count", "sentence_count"):
        count = len(words(text)) if t == "word_count" else count_sentences(text)
        rel, n = c["relation"], c["n"]
        if rel == "at least" or (rel == "exactly" and count > n):
            if t == "word_count":
                keep = max(0, n - 1)
                return " ".join(text.split()[:keep])
            return re.sub(r"[.!?]+\s+", " ", text)  # fewer sentences: join them
        extra = max(1, n - count + 1)
        if t == "word_count":
            return text + " " + " ".join([filler] * extra)
        return text + " " + " ".join(["It is " + filler + "."] * extra)
    if t == "json":
        return "Answer: " + text
    if t == "bullets":
        return re.sub(r"(?m)^\s*[-*]\s+", "", text)
    if t == "start_with":
        return "So " + text
    if t == "end_with":
        return text + " " + filler.capitalize() + "."
    if t == "no_commas":
        return text.replace(" ", ", ", 1) if " " in text else text + ","
    if t == "quotation":
        return text.strip().strip('"')
    return text


def corrupt(row: dict, reference, rng: random.Random) -> str:
    """A plausible but wrong completion made from the reference: the same sentences as
    plain prose, changed until it breaks every constraint it can (keywords swapped for
    fillers, counts pushed past their bound, phrases and case changed). It always breaks
    at least one, so it scores below 1, and ~0 in practice."""
    text = _text_of(reference)
    try:
        constraints = json.loads(row["constraints"]) if isinstance(row.get("constraints"), str) \
            else list(row.get("constraints") or [])
    except (ValueError, TypeError):
        return "So " + text
    out = _unwrap(text)
    for _round in range(4):
        met = [c for c in constraints if check(out, c)]
        if not met:
            break
        for c in met:
            if check(out, c):
                out = _break(out, c, rng)
    if out.strip() and constraints and score_text(out, constraints) >= 1.0:
        out = "So " + _unwrap(text) + " Fine."  # cannot happen with the generator's constraints
    return out


def _plain(rng: random.Random, topic: str) -> str:
    subject = topic[0].upper() + topic[1:]
    return " ".join(rng.choice(TEMPLATES).format(S=subject, a=rng.choice(FILLERS)) for _ in range(rng.randint(1, 2)))


def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows in the domain's format that do not solve it (domain="pretrain"), for the
    shared tiny base: unconstrained "Write about X." prompts answered with plain
    sentences, and constrained prompts (train split) answered with the corrupted
    reference, prose of the right shape that breaks the constraints."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"instruction_following: n must be an int >= 0, got {n!r}")
    rng = random.Random(f"mopd/{DOMAIN}/pretrain/{seed}")
    problems = (_problems("train", n // 2, seed, 1, stream="pretrain")
                + _problems("train", n - n // 2, seed, 2, stream="pretrain"))
    rng.shuffle(problems)
    prompts, completions = [], []
    for prompt, reference, constraints in problems:
        if rng.random() < 0.5:
            topic = rng.choice(sorted(TOPICS))
            prompts.append([{"role": "user", "content": rng.choice(ASKS).format(t=topic)}])
            completions.append([{"role": "assistant", "content": _plain(rng, topic)}])
        else:
            prompts.append([{"role": "user", "content": prompt}])
            completions.append([{"role": "assistant",
                                 "content": corrupt({"constraints": json.dumps(constraints)}, reference, rng)}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n})
