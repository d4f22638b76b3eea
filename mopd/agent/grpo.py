"""Multi-turn GRPO's shared pieces, used by every agent domain's RL stage
(experts/<domain>/train.py): the group-normalized advantage of an episode and one clipped
policy-gradient update over the segments its tokens are in (observation tokens masked).

Each domain keeps its own loop (its environment, its oracle, its task sampling); only the
update is shared, so a fix to it reaches every agent expert."""
from __future__ import annotations

import mlflow
import torch

from mopd.agent.sft import masked_batch
from mopd.models import completion_logprobs


def log_metrics(step: int, m: dict) -> None:
    """To the active MLflow run, if any (a stage run outside `mopd expert` has none)."""
    if mlflow.active_run() is not None:
        mlflow.log_metrics(m, step=step)


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


def policy_step(model, opt, tok, rows, *, epsilon: float, grad_clip: float, micro: int = 16) -> dict:
    """One clipped policy-gradient update (PPO's clip, GRPO's objective) over `rows`, the
    (segment, advantage) pairs with a nonzero advantage, in micro-batches; the loss is a
    token mean over the whole batch. The ratio is against the sampler's log-probs: 1 up
    to float noise with the HF sampler, which is the policy's own forward."""
    n_tok = sum(sum(s.loss_mask) if s.loss_mask is not None else len(s.completion_ids) for s, _ in rows)
    model.train()
    total = 0.0
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
        ratio = torch.exp((lp - samp) * mask)
        obj = torch.minimum(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv)
        loss = -(obj * mask).sum() / max(n_tok, 1)
        loss.backward()
        total += float(loss.detach())
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"loss": total, "grad_norm": float(gn), "segments": float(len(rows))}
