"""The loop's per-step metrics: per-domain sums reduced over ranks, then divided, so
every key means the same with one process or eight. Keys are `<name>/<domain>`
(docs/metrics.md lists them)."""
from __future__ import annotations

import torch
import torch.distributed
from rich.console import Console
from rich.table import Table

from mopd.distill import loss as L
from mopd.distill.agents import AGE_BUCKETS, STALE_SUMS
from mopd.distill.step import StepResult

# Column order of the per-domain sums (one row per domain) and maxima.
_SUMS = ("tok", "seqs", "kl", "mm_abs", "mm_k3", "is_ratio", "is_masked", "is_truncated", "task_reward",
         "tok_on", "seqs_on", "fixed")


def step_metrics(accelerator, res: StepResult, *, domains: list[str], row_domains: list[str], off: list[bool],
                 n_fixed: list[int], task_reward_B: torch.Tensor, is_truncation: float,
                 task_reward_on: bool, corrected_domains: set[str]) -> dict[str, float]:
    """Metrics of one optimizer step whose minibatch rows have domains `row_domains`,
    teacher-forced flags `off` and teacher-token counts `n_fixed`."""
    world = accelerator.num_processes
    mask, isw = res.mask_BT, res.isw
    off_B = torch.tensor(off, dtype=torch.bool)
    sums, maxes = [], []
    for d in domains:
        in_d = torch.tensor([x == d for x in row_domains], dtype=torch.float32)
        dm = in_d.unsqueeze(1) * mask
        tok = dm.sum()
        dm_on = dm * (~off_B).float().unsqueeze(1) * (~res.inserted_BT).float()  # the student's own tokens only
        on_d = in_d * (~off_B).float()
        fixed_d = torch.tensor([float(k > 0) for k in n_fixed]) * on_d
        mm = L.mismatch_stats(res.trainer_lp_BT, res.sampler_lp_BT, dm_on)
        sums.append(torch.stack([
            tok, in_d.sum(), (res.kl_log_BT * dm_on).sum(), mm["abs_sum"], mm["k3_sum"],
            (isw.ratio_BT * dm).sum(), ((1 - isw.keep_BT) * dm).sum(),
            ((isw.ratio_BT > is_truncation).float() * dm).sum(), (task_reward_B * in_d).sum(),
            dm_on.sum(), on_d.sum(), fixed_d.sum(),
        ]))
        # max over an empty domain is 0 (no `if tok > 0`: that reads the device once per domain)
        maxes.append(torch.stack([mm["abs_max"], torch.cat([(isw.ratio_BT * dm).flatten(), dm.new_zeros(1)]).max()]))
    S = accelerator.reduce(torch.stack(sums).detach().float(), reduction="sum")
    M = torch.stack(maxes).detach().float()
    if world > 1:
        torch.distributed.all_reduce(M, op=torch.distributed.ReduceOp.MAX)
    m: dict[str, float] = {}
    S, M = S.tolist(), M.tolist()   # one read each for every domain's numbers
    for j, d in enumerate(domains):
        s = dict(zip(_SUMS, S[j]))
        if s["tok"] == 0:
            continue
        if s["tok_on"] > 0:   # KL and sampler mismatch: the student's own tokens only
            m[f"reverse_kl/{d}"] = s["kl"] / s["tok_on"]
            m[f"mismatch/abs_mean/{d}"] = s["mm_abs"] / s["tok_on"]
            m[f"mismatch/abs_max/{d}"] = M[j][0]
            m[f"mismatch/k3/{d}"] = s["mm_k3"] / s["tok_on"]
        m[f"is/ratio_mean/{d}"] = s["is_ratio"] / s["tok"]
        m[f"is/ratio_max/{d}"] = M[j][1]
        m[f"is/masked_frac/{d}"] = s["is_masked"] / s["tok"]
        m[f"is/truncated_frac/{d}"] = s["is_truncated"] / s["tok"]
        m[f"response_len/{d}"] = s["tok"] / max(s["seqs"], 1)
        if task_reward_on:
            m[f"task_reward/{d}"] = s["task_reward"] / max(s["seqs"], 1)
        if d in corrected_domains and s["seqs_on"] > 0:
            # share of the student's samples that needed at least one teacher token
            m[f"corrected_frac/{d}"] = s["fixed"] / s["seqs_on"]
    return m


TURN_BUCKETS = ("0", "1", "2", "3", "4plus")   # reverse_kl/<domain>/turn_<k> (MLflow refuses "+" in a key)


def turn_kl_metrics(accelerator, res: StepResult, *, turn_ids: list[list[int] | None], row_domains: list[str],
                    agent_domains: list[str]) -> dict[str, float]:
    """Reverse KL per token of each agent domain by the turn the student wrote it in
    (`reverse_kl/<domain>/turn_<k>`, k = 0..3 and 4plus): does the student drift from its
    teacher later in an episode? Over the student's tokens only (res.mask_BT)."""
    B, T = res.mask_BT.shape
    turn_BT = torch.full((B, T), -1, dtype=torch.long)
    for i, t in enumerate(turn_ids):
        if t is None:
            t = [0] * int(res.mask_BT[i].sum().item())
        turn_BT[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
    bucket_BT = turn_BT.clamp(max=len(TURN_BUCKETS) - 1)
    kl_BT = res.kl_log_BT.detach().float()
    sums = torch.zeros((len(agent_domains), len(TURN_BUCKETS), 2))
    for j, d in enumerate(agent_domains):
        in_d = torch.tensor([x == d for x in row_domains], dtype=torch.float32).unsqueeze(1) * res.mask_BT
        for k in range(len(TURN_BUCKETS)):
            m = in_d * ((bucket_BT == k) & (turn_BT >= 0)).float()
            sums[j, k, 0], sums[j, k, 1] = (kl_BT * m).sum(), m.sum()
    S = accelerator.reduce(sums, reduction="sum")
    return {f"reverse_kl/{d}/turn_{k}": S[j, n, 0].item() / S[j, n, 1].item()
            for j, d in enumerate(agent_domains) for n, k in enumerate(TURN_BUCKETS) if S[j, n, 1] > 0}


_EPISODE_SUMS = ("episodes", "turns", "tokens", "env_errors", "failed_calls", "success", "cut", "reward", "transcript")


def episode_metrics(accelerator, episodes: list, agent_domains: list[str]) -> dict[str, float]:
    """Per agent domain, over the sampled batch's episodes (`(domain, Episode)` pairs) of all
    ranks: turns and student tokens per episode, share ending in an environment error,
    failed tool calls per episode, share succeeded, share cut (max_turns or
    max_context_tokens), mean episode reward; and the batch's total transcript tokens
    (`agent/transcript_tokens/<d>`: prompt, observations and student tokens of every
    segment, i.e. what a teacher forward reads), which compute budgets need."""
    sums = torch.zeros((len(agent_domains), len(_EPISODE_SUMS)))
    for d, e in episodes:
        if d in agent_domains:
            sums[agent_domains.index(d)] += torch.tensor([
                1.0, e.turns, e.student_tokens, float(e.env_error is not None), e.failed_calls, float(e.success),
                float(e.cut is not None), e.reward,
                float(sum(len(s.prompt_ids) + len(s.completion_ids) for s in e.segments))])
    S = accelerator.reduce(sums, reduction="sum")
    m: dict[str, float] = {}
    for j, d in enumerate(agent_domains):
        s = dict(zip(_EPISODE_SUMS, S[j].tolist()))
        if s["episodes"] == 0:
            continue
        n = s["episodes"]
        m.update({f"agent/turns/{d}": s["turns"] / n, f"agent/tokens_per_episode/{d}": s["tokens"] / n,
                  f"agent/env_errors/{d}": s["env_errors"] / n, f"agent/failed_calls/{d}": s["failed_calls"] / n,
                  f"agent/success/{d}": s["success"] / n, f"agent/cut/{d}": s["cut"] / n,
                  f"agent/reward/{d}": s["reward"] / n, f"agent/transcript_tokens/{d}": s["transcript"]})
    return m


def partial_metrics(accelerator, stats: dict[str, list[float]], carried: dict[str, int],
                    partial_domains: list[str]) -> dict[str, float]:
    """Per partial-rollout domain, once per sampled batch over all ranks: episodes carried
    over to the next step (`agent/carried_over/<d>`), and over the student tokens of the
    episodes trained now, their mean age in weights versions at their update
    (`agent/token_age_mean/<d>`), the share of each age (`agent/token_age/<d>/age_<k>`,
    k = 0, 1, 2, 3plus) and the share masked for being older than loss.max_staleness
    (`agent/stale_masked_share/<d>`)."""
    names = (*STALE_SUMS, "carried")
    sums = torch.zeros((len(partial_domains), len(names)))
    for j, d in enumerate(partial_domains):
        sums[j] = torch.tensor([*stats.get(d, [0.0] * len(STALE_SUMS)), float(carried.get(d, 0))])
    S = accelerator.reduce(sums, reduction="sum")
    m: dict[str, float] = {}
    for j, d in enumerate(partial_domains):
        s = dict(zip(names, S[j].tolist()))
        m[f"agent/carried_over/{d}"] = s["carried"]
        if s["tokens"] == 0:
            continue
        m[f"agent/token_age_mean/{d}"] = s["age"] / s["tokens"]
        m[f"agent/stale_masked_share/{d}"] = s["masked"] / s["tokens"]
        for k in AGE_BUCKETS:
            m[f"agent/token_age/{d}/age_{k}"] = s[f"age_{k}"] / s["tokens"]
    return m


def reference_metrics(accelerator, res: StepResult, off: list[bool]) -> dict[str, float]:
    """Share of teacher-forced rows, and of the trained tokens those in the student's own samples."""
    off_B = torch.tensor(off, dtype=torch.bool)
    n = accelerator.reduce(torch.tensor([float(off_B.sum()), float(len(off_B)),
                                         float((res.mask_BT * (~off_B).float().unsqueeze(1)).sum())]),
                           reduction="sum")
    return {"off_policy_frac": n[0].item() / max(n[1].item(), 1.0), "tokens/on_policy": n[2].item()}


def batch_metrics(accelerator, *, n_gen: int, seconds: dict[str, float], correction_on: bool) -> dict[str, float]:
    """Sampling and teacher time of one sampled batch, averaged over ranks."""
    world = accelerator.num_processes
    tot = accelerator.reduce(torch.tensor([float(n_gen), seconds["sample"], seconds["teacher"], seconds["correct"]]),
                             reduction="sum")
    tot = tot.tolist()
    m = {"time/sample_s": tot[1] / world, "time/teacher_s": tot[2] / world}
    if correction_on:   # re-sampling and re-scoring the corrected rows
        m["time/correct_s"] = tot[3] / world
    m["tokens_per_s/sample"] = tot[0] / max(tot[1] / world, 1e-9)
    m["tokens_per_s/teacher"] = tot[0] / max(tot[2] / world, 1e-9)
    return m


def print_table(history: list[dict], domains: list[str]):
    """First and last reverse KL per domain, sampler/trainer mismatch, response length."""
    if not history:
        return
    k = min(5, len(history))
    t = Table(title=f"MOPD: {len(history)} steps")
    for c in ("domain", "reverse KL first", "reverse KL last", "|Δ log p| sampler/trainer", "resp len"):
        t.add_column(c)

    def avg(rows, key):
        x = [h[key] for h in rows if key in h]
        return f"{sum(x) / len(x):.4f}" if x else "-"

    for d in domains:
        t.add_row(d, avg(history[:k], f"reverse_kl/{d}"), avg(history[-k:], f"reverse_kl/{d}"),
                  avg(history[-k:], f"mismatch/abs_mean/{d}"), avg(history[-k:], f"response_len/{d}"))
    Console(stderr=True).print(t)
