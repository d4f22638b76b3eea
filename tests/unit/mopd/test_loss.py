"""Loss maths on small tensors with exact expectations."""
import math

import pytest
import torch

from mopd.distill import loss as L


def _lp(B=3, T=5, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return logits, tokens


def test_student_equals_teacher_gives_zero_reward_and_zero_gradient():
    logits, tokens = _lp()
    logits = logits.clone().requires_grad_(True)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    student = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    teacher = student.detach().clone()
    r = L.token_rewards(teacher, student, mask)
    assert torch.equal(r, torch.zeros_like(r))
    adv = L.discounted_returns(r, mask, 0.9)
    isw = L.importance_weights(student, student.detach(), mask, 2.0, 0.5, 2.0)
    loss = L.policy_gradient_loss(student, adv, isw.weights_BT, mask.sum().item())
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_reward_sign_and_size():
    student = torch.tensor([[math.log(0.5), math.log(0.25)]])
    teacher = torch.tensor([[math.log(0.25), math.log(0.5)]])
    mask = torch.ones(1, 2)
    r = L.token_rewards(teacher, student, mask)
    # teacher less likely than student -> negative reward of log(1/2); more likely -> +log 2
    assert torch.allclose(r, torch.tensor([[-math.log(2), math.log(2)]]))
    assert not r.requires_grad


def test_reward_is_stop_gradient():
    s = torch.zeros(1, 2, requires_grad=True)
    r = L.token_rewards(torch.ones(1, 2), s, torch.ones(1, 2))
    assert not r.requires_grad


def test_discounted_returns_exact():
    r = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.equal(L.discounted_returns(r, mask, 0.0), r * mask)
    got = L.discounted_returns(r, mask, 0.5)
    assert torch.allclose(got, torch.tensor([[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0, 0.0]]))
    got1 = L.discounted_returns(r, mask, 1.0)
    assert torch.allclose(got1, torch.tensor([[7.0, 6.0, 4.0, 0.0]]))


def test_is_truncation_and_two_sided_mask():
    sampler = torch.zeros(1, 5)
    # ratios: 0.25 (masked low), 0.9, 1.5 (kept), 3.0 (masked high), 1.8 truncated to C=1.6
    trainer = torch.log(torch.tensor([[0.25, 0.9, 1.5, 3.0, 1.8]]))
    mask = torch.ones(1, 5)
    w = L.importance_weights(trainer, sampler, mask, truncation=1.6, mask_low=0.5, mask_high=2.0)
    assert torch.allclose(w.weights_BT, torch.tensor([[0.0, 0.9, 1.5, 0.0, 1.6]]))
    assert torch.equal(w.keep_BT, torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]]))
    assert not w.weights_BT.requires_grad


def test_is_padding_never_counts():
    sampler = torch.tensor([[0.0, -50.0]])
    trainer = torch.tensor([[0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    w = L.importance_weights(trainer, sampler, mask, 2.0, 0.5, 2.0)
    assert torch.equal(w.weights_BT, torch.tensor([[1.0, 0.0]]))


def test_pg_gradient_matches_hand_computation():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -1.0]])
    w = torch.tensor([[1.0, 2.0]])
    loss = L.policy_gradient_loss(lp, adv, w, normalizer=4.0)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.5 / 4, 2.0 / 4]]))
    assert loss.item() == pytest.approx(-(1.0 * 0.5 * -1.0 + 2.0 * -1.0 * -2.0) / 4)


def test_gradient_direction_reduces_reverse_kl():
    """One SGD step on the loss moves a categorical student towards the teacher."""
    torch.manual_seed(0)
    V = 6
    teacher = torch.log_softmax(torch.randn(V), -1)
    logits = torch.zeros(V, requires_grad=True)
    kl0 = None
    opt = torch.optim.SGD([logits], lr=0.5)
    for it in range(200):
        s = torch.log_softmax(logits, -1)
        kl = (s.exp() * (s - teacher)).sum()
        kl0 = kl.item() if kl0 is None else kl0
        y = torch.multinomial(s.exp().detach(), 256, replacement=True).unsqueeze(0)
        lp = s[y]
        mask = torch.ones_like(lp)
        r = L.token_rewards(teacher[y], lp, mask)
        w = L.importance_weights(lp, lp.detach(), mask, 2.0, 0.5, 2.0).weights_BT
        loss = L.policy_gradient_loss(lp, r, w, mask.sum().item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    s = torch.log_softmax(logits, -1)
    assert (s.exp() * (s - teacher)).sum().item() < 0.1 * kl0


def test_mismatch_stats():
    t = torch.tensor([[0.0, -1.0, -2.0]])
    s = torch.tensor([[0.0, -1.5, -1.0]])
    m = L.mismatch_stats(t, s, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["abs_sum"].item() == pytest.approx(0.5)
    assert m["abs_max"].item() == pytest.approx(0.5)
    d = 0.5
    assert m["k3_sum"].item() == pytest.approx(math.exp(d) - 1 - d)


def test_subtract_baseline_exact_and_keeps_padding_zero():
    adv = torch.tensor([[-3.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = L.subtract_baseline(adv, mask, torch.tensor([-2.0, -1.0]))
    assert torch.equal(out, torch.tensor([[-1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]))
    # student == teacher: zero rewards, zero mean, still zero advantages.
    z = torch.zeros(2, 3)
    assert torch.equal(L.subtract_baseline(z, mask, torch.zeros(2)), z)


# ----------------------------------------------------------------------------- loss.kl=full
def test_full_reverse_kl_is_zero_with_zero_gradient_when_student_equals_teacher():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    s = torch.log_softmax(logits, -1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = L.full_reverse_kl(s, s.detach().clone(), mask)
    loss = L.full_kl_loss(kl, torch.ones_like(mask), mask.sum().item())
    loss.backward()
    assert torch.allclose(kl, torch.zeros_like(kl), atol=1e-6)
    assert torch.allclose(logits.grad, torch.zeros_like(logits.grad), atol=1e-6)


def test_full_reverse_kl_value_and_masking():
    p_s = torch.tensor([0.5, 0.25, 0.25])
    p_t = torch.tensor([0.25, 0.5, 0.25])
    s = p_s.log().view(1, 1, 3).repeat(1, 2, 1)
    t = p_t.log().view(1, 1, 3).repeat(1, 2, 1)
    kl = L.full_reverse_kl(s, t, torch.tensor([[1.0, 0.0]]))
    expected = (p_s * (p_s.log() - p_t.log())).sum()   # 0.25 * ln 2
    assert torch.allclose(kl[0, 0], expected) and kl[0, 1] == 0
    assert torch.isclose(expected, torch.tensor(0.25 * math.log(2)))


def test_full_kl_gradient_is_the_expected_sampled_policy_gradient():
    """Rao-Blackwellization: grad KL(p_S||p_T) at a position equals E_{y~p_S}[(log p_S(y) -
    log p_T(y)) grad log p_S(y)], the sampled-token estimator's expected gradient."""
    torch.manual_seed(1)
    V = 6
    logits = torch.randn(V, requires_grad=True)
    t = torch.log_softmax(torch.randn(V), -1)
    s = torch.log_softmax(logits, -1)
    L.full_reverse_kl(s.view(1, 1, V), t.view(1, 1, V), torch.ones(1, 1)).sum().backward()
    full_grad = logits.grad.clone()
    expected = torch.zeros(V)
    for y in range(V):
        logits.grad = None
        s = torch.log_softmax(logits, -1)
        # the PG surrogate for one sampled token y: -(r_y) * log p_S(y), r = log p_T - log p_S
        r = (t[y] - s[y]).detach()
        (-(r * s[y])).backward()
        expected += s[y].exp().detach() * logits.grad
    assert torch.allclose(full_grad, expected, atol=1e-5)


# ----------------------------------------------------------------------------- loss.beta
def _dists(V=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 1, V, generator=g), torch.log_softmax(torch.randn(1, 1, V, generator=g), -1)


def test_full_divergence_beta_one_is_reverse_kl_and_beta_zero_is_forward_kl():
    logits, t = _dists()
    s = torch.log_softmax(logits, -1)
    m = torch.ones(1, 1)
    assert torch.allclose(L.full_divergence(s, t, m, 1.0), L.full_reverse_kl(s, t, m))
    forward = (t.exp() * (t - s)).sum(-1)
    assert torch.allclose(L.full_divergence(s, t, m, 0.0), forward)
    assert not torch.allclose(forward, L.full_reverse_kl(s, t, m))  # the two really differ here


def test_forward_kl_gradient_is_student_minus_teacher_probabilities():
    """Why beta < 1 learns faster from a far-off student: d KL(T||S) / d logits = p_S - p_T,
    not scaled down by the student's own small probability of the teacher's token."""
    logits, t = _dists()
    logits.requires_grad_(True)
    L.full_divergence(torch.log_softmax(logits, -1), t, torch.ones(1, 1), 0.0).sum().backward()
    assert torch.allclose(logits.grad, torch.softmax(logits, -1).detach() - t.exp(), atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_full_divergence_is_zero_iff_student_equals_teacher(beta):
    logits, t = _dists()
    s = torch.log_softmax(logits, -1)
    m = torch.ones(1, 1)
    assert L.full_divergence(s, t, m, beta).item() > 1e-3
    same = L.full_divergence(t.clone().requires_grad_(True), t, m, beta)
    assert abs(same.item()) < 1e-6


def test_jsd_matches_its_definition_and_masks():
    logits, t = _dists(V=5, seed=3)
    s = torch.log_softmax(logits, -1)
    beta = 0.3
    p, q = s.exp(), t.exp()
    mix = (1 - beta) * p + beta * q   # TRL's GKD mixture
    expected = beta * (q * (q.log() - mix.log())).sum(-1) + (1 - beta) * (p * (p.log() - mix.log())).sum(-1)
    assert torch.allclose(L.full_divergence(s, t, torch.ones(1, 1), beta), expected, atol=1e-6)
    assert L.full_divergence(s, t, torch.zeros(1, 1), beta).item() == 0.0


def test_sharpen_is_the_teacher_at_a_temperature():
    t = torch.log_softmax(torch.tensor([[[2.0, 1.0, 0.0, -1e9]]]), -1)
    assert L.sharpen(t, 1.0) is t
    half = L.sharpen(t, 0.5)
    assert torch.allclose(half.exp().sum(-1), torch.ones(1, 1))
    assert torch.allclose(half, torch.log_softmax(torch.tensor([[[4.0, 2.0, 0.0, -2e9]]]), -1))
    # sharper: more mass on the top token, same order, the -inf column stays at 0
    assert half.exp()[0, 0, 0] > t.exp()[0, 0, 0] and half.exp()[0, 0, 3] == 0
    assert torch.equal(half.argsort(-1), t.argsort(-1))
    assert L.sharpen(t, 0.01).exp()[0, 0, 0] > 0.999


def test_top_k_rows_restrict_the_divergence_to_their_tokens():
    """A top-k teacher row (-inf outside its tokens): the student is renormalized on the
    same tokens and the divergence is taken there; full rows are left as they are."""
    import math

    from mopd.distill.step import pad_full, restrict_to_support

    torch.manual_seed(0)
    V = 7
    s = torch.log_softmax(torch.randn(2, 3, V), -1)
    t_full = torch.log_softmax(torch.randn(3, V), -1)
    keep = [0, 2, 5]
    t_top = torch.full((3, 6), float("-inf"))            # V' = 6 < V: column 6 is outside too
    t_top[:, keep] = t_full[:, keep] - torch.logsumexp(t_full[:, keep], -1, keepdim=True)
    t = pad_full([t_top, t_full], 3, V)
    assert torch.isneginf(t[0, :, 6]).all() and torch.isfinite(t[1]).all()
    s2, t2 = restrict_to_support(s, t)
    assert torch.equal(s2[1], s[1]) and torch.equal(t2[1], t[1])       # the full row: unchanged
    want_s = s[0][:, keep] - torch.logsumexp(s[0][:, keep], -1, keepdim=True)
    assert torch.allclose(s2[0][:, keep], want_s) and torch.isneginf(s2[0][:, [1, 3, 4, 6]]).all()
    for beta in (0.0, 0.5, 1.0):
        d = L.full_divergence(s2, t2, torch.ones(2, 3), beta)
        assert torch.isfinite(d).all()
    d = L.full_divergence(s2, t2, torch.ones(2, 3), 1.0)[0]
    ref = (want_s.exp() * (want_s - t_top[:, keep])).sum(-1)        # reverse KL over the kept tokens
    assert torch.allclose(d, ref, atol=1e-6) and not math.isnan(d.sum().item())
