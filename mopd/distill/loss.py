"""The MOPD objective on per-token tensors.

Shapes: B completions, T completion positions (right-padded, `mask_BT` marks real tokens).

  r_t   = log p_teacher(y_t) - log p_student(y_t)            (stop-gradient: a reward)
  A_t   = sum_{k>=t} gamma^(k-t) r_k  (+ alpha * task reward)  (gamma = 0: per-token reward)
  w_t   = min(rho_t, C) * 1[low <= rho_t <= high],  rho_t = p_trainer(y_t) / p_sampler(y_t)
  loss  = - sum_t w_t * A_t * log p_trainer(y_t) / N_tokens

With gamma = 0 the gradient is the per-token reverse-KL policy gradient
E_{y~p}[grad log p(y_t) (log p(y_t) - log p_T(y_t))], so the student's own log-prob in
r_t is the trainer's current one (detached), not the sampler's: when the student equals
the teacher the reward and the gradient are exactly zero, whatever the sampler did.
rho corrects for the sampler being a different engine (vLLM vs the trainer's kernels)
and for batches sampled a step or two before the weights they train (max_staleness):
truncation (C) bounds the variance, the two-sided mask drops tokens whose ratio says
the sample is no longer from this policy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def token_rewards(teacher_logprobs_BT: torch.Tensor, student_logprobs_BT: torch.Tensor,
                  mask_BT: torch.Tensor) -> torch.Tensor:
    """r_t = log p_T - log p_S on real tokens, 0 on padding; never carries gradient."""
    return ((teacher_logprobs_BT - student_logprobs_BT) * mask_BT).detach()


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """A_t = sum_{k>=t} gamma^(k-t) r_k over the masked-in tokens of each sequence;
    gamma=0 returns r itself. A masked position inside a sequence (an observation between
    an agent's turns) is not a step: the return is carried across it unchanged, so the
    student's turn t sees the discounted rewards of its later turns."""
    if gamma == 0.0:
        return rewards_BT * mask_BT
    out = torch.zeros_like(rewards_BT)
    running = torch.zeros_like(rewards_BT[:, 0])
    for t in range(rewards_BT.shape[1] - 1, -1, -1):
        m = mask_BT[:, t]
        running = torch.where(m > 0, rewards_BT[:, t] * m + gamma * running * m, running)
        out[:, t] = running * m
    return out


def subtract_baseline(advantages_BT: torch.Tensor, mask_BT: torch.Tensor,
                      baseline_B: torch.Tensor) -> torch.Tensor:
    """A_t - b for each sequence's tokens (b: e.g. its domain's mean over the batch).
    A constant baseline leaves the expected policy gradient unchanged (E[grad log p] = 0)
    and, when all rewards are large and negative, stops every sampled token from being
    pushed down at once: tokens the teacher likes more than average are pushed up."""
    return (advantages_BT - baseline_B.unsqueeze(1)) * mask_BT


@dataclass
class ISWeights:
    weights_BT: torch.Tensor   # truncated, masked importance weights (no gradient)
    keep_BT: torch.Tensor      # 1 where the token is used
    ratio_BT: torch.Tensor     # raw p_trainer / p_sampler


def importance_weights(trainer_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor,
                       mask_BT: torch.Tensor, truncation: float, mask_low: float,
                       mask_high: float) -> ISWeights:
    log_ratio = (trainer_logprobs_BT.detach() - sampler_logprobs_BT) * mask_BT
    ratio = torch.exp(log_ratio)
    keep = ((ratio >= mask_low) & (ratio <= mask_high)).to(mask_BT.dtype) * mask_BT
    weights = torch.clamp(ratio, max=truncation) * keep
    return ISWeights(weights_BT=weights.detach(), keep_BT=keep, ratio_BT=ratio)


def policy_gradient_loss(trainer_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor,
                         weights_BT: torch.Tensor, normalizer: float) -> torch.Tensor:
    """-sum(w * A * log p) / normalizer; normalizer is the global token count so that
    per-rank losses sum (across data-parallel ranks) to the global mean."""
    return -(weights_BT.detach() * advantages_BT.detach() * trainer_logprobs_BT).sum() / max(normalizer, 1.0)


def full_reverse_kl(trainer_logprobs_BTV: torch.Tensor, teacher_logprobs_BTV: torch.Tensor,
                    mask_BT: torch.Tensor) -> torch.Tensor:
    """KL(p_S || p_T) over the whole vocabulary at each completion position, [B, T]:
    sum_v p_S(v) (log p_S(v) - log p_T(v)). Differentiable in the student's log-probs.

    Its gradient is the expectation, over the next token y ~ p_S, of the sampled-token
    policy gradient with r_t = log p_T(y) - log p_S(y) (gamma = 0): the same objective
    with the next-token sampling noise integrated out (Rao-Blackwellized). The state
    distribution is still the student's own samples, so the method stays on-policy."""
    p_BTV = trainer_logprobs_BTV.exp()
    kl_BT = (p_BTV * (trainer_logprobs_BTV - teacher_logprobs_BTV.detach())).sum(-1)
    return kl_BT * mask_BT


def full_divergence(trainer_logprobs_BTV: torch.Tensor, teacher_logprobs_BTV: torch.Tensor,
                    mask_BT: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Generalized JSD between student S and teacher T at each completion position, [B, T],
    with TRL's `beta` convention (DistillationConfig.beta, GKD): 1.0 = reverse KL(S || T)
    (exactly `full_reverse_kl`), 0.0 = forward KL(T || S), otherwise
    beta * KL(T || M) + (1 - beta) * KL(S || M) with M = (1 - beta) * S + beta * T
    (TRL's GKD definition, so a beta means the same here as there).

    Why forward KL at all: the reverse-KL gradient on a logit is weighted by the student's own
    probability of that token, so a token the teacher is sure of but the student gives 1%
    gets 1% of the push; the forward-KL gradient is p_S - p_T, full strength. The positions
    are still the student's own samples, so every beta is on-policy distillation (GKD)."""
    s_BTV = trainer_logprobs_BTV
    t_BTV = teacher_logprobs_BTV.detach()
    if beta == 1.0:
        return full_reverse_kl(s_BTV, t_BTV, mask_BT)
    if beta == 0.0:
        div_BT = (t_BTV.exp() * (t_BTV - s_BTV)).sum(-1)
    else:
        m_BTV = torch.logsumexp(torch.stack([s_BTV + math.log1p(-beta), t_BTV + math.log(beta)]), dim=0)
        kl_t = (t_BTV.exp() * (t_BTV - m_BTV)).sum(-1)
        kl_s = (s_BTV.exp() * (s_BTV - m_BTV)).sum(-1)
        div_BT = beta * kl_t + (1.0 - beta) * kl_s
    return div_BT * mask_BT


def sharpen(teacher_logprobs_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    """The teacher's distribution at temperature `temperature`: log softmax(log p_T / t),
    i.e. p_T^(1/t) renormalized. t < 1 moves mass toward the teacher's top token; t = 1
    returns the input unchanged."""
    if temperature == 1.0:
        return teacher_logprobs_BTV
    return torch.log_softmax(teacher_logprobs_BTV / temperature, dim=-1)


def full_kl_loss(kl_BT: torch.Tensor, weights_BT: torch.Tensor, normalizer: float) -> torch.Tensor:
    """sum(w * KL_t) / normalizer, w the same truncated, masked IS weights as the PG loss."""
    return (weights_BT.detach() * kl_BT).sum() / max(normalizer, 1.0)


def mismatch_stats(trainer_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor,
                   mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums (not means) so they can be reduced across ranks and domains first:
    |dlogp| sum and max, and the k3 estimator of KL(sampler || trainer) summed."""
    d = (trainer_logprobs_BT.detach() - sampler_logprobs_BT) * mask_BT
    ratio = torch.exp(d)
    k3 = (ratio - 1.0 - d) * mask_BT
    return {"abs_sum": d.abs().sum(), "abs_max": d.abs().max() if d.numel() else d.new_zeros(()),
            "k3_sum": k3.sum()}
