"""Teacher scoring: teacher-forced log-probs of exactly the student's tokens."""
from __future__ import annotations

import pytest
import torch

from teachers.scoring import HFTeacher, make_teacher

TOL = 1e-4  # float32, different kernels / batch shapes; measured max |delta| ~1e-6


def _pairs(make_prompts, n: int, seed: int):
    """Prompts of very different lengths with completions of different lengths,
    including an empty completion."""
    prompts = make_prompts(n, seed=seed, min_len=1, max_len=40)
    comps = make_prompts(n, seed=seed + 100, min_len=1, max_len=30)
    comps[1] = []
    return prompts, comps


def _max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == torch.float32
        if x.numel():
            gap = max(gap, (x - y).abs().max().item())
    return gap


def test_make_teacher_rejects_unknown_backend(tiny_teacher_dir):
    with pytest.raises(ValueError, match=r"'hf'.*'vllm'"):
        make_teacher("tgi", str(tiny_teacher_dir))


def test_hf_teacher_matches_unbatched_forward(tiny_teacher_dir, teacher_hf, make_prompts, reference_logprobs):
    prompts, comps = _pairs(make_prompts, 10, seed=0)
    teacher = make_teacher("hf", str(tiny_teacher_dir), batch_size=4)
    got = teacher.score(prompts, comps)
    assert len(got) == len(prompts)
    assert got[1].shape == (0,) and got[1].dtype == torch.float32
    for c, g in zip(comps, got):
        assert g.shape == (len(c),)
    ref = [reference_logprobs(teacher_hf, p, c) for p, c in zip(prompts, comps)]
    gap = _max_gap(got, ref)
    print(f"HFTeacher (padded batches) vs unbatched forward: max |delta| = {gap:.3g}")
    assert gap < TOL
    # Padding does not matter: one pair per batch gives the same numbers.
    assert _max_gap(HFTeacher(str(tiny_teacher_dir), batch_size=1).score(prompts, comps), got) < TOL
    assert all(t.numel() == 0 for t in teacher.score([[5, 6]], [[]]))
    assert teacher.score([], []) == []


def test_score_validates_inputs(tiny_teacher_dir):
    teacher = HFTeacher(str(tiny_teacher_dir))
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        teacher.score([[5], [6]], [[7]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        teacher.score([[]], [[7]])


@pytest.mark.vllm
def test_vllm_teacher_matches_hf(vllm_teacher, tiny_teacher_dir, teacher_hf, make_prompts, reference_logprobs):
    prompts, comps = _pairs(make_prompts, 12, seed=1)
    got = vllm_teacher.score(prompts, comps)
    assert got[1].shape == (0,)
    hf = HFTeacher(str(tiny_teacher_dir)).score(prompts, comps)
    ref = [reference_logprobs(teacher_hf, p, c) for p, c in zip(prompts, comps)]
    gap_hf, gap_ref = _max_gap(got, hf), _max_gap(got, ref)
    print(f"VLLMTeacher vs HFTeacher max |delta| = {gap_hf:.3g}; vs direct forward = {gap_ref:.3g}")
    assert gap_hf < TOL and gap_ref < TOL
    assert vllm_teacher.score([[5, 6]], [[]])[0].shape == (0,)


@pytest.mark.vllm
def test_sampler_and_teacher_engines_in_one_process(vllm_rollout, vllm_teacher, student_hf, teacher_hf,
                                                    make_prompts, reference_logprobs):
    """The MOPD step: the student's engine samples, the teacher's engine scores the same
    tokens, both alive in this process."""
    samples = vllm_rollout.generate(make_prompts(8, seed=2), max_new_tokens=16, seeds=list(range(8)))
    prompts, comps = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
    teacher_lp = vllm_teacher.score(prompts, comps)
    assert _max_gap(teacher_lp, [reference_logprobs(teacher_hf, p, c) for p, c in zip(prompts, comps)]) < TOL
    student_lp = [torch.tensor(s.sampler_logprobs) for s in samples]
    assert _max_gap(student_lp, [reference_logprobs(student_hf, p, c) for p, c in zip(prompts, comps)]) < TOL
    # Different models: the per-token reward log p_T - log p_S is not zero.
    assert max((t - s).abs().max().item() for t, s in zip(teacher_lp, student_lp)) > 1e-2
    # Sampling still works after the teacher ran.
    assert len(vllm_rollout.generate(prompts[:2], max_new_tokens=4, seeds=[0, 1])) == 2


TOPK_TOL = 1e-4   # float32 log-probs, vLLM's kernels vs HF's; measured max |delta| in the results page


@pytest.mark.vllm
def test_vllm_teacher_top_k_rows_match_hf_top_k(vllm_teacher, tiny_teacher_dir, make_prompts, monkeypatch):
    """top_k > 0 on the in-process vLLM teacher: score_full gives, at each completion
    position, the teacher's k most likely tokens (and the sampled one) renormalized over
    themselves, -inf elsewhere; the same rows the HF teacher's whole distribution gives
    when cut to those tokens, within TOPK_TOL, and the tokens are the HF top k."""
    k = 5
    prompts, comps = _pairs(make_prompts, 8, seed=3)
    with pytest.raises(ValueError, match="top_k > 0"):
        vllm_teacher.score_full(prompts, comps)
    assert not vllm_teacher.full_distributions
    monkeypatch.setattr(vllm_teacher, "top_k", k)     # the session's engine; max_logprobs 20 holds k=5
    assert vllm_teacher.full_distributions
    got = vllm_teacher.score_full(prompts, comps)
    want = HFTeacher(str(tiny_teacher_dir), device="cpu").score_full(prompts, comps)
    assert got[1].numel() == 0
    gap = 0.0
    for c, g, w in zip(comps, got, want):
        if not c:
            continue
        assert g.shape[0] == len(c)
        for pos in range(len(c)):
            keep = torch.isfinite(g[pos])
            # the sampled token is always there; the rest are the HF top k (up to near-ties)
            assert keep[c[pos]] and k <= keep.sum() <= k + 1
            hf_kth = w[pos].topk(k).values[-1]
            assert (w[pos, :g.shape[1]][keep] >= hf_kth - TOPK_TOL).sum() >= k
            ref = w[pos, :g.shape[1]][keep]
            gap = max(gap, (g[pos][keep] - (ref - torch.logsumexp(ref, 0))).abs().max().item())
            assert torch.allclose(g[pos].exp().sum(), torch.tensor(1.0), atol=1e-5)
    print(f"VLLMTeacher top-{k} rows vs HF top-{k} renormalized: max |delta| = {gap:.3g}")
    assert gap < TOPK_TOL
