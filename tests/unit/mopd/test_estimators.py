"""The named estimators (loss.estimator, docs/estimators.md) against their analytic
gradients on a three-token vocabulary, through `train_step` (the code the loop runs);
and the IS weight of loss.kl=full (weight 1 per position, never the sampled token's rho).

The student is a bigram table W (the next token's logits are the row of the previous
token); each row is a one-token answer to a one-token prompt, so the expected gradient
over the sampler's draws is an exact finite sum, and the analytic gradients are written
out here with the softmax derivative d log p(y) / dz = e_y - p, independent of mopd.distill."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import Grab

from core.config import ConfigError, load_config
from core.rollout import Sample
from mopd.distill import loss as L
from mopd.distill.config import ESTIMATORS, DistillConfig, LossConfig
from mopd.distill.step import SingleProcess, train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 3
W0 = torch.tensor([[1.0, -0.5, 0.3], [0.2, 0.1, -1.0], [-0.3, 1.5, 0.0]])
WT = torch.tensor([[0.1, 0.4, 1.2], [1.0, -1.0, 0.3], [0.5, 0.5, -0.5]])
LPT = torch.log_softmax(WT, -1)          # the teacher's next-token log-probs after each token
P = torch.softmax(W0, -1)                 # the student's
LQ = torch.log_softmax(W0 + torch.tensor([[0.3, -0.2, 0.1], [-0.25, 0.2, 0.0], [0.1, 0.1, -0.3]]), -1)
NO_SCHED = SimpleNamespace(step=lambda: None)


class Bigram(torch.nn.Module):
    def __init__(self, W: torch.Tensor):
        super().__init__()
        self.W = torch.nn.Parameter(W.clone())

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.W[input_ids])


def _grad(cfg: LossConfig, prompts, ys, sampler_lp, task_reward=None, full=False) -> torch.Tensor:
    """train_step's gradient of W for rows (prompt p_i, answer y_i), lr-free."""
    model = Bigram(W0)
    opt = Grab(model.parameters())
    samples = [Sample(prompt_ids=[p], completion_ids=[y], finished=True, sampler_logprobs=[float(sampler_lp[p, y])])
               for p, y in zip(prompts, ys)]
    n = len(prompts)
    train_step(SingleProcess(), model, opt, NO_SCHED, loss_cfg=cfg, grad_clip=0.0, prompt_ids=[[p] for p in prompts],
               samples=samples, teacher_lp=[[float(LPT[p, y])] for p, y in zip(prompts, ys)],
               teacher_full=[LPT[p][None] for p in prompts] if full else [None] * n,
               off_B=torch.zeros(n, dtype=torch.bool),
               task_reward_B=torch.zeros(n) if task_reward is None else task_reward,
               domain_ids_B=torch.zeros(n, dtype=torch.long), n_domains=1, pad_id=None, vocab=V)
    return opt.grads[0]


def _reverse_kl_grad(p: int) -> torch.Tensor:
    """d KL(p_S || p_T) / dz at prompt p: p * (log p - log p_T - KL)."""
    lp = P[p].log()
    kl = (P[p] * (lp - LPT[p])).sum()
    return P[p] * (lp - LPT[p] - kl)


def test_estimator_names_set_their_keys_and_need_their_rollout():
    assert LossConfig(estimator="gkd_full").kl == "full" and LossConfig(estimator="gkd_full").beta == 0.0
    c = LossConfig(estimator="mopd_advantage", task_reward_alpha=0.5, kl="full", beta=0.0)
    assert (c.kl, c.beta, c.outcome, c.task_reward_alpha) == ("sampled", 1.0, "group", 0.5)
    with pytest.raises(ValueError, match="task_reward_alpha > 0"):
        LossConfig(estimator="mopd_advantage").validate()
    assert set(ESTIMATORS) == {"gkd_full", "sampled_reverse_kl", "mopd_advantage"}
    with pytest.raises(ConfigError, match="temperature=0.7.*sampled_reverse_kl"):
        load_config(DistillConfig, "recipes/mopd/toy.yaml", ["loss.estimator=sampled_reverse_kl",
                                                               "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="samples_per_prompt=1 needs to be >= 2"):
        load_config(DistillConfig, "recipes/mopd/toy.yaml", ["loss.estimator=mopd_advantage",
                                                               "loss.task_reward_alpha=1.0"])
    cfg = load_config(DistillConfig, "recipes/mopd/toy.yaml", ["loss.estimator=mopd_advantage",
                                                               "loss.task_reward_alpha=1.0",
                                                               "rollout.samples_per_prompt=4"])
    assert cfg.loss.kl == "sampled" and cfg.loss.outcome == "group"


@pytest.mark.parametrize("sampler", ["same", "far"])
def test_gkd_full_gradient_is_p_minus_sharpened_teacher_whatever_the_sampled_token(sampler):
    """gkd_full: forward KL(T' || p_S), T' the teacher at temperature 0.5, over the whole
    vocabulary at each position: d/dz = p_S - T' per position, weight 1 (item 3): the
    sampled token and the sampler's log-prob (rho from 0.1 to 10, outside the
    [0.5, 2] mask) change nothing."""
    sampler_lp = P.log() if sampler == "same" else torch.log_softmax(3.0 * torch.randn(V, V,
                                                         generator=torch.Generator().manual_seed(0)), -1)
    t_sharp = torch.softmax(LPT / 0.5, -1)
    cfg = LossConfig(estimator="gkd_full", baseline="none")
    for ys in itertools.product(range(V), repeat=2):
        g = _grad(cfg, [0, 2], ys, sampler_lp, full=True)
        want = torch.zeros(V, V)
        want[0] = (P[0] - t_sharp[0]) / 2
        want[2] = (P[2] - t_sharp[2]) / 2
        assert torch.allclose(g, want, atol=1e-6), (ys, g, want)


def test_full_kl_position_weight_is_one_not_the_sampled_tokens_ratio():
    """loss.kl=full, reverse KL (beta 1): the step's gradient is the same for any sampler
    log-prob; before issue 36 each position's KL was weighted by min(rho, 2) and dropped
    outside [0.5, 2]."""
    cfg = LossConfig(kl="full", beta=1.0, baseline="none")
    ref = _grad(cfg, [1], [0], P.log(), full=True)
    assert torch.allclose(ref[1], _reverse_kl_grad(1), atol=1e-6)
    for shift in (-3.0, -0.5, 0.4, 3.0):   # rho = e^3, e^0.5, e^-0.4, e^-3
        lp = P.log().clone()
        lp[1, 0] += shift
        assert torch.equal(_grad(cfg, [1], [0], lp, full=True), ref), shift


def test_sampled_reverse_kl_expected_gradient_is_the_reverse_kl_gradient_with_is():
    """sampled_reverse_kl: E over draws from a sampler q != p (ratios within the IS
    window) of the IS-weighted step = d KL(p || p_T) / dz, temperature 1."""
    cfg = LossConfig(estimator="sampled_reverse_kl", baseline="none")
    q = LQ.exp()
    ratio = P / q
    assert ratio.min() > 0.5 and ratio.max() < 2.0 and not torch.allclose(ratio, torch.ones(V, V), atol=0.05)
    total = torch.zeros(V, V)
    for ys in itertools.product(range(V), repeat=2):
        prob = float(q[0, ys[0]] * q[1, ys[1]])
        total += prob * _grad(cfg, [0, 1], ys, LQ)
    want = torch.zeros(V, V)
    want[0], want[1] = _reverse_kl_grad(0) / 2, _reverse_kl_grad(1) / 2
    assert torch.allclose(total, want, atol=1e-6), (total, want)
    # without the IS weights (every draw weighted 1) the expectation is another vector
    biased = torch.zeros(V, V)
    for ys in itertools.product(range(V), repeat=2):
        biased += float(q[0, ys[0]] * q[1, ys[1]]) * _grad(cfg, [0, 1], ys, P.log())
    assert (biased - want).abs().max() > 1e-3


def test_mopd_advantage_expected_gradient_is_token_kl_plus_alpha_group_outcome():
    """mopd_advantage, n = 3 samples of one prompt, outcome reward R(y) = [1, 0, 0.5]:
    A_i = log p_T(y_i) - log p_S(y_i) + alpha * (R_i - mean R) / (std R + 1e-4). The
    expected step = d KL(p || p_T) / dz - alpha / n * E[sum_i Ahat_i (e_{y_i} - p)],
    the second term summed here over all 27 draws from the closed form."""
    alpha, n, R = 0.7, 3, torch.tensor([1.0, 0.0, 0.5])
    cfg = LossConfig(estimator="mopd_advantage", task_reward_alpha=alpha, baseline="none")
    total, outcome = torch.zeros(V, V), torch.zeros(V)
    for ys in itertools.product(range(V), repeat=n):
        prob = math.prod(float(P[0, y]) for y in ys)
        r = R[list(ys)]
        mean = float(r.mean())
        std = math.sqrt(sum((float(x) - mean) ** 2 for x in r) / (n - 1))
        ahat = [0.0 if std == 0 else (float(x) - mean) / (std + 1e-4) for x in r]
        for y, a in zip(ys, ahat):
            outcome += prob * a * (torch.eye(V)[y] - P[0])
        # what the loop feeds train_step: L.group_normalized of the rows' rewards (batch.task_rewards)
        task = L.group_normalized(r, torch.zeros(n, dtype=torch.long))
        assert torch.allclose(task, torch.tensor(ahat), atol=1e-6)
        total += prob * _grad(cfg, [0] * n, ys, P.log(), task_reward=task)
    want = torch.zeros(V, V)
    want[0] = _reverse_kl_grad(0) - alpha / n * outcome
    assert outcome.abs().max() > 1e-2          # the outcome term is really there
    assert torch.allclose(total, want, atol=1e-6), (total, want)


def test_the_loop_normalizes_the_outcome_over_each_prompts_samples(tok):
    """mopd.distill.batch.task_rewards (what the loop feeds train_step) with
    loss.outcome=group: each prompt's samples normalized among themselves; the raw values
    kept for the metrics."""
    from mopd.distill.batch import Batch, task_rewards
    from mopd.distill.data import Prompt

    cfg = SimpleNamespace(loss=LossConfig(estimator="mopd_advantage", task_reward_alpha=1.0), agents={},
                          rewards={"m": "x:y"})
    rows = [Prompt(index=i, domain="m", teacher_key="m", messages=[], ids=[], columns={}) for i in (0, 0, 0, 1, 1, 2)]
    samples = [Sample(prompt_ids=[], completion_ids=tok.encode(t), finished=True, sampler_logprobs=[])
               for t in ("1", "0", "1", "0", "0", "1")]
    b = Batch(rows=rows, seeds=[0] * 6, off=[False] * 6, samples=samples, n_gen=0, seconds={})
    task_rewards(cfg, {"m": lambda prompts, completions, **_: [float(c.strip()) for c in completions]}, tok, b)
    assert b.task_reward_raw.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    std = math.sqrt(1 / 3)   # unbiased std of (1, 0, 1)
    want = [(1 - 2 / 3) / (std + 1e-4), (0 - 2 / 3) / (std + 1e-4), (1 - 2 / 3) / (std + 1e-4), 0.0, 0.0, 0.0]
    assert torch.allclose(b.task_reward, torch.tensor(want), atol=1e-6)
