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
    """Teacher full log-prob rows [len_i, V_i] -> [B, T, V] over the first V token ids, each
    position renormalized over them: a teacher with more rows than V (a padded vocabulary,
    Qwen2.5-7B's 152,064 against 151,936) keeps its distribution over the ids the student
    can produce, never a cut one that sums below 1 (a forward KL below 0). Columns a row
    does not have (V_i < V) and top-k rows' other tokens are -inf (p_T = 0; the divergence
    is -inf-safe). Padding positions are 0 and masked out of the loss."""
    out = torch.zeros((len(rows), T, V))
    for i, r in enumerate(rows):
        if r is None or not len(r):
            continue
        n, v = r.shape
        if v > V:
            r = r[:, :V]
            r = r - torch.logsumexp(r, dim=-1, keepdim=True)
        out[i, :n, :min(v, V)] = r
        if v < V:
            out[i, :n, v:] = float("-inf")
    return out


def over_vocab(trainer_BTV: torch.Tensor, V: int) -> torch.Tensor:
    """The student's log-distribution over the first V ids, renormalized over them (its
    extra rows, ids no tokenizer produces, leave the divergence)."""
    if trainer_BTV.shape[-1] <= V:
        return trainer_BTV
    return torch.log_softmax(trainer_BTV[..., :V], dim=-1)


def restrict_to_support(trainer_BTV: torch.Tensor, teacher_BTV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k teachers (`top_k` > 0) give log-probs on their k most likely tokens and -inf
    elsewhere: the divergence is then taken over those tokens, the student's distribution
    renormalized on the same set (top-k distillation). Rows without -inf are unchanged.
    Outside the support both sides are -inf (probability 0), which the divergence
    (`loss.kl_terms`) counts as 0 with no gradient."""
    out_BTV = torch.isneginf(teacher_BTV)
    if not out_BTV.any():
        return trainer_BTV, teacher_BTV
    s_BTV = torch.log_softmax(trainer_BTV.masked_fill(out_BTV, float("-inf")), dim=-1)
    # a row with no -inf at all is a full distribution: its student log-probs stay as they were
    full_BT = ~out_BTV.any(-1, keepdim=True)
    return torch.where(full_BT, trainer_BTV, s_BTV), teacher_BTV


def divergence_inputs(trainer_full_BTV: torch.Tensor, teacher_full: list, T: int, vocab: int | None,
                      teacher_temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student, teacher target, teacher itself), [B, T, V] log-distributions over the ids
    the tokenizer can produce (`vocab`, len(tokenizer); None: the narrower of the two
    models), each renormalized over them, the student restricted to a top-k teacher's
    support; the target is the teacher sharpened by `teacher_temperature`."""
    widths = [r.shape[-1] for r in teacher_full if r is not None and len(r)]
    V = vocab if vocab is not None else min([trainer_full_BTV.shape[-1], *widths])
    s_BTV = over_vocab(trainer_full_BTV, V)
    teacher_raw_BTV = pad_full(teacher_full, T, V)
    s_BTV, teacher_raw_BTV = restrict_to_support(s_BTV, teacher_raw_BTV)
    return s_BTV, L.sharpen(teacher_raw_BTV, teacher_temperature), teacher_raw_BTV


def train_step(accelerator, model, optimizer, scheduler, *, loss_cfg: LossConfig, grad_clip: float,
               prompt_ids: list[list[int]], samples: list, teacher_lp: list, teacher_full: list,
               off_B: torch.Tensor, task_reward_B: torch.Tensor, domain_ids_B: torch.Tensor, n_domains: int,
               pad_id: int | None, vocab: int | None = None, sampling: list | None = None) -> StepResult:
    """One update on a minibatch: `samples[i]` answers `prompt_ids[i]`; rows with off_B
    set are teacher-forced references (no sampler, importance weight 1). `pad_id` may be
    None (a tokenizer without a pad token): masks come from lengths. `vocab`: the ids the
    tokenizer can produce (len(tokenizer)), over which kl=full takes its divergence.
    `sampling[i]`: row i's sampling settings (`.temperature`, `.top_p`; None: 1 and 1):
    the policy-gradient term is corrected from them to the temperature-1 student
    (`loss.tempered_logprobs`, the module docstring of `mopd.distill.loss`)."""
    world = accelerator.num_processes
    full_kl = loss_cfg.kl == "full"
    # Agent transcripts: only the tokens the student wrote carry loss (observations are masked).
    batch = collate(prompt_ids, [s.completion_ids for s in samples], pad_id,
                    {"sampler_lp": [s.sampler_logprobs for s in samples], "teacher_lp": teacher_lp},
                    token_mask=[s.loss_mask for s in samples])
    mask = batch["mask"]
    n_tok = torch.tensor([mask.sum().item()])
    n_tok_global = accelerator.reduce(n_tok.clone(), reduction="sum").item()
    temp_B = torch.tensor([1.0 if s is None else float(s.temperature) for s in (sampling or [None] * len(samples))])
    top_p_B = torch.tensor([1.0 if s is None else float(s.top_p) for s in (sampling or [None] * len(samples))])
    temp_B[off_B] = 1.0    # teacher-forced rows were not sampled
    top_p_B[off_B] = 1.0
    # with kl=full the policy-gradient term carries the task reward only: nothing to correct without one
    tempered = bool(((temp_B > 0) & ((temp_B != 1.0) | (top_p_B < 1.0))).any()) and (
        not full_kl or loss_cfg.task_reward_alpha > 0)
    if full_kl or tempered:
        trainer_lp, trainer_full = completion_logprobs(model, batch, full=True)
    else:
        trainer_lp = completion_logprobs(model, batch)
    if full_kl:
        student_BTV, teacher_full_BTV, teacher_raw_BTV = divergence_inputs(
            trainer_full, teacher_full, mask.shape[1], vocab, loss_cfg.teacher_temperature)
    temp_w_BT = torch.ones_like(trainer_lp)
    if tempered:   # p / q for each sampled token: the change of measure to the temperature-1 student
        q_BT = L.tempered_logprobs(trainer_full.detach(), batch["completion_ids"], temp_B, top_p_B)
        temp_w_BT = L.temperature_weights(trainer_lp, q_BT, mask)
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
    elif loss_cfg.baseline == "leave_one_out":
        onehot_BD = torch.nn.functional.one_hot(domain_ids_B, n_domains).float()
        b_B = L.leave_one_out_baseline(adv, mask, onehot_BD, lambda t: accelerator.reduce(t, reduction="sum"))
        adv = L.subtract_baseline(adv, mask, b_B)
    isw = L.importance_weights(trainer_lp, batch["sampler_lp"], mask, loss_cfg.is_truncation,
                               loss_cfg.is_mask_low, loss_cfg.is_mask_high)
    pg_w_BT = isw.weights_BT * temp_w_BT if tempered else isw.weights_BT
    loss = L.policy_gradient_loss(trainer_lp, adv, pg_w_BT, n_tok_global) * world
    # The logged reverse KL per token: exact over the vocabulary when the teacher's whole
    # distribution is at hand (the one-sample estimate -rew is biased once samples are
    # drawn below temperature 1 or corrected), against the teacher itself.
    kl_log_BT = -rew.detach()
    if full_kl:
        kl_BT = L.full_divergence(student_BTV, teacher_full_BTV, mask, loss_cfg.beta)
        loss = loss + L.full_kl_loss(kl_BT, isw.weights_BT, n_tok_global) * world
        # the loss term is already that KL when it is the reverse KL to the unsharpened teacher
        kl_log_BT = (kl_BT.detach() if loss_cfg.beta == 1.0 and teacher_full_BTV is teacher_raw_BTV
                     else L.full_reverse_kl(student_BTV.detach(), teacher_raw_BTV, mask))
    accelerator.backward(loss)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip) \
        if grad_clip > 0 else torch.tensor(0.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss, grad_norm=float(grad_norm), mask_BT=mask, trainer_lp_BT=trainer_lp,
                      sampler_lp_BT=batch["sampler_lp"], kl_log_BT=kl_log_BT, isw=isw, inserted_BT=ins_BT,
                      n_tok_global=n_tok_global)
