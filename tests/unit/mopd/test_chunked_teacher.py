"""Chunked logits on the teacher's side (issue 33, part 4): with loss.logits_chunk > 0 an
in-process hf teacher gives its final hidden states and output head (`HeadRows`) instead
of whole [len, V] log-prob rows, and the loss makes the teacher's rows a chunk at a time.
Through the router the loop uses and `train_step`: the loss and gradients of the whole rows,
for the forward and the reverse KL, with a teacher whose vocabulary is padded past the
tokenizer's; and no teacher row wider than a chunk is ever made."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import Grab

from core.rollout import Sample
from mopd.distill.config import LossConfig
from mopd.distill.step import SingleProcess, train_step
from teachers.routing import TeacherRouter
from teachers.scoring import HeadRows, HFTeacher

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 7


@pytest.fixture(scope="module")
def padded_teacher(tiny_teacher_dir, tmp_path_factory):
    """The tiny teacher with 64 extra vocabulary rows (no tokenizer id maps to them) that
    carry real probability mass, so renormalizing over len(tokenizer) matters."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_teacher_dir))
    V = m.get_output_embeddings().weight.shape[0]
    m.resize_token_embeddings(V + 64, mean_resizing=False)
    with torch.no_grad():
        m.get_output_embeddings().weight[V:].normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    out = tmp_path_factory.mktemp("models") / "padded-teacher"
    m.save_pretrained(out)
    return HFTeacher(str(out), device="cpu")


@pytest.fixture(scope="module")
def batch(tiny_student_dir):
    from transformers import AutoModelForCausalLM

    from core.models import collate, completion_logprobs

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (int(k),), generator=g).tolist() for k in (3, 9, 1, 14, 6)]
    comps = [torch.randint(10, 2000, (int(k),), generator=g).tolist() for k in (5, 8, 0, 3, 11)]
    student = AutoModelForCausalLM.from_pretrained(str(tiny_student_dir))
    with torch.no_grad():
        own = completion_logprobs(student, collate(prompts, comps, 0, {}))
    samples = [Sample(prompt_ids=p, completion_ids=c, finished=True, sampler_logprobs=own[i, :len(c)].tolist())
               for i, (p, c) in enumerate(zip(prompts, comps))]
    rows = [SimpleNamespace(ids=p, teacher_key="t") for p in prompts]
    return rows, samples


def _scored(teacher, batch, chunk):
    rows, samples = batch
    lp, full = [None] * len(rows), [None] * len(rows)
    TeacherRouter({"t": teacher}, logits_chunk=chunk).score(rows, samples, range(len(rows)), True, lp, full)
    return lp, full


def _update(student_dir, batch, scored, loss_cfg):
    from core.models import build_student

    rows, samples = batch
    lp, full = scored
    model = build_student(str(student_dir))
    model.train()
    opt = Grab(model.parameters())
    n = len(samples)
    res = train_step(SingleProcess(), model, opt, SimpleNamespace(step=lambda: None), loss_cfg=loss_cfg,
                     grad_clip=0.0, prompt_ids=[r.ids for r in rows], samples=samples, teacher_lp=lp,
                     teacher_full=full, off_B=torch.zeros(n, dtype=torch.bool), task_reward_B=torch.zeros(n),
                     domain_ids_B=torch.zeros(n, dtype=torch.long), n_domains=1, pad_id=0, vocab=2048)
    return res, opt.grads


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_chunked_teacher_gives_the_whole_rows_loss_and_gradient(tiny_student_dir, padded_teacher, batch, beta):
    whole = _scored(padded_teacher, batch, 0)
    chunked = _scored(padded_teacher, batch, CHUNK)
    assert all(isinstance(f, torch.Tensor) for f in whole[1])
    assert all(isinstance(f, HeadRows) for f in chunked[1])
    assert chunked[1][0].shape == whole[1][0].shape and whole[1][0].shape[-1] == 2048 + 64
    for a, b in zip(whole[0], chunked[0]):   # the sampled tokens' log-probs (kl=sampled's reward, metrics)
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    cfg = LossConfig(kl="full", beta=beta)
    ref_res, ref_g = _update(tiny_student_dir, batch, whole, cfg)
    res, g = _update(tiny_student_dir, batch, chunked, LossConfig(kl="full", beta=beta, logits_chunk=CHUNK))
    assert abs(res.loss.item() - ref_res.loss.item()) <= 1e-5 * max(1.0, abs(ref_res.loss.item()))
    assert len(g) == len(ref_g) and any(x.abs().sum() > 0 for x in g)
    for x, y in zip(g, ref_g):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4), (x - y).abs().max()
    assert torch.allclose(res.kl_log_BT, ref_res.kl_log_BT, atol=1e-5)


def test_chunked_teacher_never_makes_a_whole_row(tiny_student_dir, padded_teacher, batch, monkeypatch):
    """The teacher's whole-row method is not called, and every teacher row block the loss
    and the router make is at most a chunk of positions long."""
    made = []
    get = HeadRows.__getitem__

    def spy(self, idx):
        out = get(self, idx)
        made.append(out.shape[0] if out.dim() == 2 else 1)
        return out

    def whole(*a, **k):
        raise AssertionError("score_full called with loss.logits_chunk > 0")

    monkeypatch.setattr(HeadRows, "__getitem__", spy)
    monkeypatch.setattr(HFTeacher, "score_full", whole)
    scored = _scored(padded_teacher, batch, CHUNK)
    _update(tiny_student_dir, batch, scored, LossConfig(kl="full", logits_chunk=CHUNK))
    assert made and max(made) <= CHUNK
    assert max(len(c.completion_ids) for c in batch[1]) > CHUNK   # a row longer than a chunk was split


def test_a_teacher_with_logit_softcapping_is_refused(padded_teacher, batch, monkeypatch):
    monkeypatch.setattr(padded_teacher.model.config, "final_logit_softcapping", 30.0, raising=False)
    with pytest.raises(ValueError, match=r"teacher .*padded-teacher.*final_logit_softcapping.*logits_chunk=0"):
        _scored(padded_teacher, batch, CHUNK)


def test_teacher_correction_reads_head_rows_as_whole_rows(padded_teacher, batch):
    """rollout.correct_below reads the teacher's rows too: the same position and token."""
    from teachers.routing import first_to_correct

    whole, chunked = _scored(padded_teacher, batch, 0)[1], _scored(padded_teacher, batch, CHUNK)[1]
    found = 0
    for w, c, s in zip(whole, chunked, batch[1]):
        t = first_to_correct(w, s.completion_ids, 0.5)
        assert first_to_correct(c, s.completion_ids, 0.5) == t
        if t is not None:
            found += 1
            assert int(c[t].argmax()) == int(w[t].argmax())
    assert found
