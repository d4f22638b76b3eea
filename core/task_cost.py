"""What an eval task costs, beside its score: completion tokens per task and, for agent
episodes, turns and tool calls per episode, each summarized as mean and 90th percentile.

A task's completion tokens are the token ids the model generated for it, up to and
including the first EOS (what vLLM and OpenAI-style APIs bill as completion tokens): the
prompt and the batch's left padding were not generated, and a row that stopped at its EOS
generated nothing after it. Counted in the tokenizer's ids, never in characters.

The one greedy decoding path (core.rollout.greedy_texts) reports each completion's count
to the recorder that `record_tokens()` opened, if any, so the eval runner gets the counts
of every domain whose suite decodes through it (every built-in single-turn domain, and a
team's that uses core.evaluate) without each suite passing them on. Agent episodes count
their own (core.agent.episode.Episode: student_tokens, turns, calls): `episode_cost`.

The 90th percentile is the nearest-rank one: the smallest observed value with at least 90%
of the tasks at or below it (sorted values, index ceil(0.9 n) - 1), so it is always a count
some task really took.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

_RECORDER: ContextVar[list[int] | None] = ContextVar("completion_token_counts", default=None)


def completion_tokens(ids: Sequence[int], eos: Iterable[int]) -> int:
    """Generated tokens of one completion: up to and including its first EOS id, all of them
    when it was cut by the token budget before any EOS."""
    eos = set(eos)
    cut = next((k for k, t in enumerate(ids) if t in eos), None)
    return len(ids) if cut is None else cut + 1


@contextmanager
def record_tokens() -> Iterator[list[int]]:
    """Collect the completion-token count of every greedy completion decoded inside the
    block (one int per task, in decoding order); an inner block collects its own."""
    counts: list[int] = []
    token = _RECORDER.set(counts)
    try:
        yield counts
    finally:
        _RECORDER.reset(token)


def note_tokens(counts: Iterable[int]) -> None:
    """Report completion-token counts to the open recorder (none open: nothing happens)."""
    rec = _RECORDER.get()
    if rec is not None:
        rec.extend(int(c) for c in counts)


def p90(values: Sequence[float]) -> float | None:
    """Nearest-rank 90th percentile (see the module note); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


def summary(values: Sequence[float]) -> dict | None:
    """{"mean", "p90"} of per-task values; None for no values (nothing was counted)."""
    if not values:
        return None
    return {"mean": sum(values) / len(values), "p90": p90(values)}


def token_cost(counts: Sequence[int]) -> dict:
    """A single-turn column's cost: {"tokens": {"mean", "p90"} | None, "n": tasks counted}."""
    return {"tokens": summary(counts), "n": len(counts)}


def episode_cost(episodes: Sequence) -> dict:
    """An agent column's cost: student tokens, turns and tool calls per episode, each
    {"mean", "p90"} (None without episodes), and "n"; observation tokens are the
    environment's, not the model's, and are left out."""
    return {"tokens": summary([e.student_tokens for e in episodes]),
            "turns": summary([e.turns for e in episodes]),
            "tool_calls": summary([e.calls for e in episodes]),
            "n": len(episodes)}


def cost_metrics(cost: dict[str, dict | None]) -> dict[str, float]:
    """Flat per-column metric keys for MLflow ({column: cost} -> "tokens_mean/math/low",
    "tokens_p90/math/low", "turns_mean/agent", "tool_calls_p90/agent", ...; column "":
    "tokens_mean", for a run that scores one column)."""
    out = {}
    for col, c in cost.items():
        for what in ("tokens", "turns", "tool_calls"):
            s = (c or {}).get(what)
            if s:
                out[f"{what}_mean" + (f"/{col}" if col else "")] = float(s["mean"])
                out[f"{what}_p90" + (f"/{col}" if col else "")] = float(s["p90"])
    return out
