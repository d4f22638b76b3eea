"""Multi-turn GRPO's shared pieces, used by every agent domain's RL stage
(experts/agent_expert.py): the group-normalized advantage of an episode and one clipped
policy-gradient update over the segments its tokens are in (observation tokens masked).

Each domain keeps its own loop (its environment, its oracle, its task sampling); only the
playing of groups and the update are shared, so a fix to them reaches every agent expert.

Partial rollouts (`agent.partial`, core/agent/partial.py): a step plays its GRPO groups
(`play_groups`) until a share of them ended and carries the others over, whole: a group's
advantages need every member's reward, so an ended episode whose group is still playing
waits with it. The carried groups continue first at the next step with the newer weights
(`Group`'s episodes keep their environments); `train_groups` then weights each token by
its truncated importance ratio trainer / sampler and gives no loss to tokens older than
`max_staleness` weights versions.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.agent.episode import LiveEpisode, abandon, play, start_episodes
from core.agent.partial import age_metrics, mask_stale, need_finished, stop_rule
from core.agent.sft import log_metrics, lr_lambda, masked_batch
from core.models import completion_logprobs
from core.rollout import HFRollout, eos_ids


def group_advantages(rewards: list[float], group: int, scale: str) -> list[float]:
    """GRPO's advantage: the episode's reward minus its group's mean, divided by the
    group's std (scale "group", GRPO), by the whole batch's std ("batch", Dr. GRPO's
    remedy for the per-group std's bias) or not at all ("none"). A group where every
    episode scored the same teaches nothing and gets 0."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"rl.scale_rewards must be group, batch or none, got {scale!r}")
    r_all = torch.tensor(rewards, dtype=torch.float32)
    adv = []
    for g in range(0, len(rewards), group):
        r = r_all[g:g + group]
        a = r - r.mean()
        if scale == "group":
            a = a / (r.std(unbiased=False) + 1e-4)
        adv += a.tolist()
    if scale == "batch":
        adv = (torch.tensor(adv) / (r_all.std(unbiased=False) + 1e-4)).tolist()
    return adv


def policy_step(model, opt, tok, rows, *, epsilon: float, grad_clip: float, micro: int = 16,
                is_truncation: float | None = None) -> dict:
    """One clipped policy-gradient update (PPO's clip, GRPO's objective) over `rows`, the
    (segment, advantage) pairs with a nonzero advantage, in micro-batches; the loss is a
    token mean over the whole batch. The ratio is against the sampler's log-probs: 1 up
    to float noise with the HF sampler, which is the policy's own forward.

    With `is_truncation` C (partial rollouts, where a token may come from older weights),
    decoupled PPO instead: the clipped ratio is against the proximal policy (the weights
    now, detached, so it is 1 with the policy's gradient), and each token is weighted by
    min(p_trainer / p_sampler, C), no gradient; for a token of the current weights the
    weight is 1 up to float noise, so the update is the one above."""
    n_tok = sum(sum(s.loss_mask) if s.loss_mask is not None else len(s.completion_ids) for s, _ in rows)
    model.train()
    total, w_sum, w_n = 0.0, 0.0, 0.0
    for i in range(0, len(rows), micro):
        part = rows[i:i + micro]
        segs = [s for s, _ in part]
        masks = [s.loss_mask if s.loss_mask is not None else [1] * len(s.completion_ids) for s in segs]
        batch = masked_batch([(s.prompt_ids, s.completion_ids, mk) for s, mk in zip(segs, masks)], tok.pad_token_id)
        mask = batch["mask"]
        samp = torch.zeros_like(mask)
        for j, s in enumerate(segs):
            samp[j, :len(s.sampler_logprobs)] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
        lp = completion_logprobs(model, batch)
        adv = torch.tensor([a for _, a in part], dtype=torch.float32).unsqueeze(1)
        if is_truncation is None:
            ratio = torch.exp((lp - samp) * mask)
            weight = 1.0
        else:
            prox = lp.detach()
            ratio = torch.exp((lp - prox) * mask)
            weight = torch.exp((prox - samp) * mask).clamp(max=is_truncation) * mask
            w_sum += float(weight.sum())
            w_n += float(mask.sum())
        obj = weight * torch.minimum(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv)
        loss = -(obj * mask).sum() / max(n_tok, 1)
        loss.backward()
        total += float(loss.detach())
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    m = {"loss": total, "grad_norm": float(gn), "segments": float(len(rows))}
    if is_truncation is not None and w_n:
        m["is_weight_mean"] = w_sum / w_n
    return m


# ---------------------------------------------------------------- groups and partial rollouts
@dataclass
class Group:
    """The `G` episodes of one task (a GRPO group), playing or ended; `born` is the step
    that started it."""
    task: dict
    runs: list[LiveEpisode]
    born: int = 0

    @property
    def done(self) -> bool:
        return all(r.done for r in self.runs)


def start_groups(tok, tasks: list[dict], envs: list, seeds: list[int], group: int, *, max_context_tokens: int,
                 max_new_tokens: int, step: int = 0) -> list[Group]:
    """One group of `group` episodes per task: `envs` and `seeds` hold one per episode,
    the episodes of a task next to each other (as `group_advantages` reads them)."""
    if len(envs) != len(tasks) * group or len(seeds) != len(envs):
        raise ValueError(f"start_groups: {len(tasks)} tasks x {group} episodes need as many envs and seeds, "
                         f"got {len(envs)} envs and {len(seeds)} seeds")
    ep_tasks = [t for t in tasks for _ in range(group)]
    runs = start_episodes(tok, envs, ep_tasks, seeds=seeds, max_context_tokens=max_context_tokens,
                          max_new_tokens=max_new_tokens)
    return [Group(t, runs[i * group:(i + 1) * group], step) for i, t in enumerate(tasks)]


def play_groups(rollout, tok, groups: list[Group], *, version: int, temperature: float, top_p: float, max_turns: int,
                max_context_tokens: int, max_new_tokens: int, eos_ids: set[int], min_finished: float = 1.0,
                max_tokens: int = 0) -> tuple[list[Group], list[Group], int]:
    """Play every episode of `groups` (carried-over groups first, as given), all batched,
    with the weights `version`, until `min_finished` of the groups have ended (every
    member) or `max_tokens` were sampled; the defaults play every episode to its end.
    Returns (the groups that ended, those still playing, tokens sampled)."""
    runs = [r for g in groups for r in g.runs]
    need = need_finished(min_finished, len(groups))
    episodes_stop = stop_rule(need, max_tokens)

    def stop(ended: int, total: int, n_tok: int) -> bool:   # counted in whole groups
        return episodes_stop(sum(g.done for g in groups), len(groups), n_tok)

    res = play(rollout, tok, runs, temperature=temperature, top_p=top_p, max_turns=max_turns,
               max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
               version=version, stop_when=stop)
    return [g for g in groups if g.done], [g for g in groups if not g.done], res.tokens


def drop_groups(pool: list[Group]) -> int:
    """Abandon the groups still playing (environments closed, nothing trained); returns
    how many episodes were in flight."""
    n = 0
    for g in pool:
        for r in g.runs:
            n += not r.done
            abandon(r)
    pool.clear()
    return n


def train_groups(model, opt, tok, groups: list[Group], *, scale: str, epsilon: float, grad_clip: float,
                 version: int, max_staleness: int | None = None, is_truncation: float | None = None) -> dict:
    """GRPO on ended groups: advantages within each group, one `policy_step` over the
    segments with a nonzero advantage (none: no update). The weights now are `version`;
    with `max_staleness` (partial rollouts) tokens sampled more versions ago get no
    loss and the metrics count token ages, with `is_truncation` tokens are weighted by
    their truncated importance ratio. Returns the step's metrics; `updated` is 1.0 when
    the optimizer stepped."""
    episodes = [r.ep for g in groups for r in g.runs]
    G = len(groups[0].runs) if groups else 1
    m: dict[str, float] = {"groups": float(len(groups)), "updated": 0.0}
    if not episodes:
        return m
    rewards = [e.reward for e in episodes]
    adv = group_advantages(rewards, G, scale)
    segs = [(seg, ver, adv[i]) for i, e in enumerate(episodes) for seg, ver in zip(e.segments, e.versions)
            if adv[i] != 0.0]
    n = len(episodes)
    m.update({"reward": sum(rewards) / n, "success": sum(e.success for e in episodes) / n,
              "turns": sum(e.turns for e in episodes) / n, "failed_calls": sum(e.failed_calls for e in episodes) / n,
              "env_errors": sum(e.env_error is not None for e in episodes) / n})
    if max_staleness is not None:
        samples, stats = mask_stale([s for s, _, _ in segs], [v for _, v, _ in segs], [""] * len(segs),
                                    [version] * len(segs), max_staleness, [""])
        m.update(age_metrics(stats[""]))
        segs = [(smp, v, a) for smp, (_, v, a) in zip(samples, segs)]
    rows = [(s, a) for s, _, a in segs if any(s.loss_mask)]
    if rows:
        m.update(policy_step(model, opt, tok, rows, epsilon=epsilon, grad_clip=grad_clip,
                             is_truncation=is_truncation))
        m["updated"] = 1.0
    return m


def rl_loop(cfg, model, tok, tasks: list[dict], new_env: Callable[[dict, random.Random], object], label: str):
    """An agent expert's RL stage: `cfg.train.max_steps` steps of multi-turn GRPO on the
    model's own episodes, `cfg.train.batch_size` tasks a step (drawn with a seeded rng),
    `cfg.rl.num_generations` episodes each, `new_env(task, rng)` building each episode's
    environment (its harness drawn from `rng`). With `cfg.agent.partial.enabled` the
    unfinished groups carry over (`play_groups`); the weights version of a step is the
    number of updates before it. Returns the model."""
    r, a, tr = cfg.rl, cfg.agent, cfg.train
    p = getattr(a, "partial", None)
    partial = p is not None and p.enabled
    rng = random.Random(tr.seed)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=tr.lr, weight_decay=tr.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tr.max_steps, tr.warmup_steps, tr.lr_schedule))
    rollout = HFRollout(model, tok, batch_size=max(1, tr.batch_size * r.num_generations))
    eos = eos_ids(tok, getattr(model, "generation_config", None))
    G, t0, version = r.num_generations, time.perf_counter(), 0
    pool: list[Group] = []
    try:
        for step in range(1, tr.max_steps + 1):
            batch_tasks = [tasks[rng.randrange(len(tasks))] for _ in range(tr.batch_size)]
            envs = [new_env(t, rng) for t in batch_tasks for _ in range(G)]
            seeds = [rng.randrange(2**31) for _ in envs]
            groups = pool + start_groups(tok, batch_tasks, envs, seeds, G, max_context_tokens=a.max_context_tokens,
                                         max_new_tokens=a.max_new_tokens, step=step)
            pool = groups   # until play returns: an error closes every environment of the step
            done, pool, n_tok = play_groups(
                rollout, tok, groups, version=version, temperature=r.temperature, top_p=1.0, max_turns=a.max_turns,
                max_context_tokens=a.max_context_tokens, max_new_tokens=a.max_new_tokens, eos_ids=eos,
                min_finished=p.min_finished if partial else 1.0, max_tokens=p.max_tokens if partial else 0)
            m = train_groups(model, opt, tok, done, scale=r.scale_rewards, epsilon=r.epsilon, grad_clip=tr.grad_clip,
                             version=version, max_staleness=p.max_staleness if partial else None,
                             is_truncation=p.is_truncation if partial else None)
            if m.pop("updated"):
                sched.step()
                version += 1
            m["sampled_tokens"] = float(n_tok)
            if partial:
                m["carried_over"] = float(sum(not x.done for g in pool for x in g.runs))
                m["carried_over_groups"] = float(len(pool))
            if step % tr.logging_steps == 0 or step == tr.max_steps:
                print(f"[expert] {label} rl step {step}/{tr.max_steps} reward {m.get('reward', float('nan')):.3f} "
                      f"turns {m.get('turns', float('nan')):.1f}"
                      + (f" carried {len(pool)} groups" if partial else "")
                      + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
            log_metrics(step, m)
    finally:
        n = drop_groups(pool)
        if n:
            print(f"[expert] {label} rl: {n} episode(s) still in flight at the end are dropped (not trained)",
                  flush=True)
    return model


__all__ = ["Group", "drop_groups", "group_advantages", "log_metrics", "play_groups", "policy_step", "rl_loop",
           "start_groups", "train_groups"]
