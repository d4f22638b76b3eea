"""Partial rollouts' bookkeeping, shared by the MOPD loop (mopd/distill/agents.py) and the
agent experts' multi-turn GRPO (core/agent/grpo.py, experts/agent_expert.py).

A step that does not wait for its slowest episodes trains on the ones that ended and
continues the others at the next step with newer weights. Every student token keeps the
weights version that sampled it (`Episode.versions`) and its sampler log-prob, so the
trainer can (1) weight it by the truncated importance ratio trainer / sampler, which
corrects for the weights having moved since, and (2) drop it (`mask_stale`: loss mask 0)
when it is more than `max_staleness` versions old, where that correction is too noisy
to trust.

`stop_rule` is when a step stops waiting: once `need` units ended (episodes in MOPD, whole
GRPO groups in the RL stage) or `max_tokens` student tokens were sampled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from core.config import option

AGE_BUCKETS = ("0", "1", "2", "3plus")   # .../token_age/.../age_<k> (MLflow refuses "+")
STALE_SUMS = ("tokens", "age", "masked", *(f"age_{k}" for k in AGE_BUCKETS))


@dataclass
class AgentRLPartial:
    """Partial rollouts in an agent expert's RL stage (`agent.partial` of its recipe)."""
    enabled: bool = option("true: a step stops waiting for its episodes at min_finished / max_tokens and "
                           "carries the unfinished GRPO groups over; false (the default): every episode of a "
                           "step is played to its end before the update", False)
    min_finished: float = option(
        "a step stops playing once this share of its GRPO groups (carried over + new) has ended, every "
        "episode of the group; a group is scored (its advantages need all its rewards) and trained only then",
        1.0)
    max_tokens: int = option("a step also stops playing once it sampled this many tokens (0: no budget)", 0)
    max_staleness: int = option("tokens sampled more than this many weights versions before the update they "
                                "train in get no loss", 2)
    is_truncation: float = option("C in min(p_trainer / p_sampler, C): the importance weight of each token "
                                  "(corrects for the weights having moved since it was sampled)", 2.0)

    def validate(self):
        if not (math.isfinite(self.min_finished) and 0.0 < self.min_finished <= 1.0):
            raise ValueError(f"partial.min_finished must be in (0, 1] (a share of the step's groups), "
                             f"got {self.min_finished}")
        if self.max_tokens < 0:
            raise ValueError(f"partial.max_tokens must be >= 0, got {self.max_tokens}")
        if self.max_staleness < 0:
            raise ValueError(f"partial.max_staleness must be >= 0, got {self.max_staleness}")
        if not (math.isfinite(self.is_truncation) and self.is_truncation > 0):
            raise ValueError(f"partial.is_truncation must be > 0, got {self.is_truncation}")


def need_finished(min_finished: float, n: int) -> int:
    """How many of `n` units must end before a step stops waiting (at least one)."""
    return max(1, math.ceil(min_finished * n - 1e-9)) if n else 0


def stop_rule(need: int, max_tokens: int):
    """`stop_when(ended, total, tokens)` for `core.agent.episode.play`."""
    def stop(ended: int, total: int, n_tok: int) -> bool:
        return ended >= need or (max_tokens > 0 and n_tok >= max_tokens)
    return stop


def mask_stale(samples: list, versions: list, row_domains: list[str], trained_at: list[int], max_staleness: int,
               domains: list[str]) -> tuple[list, dict[str, list[float]]]:
    """Rows whose tokens carry weights versions (`versions[j]`, None: not tracked): a
    student token trained with the weights of step `trained_at[j]` is that many minus
    its version steps old; older than `max_staleness` it gets loss mask 0 (a copy of the
    row's sample; the episode is not changed). Returns the samples and, per domain in
    `domains`, the sums STALE_SUMS over the student's tokens."""
    stats = {d: [0.0] * len(STALE_SUMS) for d in domains}
    out = list(samples)
    for j, v in enumerate(versions):
        if v is None or row_domains[j] not in stats:
            continue
        s, smp = stats[row_domains[j]], samples[j]
        mask, changed = list(smp.loss_mask), False
        for k, (m, ver) in enumerate(zip(smp.loss_mask, v)):
            if not m or ver < 0:
                continue
            age = trained_at[j] - ver
            s[0] += 1
            s[1] += age
            s[3 + min(age, len(AGE_BUCKETS) - 1)] += 1
            if age > max_staleness:
                s[2] += 1
                mask[k], changed = 0, True
        if changed:
            out[j] = replace(smp, loss_mask=mask)
    return out, stats


def age_metrics(sums: list[float], prefix: str = "") -> dict[str, float]:
    """Mean token age, the share of each age bucket and the share masked as stale, from
    one domain's STALE_SUMS (nothing when no token was counted)."""
    s = dict(zip(STALE_SUMS, sums))
    if not s["tokens"]:
        return {}
    m = {f"{prefix}token_age_mean": s["age"] / s["tokens"], f"{prefix}stale_masked_share": s["masked"] / s["tokens"]}
    m.update({f"{prefix}token_age/age_{k}": s[f"age_{k}"] / s["tokens"] for k in AGE_BUCKETS})
    return m
