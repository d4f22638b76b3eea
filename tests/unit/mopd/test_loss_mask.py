"""The loss mask of agent transcripts: observation tokens (loss_mask 0) get no loss, no
gradient, no importance weight and no metric; returns carry across them; single-turn
samples (loss_mask None) are exactly what they were."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mopd.distill import loss as L
from mopd.distill.config import LossConfig
from mopd.distill.step import SingleProcess as OneProcess, train_step
from core.models import collate
from core.rollout import Sample


def _old_discounted_returns(rewards_BT, mask_BT, gamma):
    """The implementation before agent transcripts (single-turn reference)."""
    if gamma == 0.0:
        return rewards_BT * mask_BT
    out = torch.zeros_like(rewards_BT)
    running = torch.zeros_like(rewards_BT[:, 0])
    for t in range(rewards_BT.shape[1] - 1, -1, -1):
        running = rewards_BT[:, t] * mask_BT[:, t] + gamma * running * mask_BT[:, t]
        out[:, t] = running
    return out


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 1.0])
def test_discounted_returns_single_turn_bit_identical(gamma):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 17
    lens = torch.tensor([17, 0, 1, 5, 9, 16])
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    rew = L.token_rewards(torch.randn(B, T, generator=g), torch.randn(B, T, generator=g), mask)
    assert torch.equal(L.discounted_returns(rew, mask, gamma), _old_discounted_returns(rew, mask, gamma))


def test_discounted_returns_carry_across_observations():
    # student tokens, 2 observation tokens, student tokens, padding
    r = torch.tensor([[1.0, 2.0, 0.0, 0.0, 4.0, 8.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    g = 0.5
    expect = torch.tensor([[1 + g * 2 + g ** 2 * 4 + g ** 3 * 8, 2 + g * 4 + g ** 2 * 8, 0.0, 0.0, 4 + g * 8, 8.0, 0.0]])
    assert torch.allclose(L.discounted_returns(r, m, g), expect)
    # observation rewards (whatever they hold) never enter
    r2 = r.clone()
    r2[0, 2:4] = 100.0
    assert torch.equal(L.discounted_returns(r2 * m, m, g), L.discounted_returns(r, m, g))


def test_collate_token_mask():
    b = collate([[5, 6], [7]], [[1, 2, 3], [4]], 0, {}, token_mask=[[1, 0, 1], None])
    assert b["mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert torch.equal(collate([[5, 6], [7]], [[1, 2, 3], [4]], 0, {})["mask"],
                       collate([[5, 6], [7]], [[1, 2, 3], [4]], 0, {}, token_mask=[None, None])["mask"])
    with pytest.raises(ValueError, match="loss-mask"):
        collate([[5]], [[1, 2]], 0, {}, token_mask=[[1]])


def _agent_batch(tok, model, reference_logprobs):
    """Two rows: an agent transcript (turn, observation, turn) and a single-turn sample, with
    the model's own log-probs as the sampler's (importance weight 1)."""
    g = torch.Generator().manual_seed(3)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=True)["input_ids"]
    t0 = torch.randint(10, 1500, (4,), generator=g).tolist() + [tok.eos_token_id]
    obs = tok.encode("\n<|im_start|>tool\nresult 7<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    t1 = torch.randint(10, 1500, (3,), generator=g).tolist() + [tok.eos_token_id]
    comp = t0 + obs + t1
    mask = [1] * len(t0) + [0] * len(obs) + [1] * len(t1)
    lp = reference_logprobs(model, prompt, comp).tolist()
    agent = Sample(prompt_ids=list(prompt), completion_ids=comp, sampler_logprobs=lp, finished=True,
                   loss_mask=mask, turn_ids=[0] * len(t0) + [-1] * len(obs) + [1] * len(t1))
    single_ids = torch.randint(10, 1500, (6,), generator=g).tolist()
    single = Sample(prompt_ids=list(prompt), completion_ids=single_ids, finished=False,
                    sampler_logprobs=reference_logprobs(model, prompt, single_ids).tolist())
    teacher = [torch.randn(len(comp), generator=g).tolist(), torch.randn(6, generator=g).tolist()]
    return prompt, [agent, single], teacher, len(t0), len(obs)


def _step(model, prompt, samples, teacher, loss_cfg, teacher_full=None):
    """train_step with lr 0 (the weights stay); returns the result and the gradient w.r.t. the logits."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grabbed = {}

    def hook(_m, _i, out):
        out.retain_grad()
        grabbed["logits"] = out
    h = model.lm_head.register_forward_hook(hook)
    try:
        # the padded path: the hook reads the [B, L, V] logits (packed ones are [tokens, V];
        # test_packed_update checks the packed path gives the padded one's loss and gradient)
        res = train_step(OneProcess(), model, opt, sched, loss_cfg=dataclasses.replace(loss_cfg, pack_completions=False),
                         grad_clip=0.0,
                         prompt_ids=[s.prompt_ids for s in samples], samples=samples, teacher_lp=teacher,
                         teacher_full=teacher_full or [None] * len(samples), off_B=torch.zeros(len(samples), dtype=torch.bool),
                         task_reward_B=torch.tensor([1.0, 0.5]), domain_ids_B=torch.tensor([0, 0]), n_domains=1,
                         pad_id=0)
    finally:
        h.remove()
    return res, grabbed["logits"].grad.detach().clone()


@pytest.mark.parametrize("loss_cfg", [
    LossConfig(discount=0.0, baseline="none"),
    LossConfig(discount=0.7, task_reward_alpha=0.5, baseline="domain_mean"),
    LossConfig(kl="full", baseline="domain_mean"),
], ids=["per-token", "discounted+task+baseline", "full-kl"])
def test_observation_tokens_get_no_loss_and_no_gradient(student_hf, teacher_hf, tiny_tokenizer, reference_logprobs,
                                                        loss_cfg):
    tok = tiny_tokenizer
    prompt, samples, teacher, n0, n_obs = _agent_batch(tok, student_hf, reference_logprobs)
    full = None
    if loss_cfg.kl == "full":
        ids = torch.tensor([prompt + samples[0].completion_ids])
        with torch.no_grad():
            lsm = torch.log_softmax(teacher_hf(ids).logits[0].float(), -1)
        P = len(prompt)
        full0 = lsm[P - 1:P - 1 + len(samples[0].completion_ids)]
        ids1 = torch.tensor([prompt + samples[1].completion_ids])
        with torch.no_grad():
            full1 = torch.log_softmax(teacher_hf(ids1).logits[0].float(), -1)[P - 1:P - 1 + 6]
        full = [full0, full1]
        teacher = [full0.gather(-1, torch.tensor(samples[0].completion_ids)[:, None]).squeeze(-1).tolist(),
                   full1.gather(-1, torch.tensor(samples[1].completion_ids)[:, None]).squeeze(-1).tolist()]
    res, grad = _step(student_hf, prompt, samples, teacher, loss_cfg, full)
    P = len(prompt)
    obs_cols = list(range(n0, n0 + n_obs))
    # masks, weights and logged KL are zero on observation tokens
    assert res.mask_BT[0, obs_cols].abs().sum() == 0 and res.mask_BT[0, :n0].min() == 1
    assert res.isw.weights_BT[0, obs_cols].abs().sum() == 0
    assert res.kl_log_BT[0, obs_cols].abs().sum() == 0
    assert res.n_tok_global == sum(samples[0].loss_mask) + 6
    # the logits that predict observation tokens get exactly zero gradient; the student's do not
    obs_pos = [P + c - 1 for c in obs_cols]
    student_pos = [P + c - 1 for c in range(n0)]
    assert grad[0, obs_pos].abs().max() == 0
    assert grad[0, student_pos].abs().max() > 0
    # whatever the teacher said about observation tokens changes nothing
    t2 = [list(teacher[0]), teacher[1]]
    for c in obs_cols:
        t2[0][c] = t2[0][c] - 5.0
    full2 = None
    if full is not None:
        f0 = full[0].clone()
        f0[obs_cols] = torch.log_softmax(torch.randn(len(obs_cols), f0.shape[-1]), -1)
        full2 = [f0, full[1]]
    res2, grad2 = _step(student_hf, prompt, samples, t2, loss_cfg, full2)
    assert torch.equal(res.loss, res2.loss) and torch.equal(grad, grad2)


def test_single_turn_rows_unchanged_by_loss_mask_none(student_hf, tiny_tokenizer, reference_logprobs):
    """A sample whose loss_mask is all ones trains exactly like one whose loss_mask is None."""
    tok = tiny_tokenizer
    prompt, samples, teacher, _, _ = _agent_batch(tok, student_hf, reference_logprobs)
    single = samples[1]
    ones = Sample(prompt_ids=single.prompt_ids, completion_ids=single.completion_ids,
                  sampler_logprobs=single.sampler_logprobs, finished=False, loss_mask=[1] * 6, turn_ids=[0] * 6)
    cfg = LossConfig(discount=0.5)
    a, ga = _step(student_hf, prompt, [samples[1], samples[1]], [teacher[1], teacher[1]], cfg)
    b, gb = _step(student_hf, prompt, [ones, ones], [teacher[1], teacher[1]], cfg)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
