"""Rollout backends: raw sampler log-probs, EOS handling, per-prompt seeds, and the
in-memory weight sync into the colocated vLLM engine."""
from __future__ import annotations

import pytest
import torch

from core.rollout import HFRollout, Sample, make_rollout, sample_from_logits

# Same float32 model, different kernels (oneDNN/vLLM attention vs torch SDPA): measured
# max |delta| here is ~1e-6; 1e-4 still catches any real mismatch (wrong position,
# temperature-scaled log-probs, stale weights are all >= 1e-2).
LOGPROB_TOL = 1e-4


def _max_logprob_gap(model, samples: list[Sample], reference_logprobs) -> float:
    gap = 0.0
    for s in samples:
        ref = reference_logprobs(model, s.prompt_ids, s.completion_ids)
        got = torch.tensor(s.sampler_logprobs)
        assert got.shape == ref.shape
        if len(got):
            gap = max(gap, (got - ref).abs().max().item())
    return gap


def _check_eos(samples: list[Sample], eos: int, max_new_tokens: int) -> None:
    for s in samples:
        assert len(s.completion_ids) == len(s.sampler_logprobs) >= 1
        assert eos not in s.completion_ids[:-1], "generation continued past EOS"
        if s.finished:
            assert s.completion_ids[-1] == eos
        else:
            assert len(s.completion_ids) == max_new_tokens and s.completion_ids[-1] != eos


def _fused_hf_weights(model) -> dict[str, torch.Tensor]:
    """HF parameters arranged the way vLLM stores them (fused q|k|v and gate|up)."""
    sd = {n: p.detach().cpu() for n, p in model.named_parameters()}
    out = {}
    for n, t in sd.items():
        if ".self_attn.q_proj." in n:
            out[n.replace("q_proj", "qkv_proj")] = torch.cat([t, sd[n.replace("q_proj", "k_proj")],
                                                              sd[n.replace("q_proj", "v_proj")]])
        elif ".mlp.gate_proj." in n:
            out[n.replace("gate_proj", "gate_up_proj")] = torch.cat([t, sd[n.replace("gate_proj", "up_proj")]])
        elif not any(k in n for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[n] = t
    return out


def _assert_bit_equal(sampler_w: dict[str, torch.Tensor], model) -> None:
    expected = _fused_hf_weights(model)
    assert set(sampler_w) == set(expected)
    for n, t in expected.items():
        assert sampler_w[n].dtype == t.dtype and sampler_w[n].shape == t.shape, n
        assert torch.equal(sampler_w[n], t), f"{n}: max |delta| {(sampler_w[n] - t).abs().max().item()}"


def _train_a_little(model, prompts, steps: int = 3, lr: float = 0.5) -> None:
    """A few SGD steps of next-token loss: changes every weight, like the real loop."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ids = torch.tensor([p[:8] + [5] * (8 - len(p[:8])) for p in prompts])
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


# ---- backend-independent pieces ----------------------------------------------------

def test_make_rollout_rejects_unknown_kind():
    with pytest.raises(ValueError, match=r"'hf'.*'vllm'"):
        make_rollout("sglang")


def test_sample_from_logits_greedy_top_p_and_inverse_cdf():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 2.5]])
    u = torch.tensor([0.999, 0.0])
    assert sample_from_logits(logits, u, temperature=0.0, top_p=1.0).tolist() == [1, 3]
    # top_p tiny keeps only the most likely token whatever u is.
    assert sample_from_logits(logits, u, temperature=1.0, top_p=1e-6).tolist() == [1, 3]
    # Inverse CDF: u ~ 0 picks the first token with mass, u ~ 1 the last.
    assert sample_from_logits(logits, torch.tensor([0.0, 0.0]), temperature=1.0, top_p=1.0).tolist() == [0, 0]
    assert sample_from_logits(logits, torch.tensor([0.9999, 0.9999]), temperature=1.0, top_p=1.0).tolist() == [3, 3]


def test_generate_validates_inputs(student_hf, tiny_tokenizer):
    r = HFRollout(student_hf, tiny_tokenizer)
    with pytest.raises(ValueError, match="seeds"):
        r.generate([[5, 6]], max_new_tokens=4, seeds=[])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        r.generate([[5, 6], []], max_new_tokens=4, seeds=[0, 1])


# ---- HF backend ---------------------------------------------------------------------

def test_hf_rollout_logprobs_eos_and_mode(student_hf, tiny_tokenizer, make_prompts, reference_logprobs):
    student_hf.train()
    r = make_rollout("hf", model=student_hf, tokenizer=tiny_tokenizer, batch_size=8)
    prompts = make_prompts(12, seed=1)
    samples = r.generate(prompts, max_new_tokens=24, seeds=list(range(12)))
    assert student_hf.training, "generate must restore the module's train/eval mode"
    assert [s.prompt_ids for s in samples] == prompts
    _check_eos(samples, tiny_tokenizer.eos_token_id, 24)
    assert 0 < sum(s.finished for s in samples) < len(samples)
    assert _max_logprob_gap(student_hf, samples, reference_logprobs) < LOGPROB_TOL


def test_hf_rollout_logprobs_are_raw_under_temperature_and_top_p(student_hf, tiny_tokenizer, make_prompts,
                                                                  reference_logprobs):
    r = HFRollout(student_hf, tiny_tokenizer)
    samples = r.generate(make_prompts(6, seed=2), max_new_tokens=12, temperature=0.7, top_p=0.9, seeds=list(range(6)))
    assert _max_logprob_gap(student_hf, samples, reference_logprobs) < LOGPROB_TOL


def test_hf_rollout_seed_independent_of_batch(student_hf, tiny_tokenizer, make_prompts):
    """A prompt's sample depends on (prompt, seed) only: alone, in a batch, in another
    chunking. Tolerance-free on the tokens: a row's logits move only by float noise
    between batch shapes (~1e-6), and a token flips only if its uniform lands that close
    to a CDF boundary; the log-probs are compared with a tolerance."""
    prompts = make_prompts(8, seed=3)
    seeds = [100 + i for i in range(8)]
    batched = HFRollout(student_hf, tiny_tokenizer, batch_size=64).generate(prompts, max_new_tokens=16, seeds=seeds)
    chunked = HFRollout(student_hf, tiny_tokenizer, batch_size=5).generate(prompts, max_new_tokens=16, seeds=seeds)
    alone = [HFRollout(student_hf, tiny_tokenizer).generate([p], max_new_tokens=16, seeds=[s])[0]
             for p, s in zip(prompts[:4], seeds[:4])]
    shuffled = HFRollout(student_hf, tiny_tokenizer).generate(prompts[::-1], max_new_tokens=16, seeds=seeds[::-1])[::-1]
    for other in (chunked, alone, shuffled):
        for a, b in zip(batched, other):
            assert a.completion_ids == b.completion_ids
            assert a.finished == b.finished
            assert max(abs(x - y) for x, y in zip(a.sampler_logprobs, b.sampler_logprobs)) < 1e-5
    again = HFRollout(student_hf, tiny_tokenizer).generate(prompts, max_new_tokens=16, seeds=[s + 1 for s in seeds])
    assert any(a.completion_ids != b.completion_ids for a, b in zip(batched, again))


def test_hf_rollout_shares_the_module(student_hf, tiny_tokenizer):
    r = HFRollout(student_hf, tiny_tokenizer)
    with torch.no_grad():
        student_hf.lm_head.weight.add_(1.0)
    r.sync_weights(student_hf.named_parameters())  # no-op
    w = r.read_weights()
    assert torch.equal(w["lm_head.weight"], student_hf.lm_head.weight.detach())
    r.close()


# ---- vLLM backend (one engine for the session) ------------------------------------------

@pytest.mark.vllm
def test_vllm_logprobs_match_hf_and_stop_at_eos(vllm_rollout, student_hf, tiny_tokenizer, make_prompts,
                                                reference_logprobs):
    prompts = make_prompts(16, seed=4)
    samples = vllm_rollout.generate(prompts, max_new_tokens=32, seeds=list(range(16)))
    assert [s.prompt_ids for s in samples] == prompts
    _check_eos(samples, tiny_tokenizer.eos_token_id, 32)
    assert 0 < sum(s.finished for s in samples) < len(samples)
    gap = _max_logprob_gap(student_hf, samples, reference_logprobs)
    print(f"vLLM vs HF sampler log-prob max |delta| = {gap:.3g}")
    assert gap < LOGPROB_TOL


@pytest.mark.vllm
def test_vllm_logprobs_are_raw_under_temperature_and_top_p(vllm_rollout, student_hf, make_prompts,
                                                           reference_logprobs):
    """With logprobs_mode='processed_logprobs' these would be log-probs of the tempered,
    top-p-truncated distribution and miss the model's log_softmax by >> tolerance."""
    samples = vllm_rollout.generate(make_prompts(8, seed=5), max_new_tokens=16, temperature=0.6, top_p=0.8,
                                    seeds=list(range(8)))
    assert _max_logprob_gap(student_hf, samples, reference_logprobs) < LOGPROB_TOL


@pytest.mark.vllm
def test_vllm_same_seeds_same_samples(vllm_rollout, make_prompts):
    prompts = make_prompts(8, seed=6)
    seeds = [1000 + i for i in range(8)]
    a = vllm_rollout.generate(prompts, max_new_tokens=16, seeds=seeds)
    b = vllm_rollout.generate(prompts, max_new_tokens=16, seeds=seeds)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    # Independent of batch composition and order (per-request seeded generators).
    sub = vllm_rollout.generate(prompts[5:1:-1], max_new_tokens=16, seeds=seeds[5:1:-1])[::-1]
    assert [s.completion_ids for s in sub] == [s.completion_ids for s in a[2:6]]
    c = vllm_rollout.generate(prompts, max_new_tokens=16, seeds=[s + 1 for s in seeds])
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]


@pytest.mark.vllm
def test_vllm_read_weights_match_checkpoint(vllm_rollout, student_hf):
    _assert_bit_equal(vllm_rollout.read_weights(), student_hf)


@pytest.mark.vllm
def test_vllm_sync_weights_in_memory(vllm_rollout, student_hf, make_prompts, reference_logprobs):
    prompts = make_prompts(8, seed=7)
    seeds = list(range(8))
    before = vllm_rollout.generate(prompts, max_new_tokens=16, seeds=seeds)

    for round_ in range(2):  # syncing twice: the second reload must work as well
        _train_a_little(student_hf, prompts)
        vllm_rollout.sync_weights(student_hf.named_parameters())
        _assert_bit_equal(vllm_rollout.read_weights(), student_hf)
        after = vllm_rollout.generate(prompts, max_new_tokens=16, seeds=seeds)
        gap = _max_logprob_gap(student_hf, after, reference_logprobs)
        print(f"after sync {round_ + 1}: vLLM vs updated HF log-prob max |delta| = {gap:.3g}")
        assert gap < LOGPROB_TOL
        # Same seeds, new weights: the samples change.
        assert [s.completion_ids for s in after] != [s.completion_ids for s in before]
        before = after

    # state_dict() items work too (plain tensors instead of Parameters).
    with torch.no_grad():
        for p in student_hf.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    vllm_rollout.sync_weights(student_hf.state_dict().items())
    _assert_bit_equal(vllm_rollout.read_weights(), student_hf)


@pytest.mark.vllm
def test_vllm_sync_with_missing_weights_fails_loudly(vllm_rollout, student_hf):
    partial = [(n, p) for n, p in student_hf.named_parameters() if not n.endswith("down_proj.weight")]
    with pytest.raises(RuntimeError, match="down_proj"):
        vllm_rollout.sync_weights(partial)


@pytest.mark.vllm
def test_greedy_texts_are_the_same_on_both_backends(vllm_rollout, student_hf, tiny_tokenizer, make_prompts):
    """The one greedy decoding path (`mopd eval`, the experts' scores, `--backend vllm`):
    text up to the first EOS, special tokens dropped, whichever backend decodes."""
    from core.rollout import greedy_texts
    from core.task_cost import record_tokens

    prompts = make_prompts(12, seed=7)
    with record_tokens() as hf_counts:
        hf = greedy_texts(HFRollout(student_hf, tiny_tokenizer), tiny_tokenizer, prompts, max_new_tokens=24)
    with record_tokens() as vl_counts:
        vl = greedy_texts(vllm_rollout, tiny_tokenizer, prompts, max_new_tokens=24)
    assert hf == vl
    assert hf_counts == vl_counts and len(hf_counts) == 12   # the eval's tokens per task, whichever backend
    assert any(hf) and all(tiny_tokenizer.eos_token not in t for t in hf)
    # EOS ends the text: the raw greedy tokens of some prompt run past what the text shows
    raw = HFRollout(student_hf, tiny_tokenizer).generate(prompts, max_new_tokens=24, temperature=0.0,
                                                        seeds=[0] * len(prompts))
    assert any(s.finished for s in raw)
