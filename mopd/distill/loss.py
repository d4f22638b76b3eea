"""The MOPD objective on per-token tensors.

Shapes: B completions, T completion positions (right-padded, `mask_BT` marks real tokens).

  r_t   = log p_teacher(y_t) - log p_student(y_t)            (stop-gradient: a reward)
  A_t   = sum_{k>=t} gamma^(k-t) r_k  (+ alpha * task reward)  (gamma = 0: per-token reward)
          (loss.outcome=group: the task reward normalized over the prompt's samples first)
  w_t   = min(rho_t, C) * 1[low <= rho_t <= high] * tau_t,  rho_t = p_trainer(y_t) / p_sampler(y_t)
  loss  = - sum_t w_t * (A_t - b) * log p_trainer(y_t) / N_tokens

With gamma = 0 the gradient is the per-token reverse-KL policy gradient
E_{y~p}[grad log p(y_t) (log p(y_t) - log p_T(y_t))], so the student's own log-prob in
r_t is the trainer's current one (detached), not the sampler's: when the student equals
the teacher the reward and the gradient are exactly zero, whatever the sampler did.
rho corrects for the sampler being a different engine (vLLM vs the trainer's kernels)
and for batches sampled a step or two before the weights they train (max_staleness):
truncation (C) bounds the variance, the two-sided mask drops tokens whose ratio says
the sample is no longer from this policy.

Which student is trained when rollout.temperature != 1 (issue 44, item 4). The sampler
draws y_t from the tempered (and top-p) distribution q = p^(1/tau), renormalized, while
p_trainer and p_sampler are both raw (temperature 1) log-probs, so rho alone stays ~1.
The choice here: the student that is trained is the temperature-1 model, the one that is
exported, served and evaluated at whatever temperature its user picks, and the one
`loss.kl: full` already trains (its per-position divergence is exact over the vocabulary,
so the sampling temperature only decides which positions are visited). The sampled
estimator therefore carries tau_t = p(y_t) / q(y_t), computed by the trainer from its own
logits (`tempered_logprobs`, the sampler's processing: temperature then top-p) and not
truncated, so that per position E_{y~q}[tau * grad log p(y) (log p(y) - log p_T(y))] =
grad KL(p || p_T): the gradient of the same objective as `loss.kl: full`, in expectation.
The positions (prefixes) are still the sampler's, as with kl=full. Greedy sampling
(temperature 0) and top_p < 1 put no mass on tokens that p gives mass to, so no weight can
recover those terms: `loss.kl: sampled` refuses them (config validation). The other two
options were rejected: training the tempered student on both sides would make kl=sampled
and kl=full train different models at the same recipe, and the sampler's raw log-prob
(what every backend returns) cannot give the tempered one without the whole row; refusing
temperature != 1 would refuse recipes that work. With gamma > 0 the correction is per
token, like rho (the later tokens in a return stay as sampled).

The baseline b (loss.baseline) lowers the variance without changing the expected gradient
only if it does not depend on the row's own samples: `leave_one_out` is the token mean of
the advantages of the *other* rows of the same domain (global over ranks); `domain_mean`
includes the row itself, which shrinks the row's own term by about its share of the
domain's tokens (an O(1/N) bias for N rows, large in small batches).
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


def leave_one_out_baseline(advantages_BT: torch.Tensor, mask_BT: torch.Tensor, onehot_BD: torch.Tensor,
                           reduce=lambda t: t) -> torch.Tensor:
    """b_i = the token mean of the advantages of the rows of row i's domain other than i
    (0 when i is its domain's only row with tokens), [B]. `onehot_BD` maps rows to domains;
    `reduce` sums a tensor over data-parallel ranks, so the other rows are those of the
    global minibatch. b_i depends on no sample of row i, so E[grad log p(y_i) b_i] = 0:
    the baseline changes the variance, never the expected gradient."""
    own_2B = torch.stack([(advantages_BT * mask_BT).sum(1), mask_BT.sum(1)])
    return leave_one_out_baseline_from_sums(own_2B, reduce(own_2B @ onehot_BD), onehot_BD)


def leave_one_out_baseline_from_sums(own_2B: torch.Tensor, dom_2D: torch.Tensor, onehot_BD: torch.Tensor) -> torch.Tensor:
    """`leave_one_out_baseline` from each row's (advantage sum, token count) `own_2B` and
    each domain's over the global minibatch `dom_2D`."""
    others = dom_2D @ onehot_BD.T - own_2B                                        # [2, B]
    return torch.where(others[1] > 0, others[0] / others[1].clamp(min=1e-12), torch.zeros_like(others[0]))


def group_normalized(rewards_B: torch.Tensor, group_B: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(R - mean) / (std + eps) over the rows of each group (the samples of one prompt),
    as TRL's GRPO (scale_rewards="group": unbiased std, eps 1e-4); a group of one row, or
    whose rewards are all equal, gets 0 (no outcome signal)."""
    out = torch.zeros_like(rewards_B)
    for g in torch.unique(group_B).tolist():
        sel = group_B == g
        r = rewards_B[sel]
        if len(r) > 1:
            out[sel] = (r - r.mean()) / (r.std() + eps)
    return out


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


def kl_terms(a_BTV: torch.Tensor, b_BTV: torch.Tensor) -> torch.Tensor:
    """sum_v exp(a) (a - b) over the last axis, -inf-safe: a token with probability 0 under
    a (log-prob -inf) contributes 0 and no gradient (never 0 * -inf = nan), also when b is
    -inf there too. A token with a > -inf and b = -inf is an infinite divergence, as it is."""
    zero = torch.isneginf(a_BTV)
    if not zero.any():
        return (a_BTV.exp() * (a_BTV - b_BTV)).sum(-1)
    # both inputs filled before the arithmetic: a where() after it would still pass nan
    # gradients back through the branch it did not pick
    a0 = a_BTV.masked_fill(zero, 0.0)
    b0 = b_BTV.masked_fill(zero, 0.0)
    return torch.where(zero, torch.zeros_like(a0), a0.exp() * (a0 - b0)).sum(-1)


def full_reverse_kl(trainer_logprobs_BTV: torch.Tensor, teacher_logprobs_BTV: torch.Tensor,
                    mask_BT: torch.Tensor) -> torch.Tensor:
    """KL(p_S || p_T) over the whole vocabulary at each completion position, [B, T]:
    sum_v p_S(v) (log p_S(v) - log p_T(v)). Differentiable in the student's log-probs.

    Its gradient is the expectation, over the next token y ~ p_S, of the sampled-token
    policy gradient with r_t = log p_T(y) - log p_S(y) (gamma = 0): the same objective
    with the next-token sampling noise integrated out (Rao-Blackwellized). The state
    distribution is still the student's own samples, so the method stays on-policy.
    -inf-safe (`kl_terms`); positions outside `mask_BT` are exactly 0 whatever they hold."""
    s_BTV, t_BTV = _masked_rows(trainer_logprobs_BTV, teacher_logprobs_BTV.detach(), mask_BT)
    return kl_terms(s_BTV, t_BTV) * mask_BT


def _masked_rows(s_BTV: torch.Tensor, t_BTV: torch.Tensor, mask_BT: torch.Tensor):
    """Both sides set to 0 at positions outside the mask (padding, observations), so that
    whatever those rows hold (-inf, garbage) gives neither nan nor gradient."""
    off = (mask_BT <= 0).unsqueeze(-1)
    if not off.any():
        return s_BTV, t_BTV
    return s_BTV.masked_fill(off, 0.0), t_BTV.masked_fill(off, 0.0)


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
    if beta == 1.0:
        return full_reverse_kl(trainer_logprobs_BTV, teacher_logprobs_BTV, mask_BT)
    s_BTV, t_BTV = _masked_rows(trainer_logprobs_BTV, teacher_logprobs_BTV.detach(), mask_BT)
    if beta == 0.0:
        div_BT = kl_terms(t_BTV, s_BTV)
    else:
        # M = (1-beta) S + beta T is 0 only where both are: fill those, M is then finite wherever
        # either side has mass and kl_terms drops the zero-probability tokens of each side
        both = torch.isneginf(s_BTV) & torch.isneginf(t_BTV)
        s_m, t_m = (s_BTV.masked_fill(both, 0.0), t_BTV.masked_fill(both, 0.0)) if both.any() else (s_BTV, t_BTV)
        m_BTV = torch.logsumexp(torch.stack([s_m + math.log1p(-beta), t_m + math.log(beta)]), dim=0)
        div_BT = beta * kl_terms(t_BTV, m_BTV) + (1.0 - beta) * kl_terms(s_BTV, m_BTV)
    return div_BT * mask_BT


def sharpen(teacher_logprobs_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    """The teacher's distribution at temperature `temperature`: log softmax(log p_T / t),
    i.e. p_T^(1/t) renormalized. t < 1 moves mass toward the teacher's top token; t = 1
    returns the input unchanged."""
    if temperature == 1.0:
        return teacher_logprobs_BTV
    return torch.log_softmax(teacher_logprobs_BTV / temperature, dim=-1)


def tempered_logprobs(logprobs_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature_B: torch.Tensor,
                      top_p_B: torch.Tensor) -> torch.Tensor:
    """log q(y_t), [B, T]: the log-prob of each sampled token under the distribution the
    sampler drew it from, q = softmax(log p / temperature) cut to its top-p nucleus and
    renormalized (as `core.rollout.hf.sample_from_logits` and vLLM process logits). A row
    with temperature 1 and top_p 1 gets log p itself. Rows at temperature 0 (greedy) get
    log p too: there is no tempered distribution to correct for (kl=sampled refuses them)."""
    out = logprobs_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    for tau, top_p in sorted(set(zip(temperature_B.tolist(), top_p_B.tolist()))):
        if tau <= 0 or (tau == 1.0 and top_p >= 1.0):
            continue
        rows = ((temperature_B == tau) & (top_p_B == top_p)).nonzero().flatten()
        q = torch.log_softmax(logprobs_BTV[rows] / tau, dim=-1)
        if top_p < 1.0:
            probs, order = q.exp().sort(dim=-1, descending=True)
            drop = (probs.cumsum(-1) - probs) >= top_p   # the sampler's rule: keeps the top token
            q = torch.log_softmax(q.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf")), dim=-1)
        out[rows] = q.gather(-1, targets_BT[rows].unsqueeze(-1)).squeeze(-1)
    return out


def temperature_weights(trainer_logprobs_BT: torch.Tensor, tempered_logprobs_BT: torch.Tensor,
                        mask_BT: torch.Tensor) -> torch.Tensor:
    """tau_t = p(y_t) / q(y_t) on real tokens (1 elsewhere), no gradient, not truncated: the
    exact change of measure from the sampler's tempered distribution q to the temperature-1
    student p (see the module docstring)."""
    d = (trainer_logprobs_BT.detach() - tempered_logprobs_BT.detach()) * mask_BT
    return torch.exp(d)


def full_kl_loss(kl_BT: torch.Tensor, weights_BT: torch.Tensor, normalizer: float) -> torch.Tensor:
    """sum(w * KL_t) / normalizer. The trainer passes w = the mask: weight 1 at every
    student position (issue 36, item 3).

    Why not the sampled token's ratio rho_t = p_trainer(y_t) / p_sampler(y_t), as the
    sampled estimator uses: KL_t is a sum over the whole vocabulary at position t, so it
    does not depend on y_t; weighting it by rho_t adds noise with no correction, and the
    [is_mask_low, is_mask_high] mask would drop exactly the positions where the student
    moved most since sampling. What the sampler does change is the prefix's distribution,
    whose exact correction is the product of rho_s over s < t: it grows or vanishes
    geometrically with the length (truncating it is a bias of its own), and on-policy
    distillation does not need the student's exact state distribution, only states near
    it (GKD, and TRL's GKD/GOLD trainers, weight their full-vocabulary divergence by 1 at
    the sampled positions). The positions are the sampler's prefixes, as for the
    temperature correction above."""
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
