"""Correct on real checkpoints (issue 44): each pitfall peer projects shipped in their
distillation code, through `train_step` (the code the loop runs) on tiny models whose
exact answers are known. docs/pitfalls.md lists each pitfall with its test here or
elsewhere. The `mopd distill` runs of the same pitfalls are in test_pitfalls_distill.py."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import Grab

from mopd.distill.config import LossConfig
from mopd.distill.step import SingleProcess as OneProcess, train_step
from core.models import collate, completion_logprobs, disable_dropout, pad_batch, pad_id_of
from core.rollout import Sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


NO_SCHED = SimpleNamespace(step=lambda: None)


class Bigram(torch.nn.Module):
    """A language model over a tiny vocabulary: the next token's logits are a row of W
    picked by the previous token (plus `extra` columns: a padded vocabulary)."""

    def __init__(self, W: torch.Tensor, extra: torch.Tensor | None = None):
        super().__init__()
        self.W = torch.nn.Parameter(W.clone())
        self.extra = extra

    def forward(self, input_ids, attention_mask=None):
        logits = self.W[input_ids]
        if self.extra is not None:
            logits = torch.cat([logits, self.extra[input_ids]], dim=-1)
        return SimpleNamespace(logits=logits)


def _step(model, rows, loss_cfg, *, teacher_lp, teacher_full=None, sampler_lp=None, domains=None, sampling=None,
          vocab=None, pad_id=0, off=None):
    """train_step on one-token completions `rows` = [(prompt_ids, completion_ids)], lr-free:
    returns (result, gradients)."""
    opt = Grab(model.parameters())
    if sampler_lp is None:   # the model's own log-probs: importance weight 1
        with torch.no_grad():
            own = completion_logprobs(model, collate([p for p, _ in rows], [c for _, c in rows], 0, {}))
        sampler_lp = [own[i, :len(c)].tolist() for i, (_, c) in enumerate(rows)]
    samples = [Sample(prompt_ids=list(p), completion_ids=list(c), finished=True, sampler_logprobs=list(sampler_lp[i]))
               for i, (p, c) in enumerate(rows)]
    dom = torch.tensor(domains or [0] * len(rows))
    res = train_step(OneProcess(), model, opt, NO_SCHED, loss_cfg=loss_cfg, grad_clip=0.0,
                     prompt_ids=[list(p) for p, _ in rows], samples=samples, teacher_lp=teacher_lp,
                     teacher_full=teacher_full or [None] * len(rows),
                     off_B=torch.tensor(off or [False] * len(rows)), task_reward_B=torch.zeros(len(rows)),
                     domain_ids_B=dom, n_domains=int(dom.max()) + 1, pad_id=pad_id, vocab=vocab, sampling=sampling)
    return res, opt.grads


# ---------------------------------------------------------------- exact expectations on a tiny vocabulary
V = 4
W0 = torch.tensor([[1.0, -0.5, 0.3, 2.0], [0.2, 0.1, -1.0, 0.5], [-0.3, 1.5, 0.0, 0.4], [0.7, -0.2, 0.9, -1.1]])
WT = torch.tensor([[0.1, 0.4, 1.2, -0.3], [1.0, -1.0, 0.3, 0.2], [0.5, 0.5, -0.5, 1.0], [-0.4, 0.6, 0.2, 0.8]])
LPT = torch.log_softmax(WT, -1)     # the teacher's next-token log-probs after each token


def _true_gradient(prompts: list[int]) -> torch.Tensor:
    """grad_W of the mean over rows of KL(p(. | prompt) || p_T(. | prompt)), temperature 1."""
    W = W0.clone().requires_grad_(True)
    kl = torch.stack([(torch.softmax(W[p], -1) * (torch.log_softmax(W[p], -1) - LPT[p])).sum() for p in prompts])
    kl.mean().backward()
    return W.grad


def _expected_gradient(prompts: list[int], loss_cfg: LossConfig, *, temperature: float = 1.0, domains=None,
                       sampling: bool = True) -> torch.Tensor:
    """E over every joint draw of the rows' one-token completions, each from the sampler's
    distribution softmax(W / temperature), of the gradient train_step applies."""
    lp1 = torch.log_softmax(W0, -1)
    q = torch.softmax(W0 / temperature, -1)
    model = Bigram(W0)
    total = torch.zeros_like(W0)
    for ys in itertools.product(range(V), repeat=len(prompts)):
        prob = math.prod(float(q[p, y]) for p, y in zip(prompts, ys))
        _, (g,) = _step(model, [([p], [y]) for p, y in zip(prompts, ys)], loss_cfg,
                        teacher_lp=[[float(LPT[p, y])] for p, y in zip(prompts, ys)],
                        sampler_lp=[[float(lp1[p, y])] for p, y in zip(prompts, ys)],   # raw, as every backend
                        domains=domains,
                        sampling=[SimpleNamespace(temperature=temperature, top_p=1.0)] * len(prompts)
                        if sampling else None)
        total += prob * g
    return total


def test_sampled_estimator_at_temperature_1_is_the_reverse_kl_gradient():
    g = _expected_gradient([0, 1], LossConfig(baseline="none"))
    assert torch.allclose(g, _true_gradient([0, 1]), atol=1e-6)


def test_at_temperature_07_the_step_trains_the_temperature_1_student_in_expectation():
    """The documented choice (mopd/distill/loss.py): samples drawn at temperature 0.7, both
    log-probs raw; the step's expected gradient is that of KL(p_1 || p_T), the student
    loss.kl=full trains, by the weight p_1 / p_0.7 the trainer computes itself."""
    truth = _true_gradient([0, 2])
    g = _expected_gradient([0, 2], LossConfig(baseline="none"), temperature=0.7)
    assert torch.allclose(g, truth, atol=1e-6), (g - truth).abs().max()
    # without the rows' sampling settings (the step before issue 44) it is another gradient
    g_old = _expected_gradient([0, 2], LossConfig(baseline="none"), temperature=0.7, sampling=False)
    assert (g_old - truth).abs().max() > 1e-2


def test_leave_one_out_baseline_is_unbiased_where_the_domain_mean_is_not():
    """Three rows, two of domain 0 and one of domain 1: with the leave-one-out baseline the
    expected gradient is the true one; the domain mean (each row's own advantage in its
    baseline) shrinks it, an O(1/N) bias."""
    prompts, domains = [0, 1, 3], [0, 0, 1]
    truth = _true_gradient(prompts)
    loo = _expected_gradient(prompts, LossConfig(baseline="leave_one_out"), domains=domains)
    assert torch.allclose(loo, truth, atol=1e-6), (loo - truth).abs().max()
    mean = _expected_gradient(prompts, LossConfig(baseline="domain_mean"), domains=domains)
    assert (mean - truth).abs().max() > 1e-2
    assert LossConfig().baseline == "leave_one_out"


def test_leave_one_out_with_temperature_and_a_lone_row():
    """Both at once, and a domain of one row (its baseline is 0, not its own mean)."""
    truth = _true_gradient([1, 2, 0])
    g = _expected_gradient([1, 2, 0], LossConfig(baseline="leave_one_out"), temperature=0.7, domains=[0, 0, 1])
    assert torch.allclose(g, truth, atol=1e-6)


def test_leave_one_out_baseline_values():
    from mopd.distill import loss as L

    adv = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [5.0, 7.0, 9.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    onehot = torch.nn.functional.one_hot(torch.tensor([0, 0, 0, 1]), 2).float()
    b = L.leave_one_out_baseline(adv, mask, onehot)
    assert b.tolist() == pytest.approx([(2 + 21) / 4, (4 + 21) / 5, (4 + 2) / 3, 0.0])


@pytest.mark.parametrize("override, says", [
    ("rollout.temperature=0", "temperature=0 \\(greedy\\) with loss.kl=sampled"),
    ("rollout.top_p=0.9", "top_p=0.9 with loss.kl=sampled"),
    ("rollout.by_domain={a: {top_p: 0.5}}", "rollout.by_domain.a: top_p=0.5"),
])
def test_sampled_estimator_refuses_what_it_cannot_correct(override, says):
    from core.config import ConfigError, load_config
    from mopd.distill.config import DistillConfig

    base = ["model.path=x", "data.datasets=[{path: d.jsonl}]", "teachers={a: {path: t}}", "rollout.backend=hf"]
    with pytest.raises(ConfigError, match=says):
        load_config(DistillConfig, None, base + [override])
    load_config(DistillConfig, None, base + [override, "loss.kl=full"])   # exact over the vocabulary: any sampling
    load_config(DistillConfig, None, base + ["rollout.temperature=0.7"])  # corrected: allowed


# ---------------------------------------------------------------- padded vocabularies, -inf
N = 4    # the ids the tokenizer produces


def _full_rows(W, extra, prompts):
    logits = W[prompts] if extra is None else torch.cat([W[prompts], extra[prompts]], -1)
    return [torch.log_softmax(r, -1)[None] for r in logits]


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
@pytest.mark.parametrize("padded", ["student", "teacher"])
def test_padded_vocabulary_gives_the_loss_of_the_sliced_pair(beta, padded):
    """A student or teacher with rows no tokenizer id reaches (Qwen2.5-0.5B 151,936 vs 7B
    152,064), with much mass on them: the loss and gradient are those of the pair with the
    padding rows sliced off, and the loss is never negative."""
    g = torch.Generator().manual_seed(0)
    extra = torch.randn(V, 3, generator=g) + 1.0     # padding rows with real mass (random init)
    prompts, ys = [0, 2, 1], [3, 1, 0]
    rows = [([p], [y]) for p, y in zip(prompts, ys)]
    cfg = LossConfig(kl="full", beta=beta, baseline="none")
    lp_t = [[float(LPT[p, y])] for p, y in zip(prompts, ys)]
    sliced, g_sliced = _step(Bigram(W0), rows, cfg, teacher_lp=lp_t, teacher_full=_full_rows(WT, None, prompts),
                             vocab=N)
    student = Bigram(W0, extra if padded == "student" else None)
    teacher_full = _full_rows(WT, extra if padded == "teacher" else None, prompts)
    for vocab in (N, None):    # the loop passes len(tokenizer); None: the narrower model
        res, grads = _step(student, rows, cfg, teacher_lp=lp_t, teacher_full=teacher_full, vocab=vocab)
        assert abs(res.loss.item() - sliced.loss.item()) < 1e-4 and res.loss.item() > -1e-6
        assert torch.allclose(grads[0], g_sliced[0], atol=1e-5)
        assert torch.allclose(res.kl_log_BT, sliced.kl_log_BT, atol=1e-5) and (res.kl_log_BT >= -1e-6).all()


def test_padded_top_k_teacher_rows_drop_ids_past_the_tokenizer():
    """A top-k teacher row whose k tokens include a padding id: that id leaves, the rest is
    renormalized, the student renormalized on the same support."""
    from mopd.distill.step import divergence_inputs

    s = torch.log_softmax(torch.randn(1, 1, 6), -1)
    t = torch.full((1, 6), float("-inf"))
    t[0, [0, 2, 5]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    s2, t2, _ = divergence_inputs(s, [t], 1, 4, 1.0)
    assert t2.shape[-1] == 4 and torch.allclose(t2[0, 0, [0, 2]].exp(), torch.tensor([0.625, 0.375]))
    assert torch.isneginf(s2[0, 0, [1, 3]]).all() and torch.allclose(s2[0, 0, [0, 2]].exp().sum(), torch.tensor(1.0))


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
def test_student_with_minus_inf_logits_gives_finite_loss_and_gradient(beta):
    """A student that masks part of its vocabulary with -inf logits (p = 0 there): each
    zero-probability token contributes 0 (not 0 * -inf = nan), and the result is the
    limit of a very negative logit. The forward KL needs the teacher at 0 there too."""
    mask_col = 1
    W = W0.clone()
    W[:, mask_col] = float("-inf")
    WT2 = WT.clone()
    if beta == 0.0:
        WT2[:, mask_col] = float("-inf")
    prompts, ys = [0, 2], [3, 0]
    rows = [([p], [y]) for p, y in zip(prompts, ys)]
    cfg = LossConfig(kl="full", beta=beta, baseline="none")
    tf = _full_rows(WT2, None, prompts)
    lp_t = [[float(r[0, y])] for r, y in zip(tf, ys)]
    res, grads = _step(Bigram(W), rows, cfg, teacher_lp=lp_t, teacher_full=tf, vocab=N)
    assert math.isfinite(res.loss.item()) and torch.isfinite(grads[0][:, [0, 2, 3]]).all()
    W_lim = W0.clone()
    W_lim[:, mask_col] = -60.0
    ref, g_ref = _step(Bigram(W_lim), rows, cfg, teacher_lp=lp_t, teacher_full=tf, vocab=N)
    assert abs(res.loss.item() - ref.loss.item()) < 1e-5
    assert torch.allclose(torch.nan_to_num(grads[0]), g_ref[0], atol=1e-5)


def test_padding_with_an_id_whose_logit_is_minus_inf_is_not_nan():
    """Pad id at a -inf logit (a masked vocabulary row): the padding positions' log-probs
    are -inf, and must not turn the loss nan through 0 * -inf."""
    W = W0.clone()
    W[:, 1] = float("-inf")
    rows = [([0], [3, 2]), ([2], [0])]        # row 2 is padded with id 1
    res, grads = _step(Bigram(W), rows, LossConfig(baseline="none"), teacher_lp=[[-1.0, -2.0], [-1.5]],
                       sampler_lp=[[float(torch.log_softmax(W, -1)[0, 3]), float(torch.log_softmax(W, -1)[3, 2])],
                                   [float(torch.log_softmax(W, -1)[2, 0])]], pad_id=1)
    assert math.isfinite(res.loss.item()) and torch.isfinite(grads[0][:, [0, 2, 3]]).all()


# ---------------------------------------------------------------- pad tokens
def test_a_tokenizer_without_a_pad_token_pads_and_masks_by_length():
    """pad_id None (Llama 3): ids pad with 0, masks from lengths; with pad == EOS the rows'
    own first EOS stays in the loss and the padding does not."""
    eos = 2
    b = collate([[5], [6, 7]], [[9, 8, eos], [eos]], None, {})
    assert b["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    b_eos = collate([[5], [6, 7]], [[9, 8, eos], [eos]], eos, {})
    assert b_eos["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b_eos["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b_eos["input_ids"].tolist() == [[5, 9, 8, eos], [6, 7, eos, eos]]
    ids, attn = pad_batch([[1, 2], [3]], None, side="left")
    assert ids.tolist() == [[1, 2], [0, 3]] and attn.tolist() == [[1, 1], [0, 1]]
    assert pad_id_of(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    assert pad_id_of(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3


def test_train_step_with_no_pad_token_equals_any_pad_id():
    """The batch padding id never reaches the loss: None, EOS or any other id give the same
    step, and the EOS each row ends with is trained."""
    rows = [([0, 3], [1, 2, 3]), ([2], [0])]
    lp1 = torch.log_softmax(W0, -1)
    samp = [[float(lp1[3, 1]), float(lp1[1, 2]), float(lp1[2, 3])], [float(lp1[2, 0])]]
    out = [_step(Bigram(W0), rows, LossConfig(), teacher_lp=[[-1.0, -0.5, -2.0], [-0.7]], sampler_lp=samp, pad_id=p)
           for p in (None, 3, 1)]
    for res, g in out[1:]:
        assert torch.equal(res.loss, out[0][0].loss) and torch.equal(g[0], out[0][1][0])
    assert out[0][0].mask_BT.tolist() == [[1, 1, 1], [1, 0, 0]]


# ---------------------------------------------------------------- mixed prompt lengths
def test_mixed_prompt_lengths_give_each_rows_unpadded_logprobs(student_hf, reference_logprobs, make_prompts):
    """Prompts of 1 to 108 tokens in one right-padded batch: each completion's log-probs
    are those of its own unpadded forward (no shift from the padding)."""
    prompts = make_prompts(4, seed=3, min_len=1, max_len=108) + [[7], list(range(10, 118))]
    g = torch.Generator().manual_seed(1)
    comps = [torch.randint(4, 2000, (int(k),), generator=g).tolist() for k in (5, 1, 9, 3, 7, 2)]
    batch = collate(prompts, comps, 3, {})
    with torch.no_grad():
        lp = completion_logprobs(student_hf.eval(), batch)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        assert torch.allclose(lp[i, :len(c)], reference_logprobs(student_hf, p, c), atol=2e-5)
        assert (lp[i, len(c):] == 0).all()


# ---------------------------------------------------------------- dropout
def _llama_dir(root, tok, *, attention_dropout=0.1, vocab_size=None, pad=True):
    """A tiny Llama-3-style checkpoint with the project tokenizer: attention_dropout on, and
    (pad=False) a tokenizer without a pad token, as Llama 3's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size or len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      attention_dropout=attention_dropout, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if pad else None, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg)
    m.save_pretrained(str(root))
    if not pad:
        tok = type(tok).from_pretrained(tok.name_or_path)
        tok.pad_token = None
    tok.save_pretrained(str(root))
    return root


@pytest.mark.parametrize("lora", [False, True], ids=["attention_dropout", "lora_dropout"])
def test_student_log_probs_in_train_mode_match_the_sampler(tmp_path, tiny_tokenizer, make_prompts, lora):
    """A checkpoint with attention_dropout 0.1, or a LoRA adapter with dropout 0.1: the
    student as the loop builds it, in train mode, gives the eval-mode (sampler) log-probs
    to 1e-5; with model.dropout=true it does not, and says so."""
    from mopd.distill.config import LoraConfig
    from core.models import build_student

    path = _llama_dir(tmp_path / "m", tiny_tokenizer, attention_dropout=0.0 if lora else 0.1)
    lcfg = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"]) if lora else None
    prompts = make_prompts(3, seed=0, min_len=4, max_len=12)
    comps = make_prompts(3, seed=1, min_len=6, max_len=10)
    batch = collate(prompts, comps, 0, {})

    def gap(model):
        if lora:   # a trained adapter: B != 0, so the branch (and its dropout) matters
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.5)
        model.eval()
        with torch.no_grad():
            ref = completion_logprobs(model, batch)
        model.train()
        torch.manual_seed(1)
        with torch.no_grad():
            got = completion_logprobs(model, batch)
        return (got - ref).abs().max().item()

    assert gap(build_student(str(path), lora=lcfg)) <= 1e-5
    with pytest.warns(UserWarning, match="model.dropout=true: dropout stays on"):
        kept = build_student(str(path), lora=lcfg, dropout=True)
    assert gap(kept) > 1e-3


def test_disable_dropout_covers_modules_and_attention_floats(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(_llama_dir(tmp_path / "m", tiny_tokenizer)))
    assert m.model.layers[0].self_attn.attention_dropout == 0.1
    assert disable_dropout(m) >= 2
    assert m.model.layers[0].self_attn.attention_dropout == 0.0 and m.config.attention_dropout == 0.1


def test_teachers_score_without_dropout(tmp_path, tiny_tokenizer, make_prompts, reference_logprobs):
    """A teacher checkpoint with attention_dropout 0.1 scores deterministically (eval mode)."""
    from transformers import AutoModelForCausalLM

    from teachers.scoring import HFTeacher

    path = _llama_dir(tmp_path / "t", tiny_tokenizer)
    t = HFTeacher(str(path), device="cpu")
    prompts, comps = make_prompts(2, seed=4), make_prompts(2, seed=5, min_len=3, max_len=6)
    ref = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    for p, c, lp in zip(prompts, comps, t.score(prompts, comps)):
        assert torch.allclose(lp, reference_logprobs(ref, p, c), atol=1e-5)


def test_grpo_stage_turns_dropout_off(tmp_path, tiny_tokenizer, monkeypatch):
    """The experts' RL stage (TRL GRPO, and the agent domains' own GRPO loop) trains a
    policy whose dropout is off: its ratios compare log-probs with the sampler's."""
    from transformers import AutoModelForCausalLM

    import experts.run as R

    seen = {}

    class Own:
        @staticmethod
        def train_rl(cfg, domain, model, tok, train_ds, out):
            seen["attn"] = [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")]
            return model

    monkeypatch.setattr(R.registry, "domain_trainer", lambda d: Own)
    m = AutoModelForCausalLM.from_pretrained(str(_llama_dir(tmp_path / "m", tiny_tokenizer)))
    cfg = SimpleNamespace(domain="x", stage="rl", model=SimpleNamespace(keep_adapter=False, path=str(tmp_path / "m")))
    R.train(cfg, None, m, tiny_tokenizer, None, tmp_path / "out")
    assert seen["attn"] and set(seen["attn"]) == {0.0}


# ---------------------------------------------------------------- teachers
def test_bf16_teacher_scores_in_float32(tiny_teacher_dir, make_prompts):
    """A bfloat16 teacher: its log-softmax is taken in float32 (rows normalized to 1e-5, not
    bf16's 1e-2), so a bf16 teacher's rewards are not rounding noise."""
    from teachers.scoring import HFTeacher

    t = HFTeacher(str(tiny_teacher_dir), dtype="bfloat16", device="cpu")
    prompts, comps = make_prompts(2, seed=6), make_prompts(2, seed=7, min_len=3, max_len=5)
    full = t.score_full(prompts, comps)
    for rows, lp, c in zip(full, t.score(prompts, comps), comps):
        assert rows.dtype == torch.float32 and torch.logsumexp(rows, -1).abs().max() < 1e-5
        assert torch.allclose(rows.gather(-1, torch.tensor(c)[:, None]).squeeze(-1), lp, atol=1e-6)


def test_a_teacher_vocabulary_below_the_tokenizer_is_refused_naming_both_sizes(tiny_teacher_dir, tiny_tokenizer,
                                                                              tmp_path):
    """Teacher rows cut below the tokenizer cannot be renormalized into the student's
    distribution: the fit check (before any model loads) names both sizes."""
    import json
    import shutil

    from teachers.resolve import check_fit

    small = tmp_path / "small_teacher"
    shutil.copytree(tiny_teacher_dir, small)
    c = json.loads((small / "config.json").read_text())
    c["vocab_size"] = 1000
    (small / "config.json").write_text(json.dumps(c))
    fit = check_fit(tiny_tokenizer, small)
    assert not fit.ok and "embedding has 1000 rows" in fit.problems[0] and "2048 tokens" in fit.problems[0]
    assert check_fit(tiny_tokenizer, tiny_teacher_dir).ok
