"""One optimizer step of the loop on one minibatch of scored samples.

The student's log-probs of its samples, the dense reward r_t = log p_T(y_t) - log p_S(y_t)
(or, with loss.kl=full, the exact divergence over the vocabulary), an importance
correction for the sampler/trainer gap, backward, clip, step. What the metrics need
comes back in a `StepResult`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mopd.distill import loss as L
from mopd.distill.config import LossConfig
from mopd.models import collate, completion_logprobs


@dataclass
class StepResult:
    loss: torch.Tensor           # this rank's loss (times world: DDP averages over ranks)
    grad_norm: float
    mask_BT: torch.Tensor        # completion tokens the student wrote (observations masked out)
    trainer_lp_BT: torch.Tensor
    sampler_lp_BT: torch.Tensor  # after filling teacher-forced rows and teacher-inserted tokens
    kl_log_BT: torch.Tensor      # the logged reverse KL per token (against the teacher itself)
    isw: object                  # loss.ImportanceWeights
    inserted_BT: torch.Tensor    # tokens the teacher inserted (rollout.correct_below)
    n_tok_global: float          # completion tokens of the minibatch over all ranks


def pad_full(rows: list[torch.Tensor], T: int, V: int) -> torch.Tensor:
    """Teacher full log-prob rows [len_i, V'] -> [B, T, V]; padding positions are
    masked out of the loss, extra vocabulary columns (V > V') get -inf (p_T = 0)."""
    out = torch.zeros((len(rows), T, V))
    for i, r in enumerate(rows):
        if r is None or not len(r):
            continue
        n, v = r.shape
        out[i, :n, :min(v, V)] = r[:, :V]
        if v < V:   # a top-k row (-inf outside its tokens) keeps the extra columns outside too
            out[i, :n, v:] = float("-inf") if torch.isneginf(r).any() else -1e9
    return out


def restrict_to_support(trainer_BTV: torch.Tensor, teacher_BTV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k teachers (`top_k` > 0) give log-probs on their k most likely tokens and -inf
    elsewhere: the divergence is then taken over those tokens, the student's distribution
    renormalized on the same set (top-k distillation). Rows without -inf are unchanged.
    Outside the support both sides get -1e9 (probability 0, finite differences, no NaN)."""
    out_BTV = torch.isneginf(teacher_BTV)
    if not out_BTV.any():
        return trainer_BTV, teacher_BTV
    s_BTV = torch.log_softmax(trainer_BTV.masked_fill(out_BTV, float("-inf")), dim=-1)
    # a row with no -inf at all is a full distribution: its student log-probs stay as they were
    full_BT = ~out_BTV.any(-1, keepdim=True)
    s_BTV = torch.where(full_BT, trainer_BTV, s_BTV).masked_fill(out_BTV, -1e9)
    return s_BTV, teacher_BTV.masked_fill(out_BTV, -1e9)


def train_step(accelerator, model, optimizer, scheduler, *, loss_cfg: LossConfig, grad_clip: float,
               prompt_ids: list[list[int]], samples: list, teacher_lp: list, teacher_full: list,
               off_B: torch.Tensor, task_reward_B: torch.Tensor, domain_ids_B: torch.Tensor, n_domains: int,
               pad_id: int) -> StepResult:
    """One update on a minibatch: `samples[i]` answers `prompt_ids[i]`; rows with off_B
    set are teacher-forced references (no sampler, importance weight 1)."""
    world = accelerator.num_processes
    full_kl = loss_cfg.kl == "full"
    # Agent transcripts: only the tokens the student wrote carry loss (observations are masked).
    batch = collate(prompt_ids, [s.completion_ids for s in samples], pad_id,
                    {"sampler_lp": [s.sampler_logprobs for s in samples], "teacher_lp": teacher_lp},
                    token_mask=[s.loss_mask for s in samples])
    mask = batch["mask"]
    n_tok = torch.tensor([mask.sum().item()])
    n_tok_global = accelerator.reduce(n_tok.clone(), reduction="sum").item()
    if full_kl:
        trainer_lp, trainer_full = completion_logprobs(model, batch, full=True)
        teacher_raw_BTV = pad_full(teacher_full, mask.shape[1], trainer_full.shape[-1])
        teacher_full_BTV = L.sharpen(teacher_raw_BTV, loss_cfg.teacher_temperature)
        trainer_full, teacher_raw_BTV = restrict_to_support(trainer_full, teacher_raw_BTV)
        if teacher_full_BTV is not teacher_raw_BTV:
            teacher_full_BTV = teacher_full_BTV.masked_fill(torch.isneginf(teacher_full_BTV), -1e9)
        else:
            teacher_full_BTV = teacher_raw_BTV
    else:
        trainer_lp = completion_logprobs(model, batch)
    if off_B.any():  # teacher-forced rows: no sampler, no importance correction
        batch["sampler_lp"][off_B] = trainer_lp.detach()[off_B]
    ins_BT = torch.isnan(batch["sampler_lp"])   # tokens the teacher inserted (correct_below)
    if ins_BT.any():
        batch["sampler_lp"] = torch.where(ins_BT, trainer_lp.detach(), batch["sampler_lp"])
    rew = L.token_rewards(batch["teacher_lp"], trainer_lp, mask)
    # With loss.kl=full the KL term is exact and the advantages carry only the task reward.
    adv = L.discounted_returns(rew, mask, loss_cfg.discount) if not full_kl else torch.zeros_like(rew)
    if loss_cfg.task_reward_alpha > 0:
        adv = adv + loss_cfg.task_reward_alpha * task_reward_B.unsqueeze(1) * mask
    if loss_cfg.baseline == "domain_mean":
        # Per-domain token mean over the global minibatch, so ranks agree.
        onehot_BD = torch.nn.functional.one_hot(domain_ids_B, n_domains).float()
        sums = torch.stack([(adv * mask).sum(1) @ onehot_BD, mask.sum(1) @ onehot_BD])
        sums = accelerator.reduce(sums, reduction="sum")
        mean_D = sums[0] / sums[1].clamp(min=1)
        adv = L.subtract_baseline(adv, mask, (onehot_BD @ mean_D))
    isw = L.importance_weights(trainer_lp, batch["sampler_lp"], mask, loss_cfg.is_truncation,
                               loss_cfg.is_mask_low, loss_cfg.is_mask_high)
    loss = L.policy_gradient_loss(trainer_lp, adv, isw.weights_BT, n_tok_global) * world
    # The logged reverse KL per token: exact over the vocabulary when the teacher's whole
    # distribution is at hand (the one-sample estimate -rew is biased once samples are
    # drawn below temperature 1 or corrected), against the teacher itself.
    kl_log_BT = -rew.detach()
    if full_kl:
        kl_BT = L.full_divergence(trainer_full, teacher_full_BTV, mask, loss_cfg.beta)
        loss = loss + L.full_kl_loss(kl_BT, isw.weights_BT, n_tok_global) * world
        # the loss term is already that KL when it is the reverse KL to the unsharpened teacher
        kl_log_BT = (kl_BT.detach() if loss_cfg.beta == 1.0 and teacher_full_BTV is teacher_raw_BTV
                     else L.full_reverse_kl(trainer_full.detach(), teacher_raw_BTV, mask))
    accelerator.backward(loss)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip) \
        if grad_clip > 0 else torch.tensor(0.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss, grad_norm=float(grad_norm), mask_BT=mask, trainer_lp_BT=trainer_lp,
                      sampler_lp_BT=batch["sampler_lp"], kl_log_BT=kl_log_BT, isw=isw, inserted_BT=ins_BT,
                      n_tok_global=n_tok_global)
