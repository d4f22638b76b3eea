"""Memory settings of the update (issue 33, part 4): chunked logits (`loss.logits_chunk`)
and micro-batches with gradient accumulation (`train.micro_batches`) give the update of
the plain step, through `train_step` on the tiny student and teacher and through `mopd
distill`. The memory itself is measured by bench/chunked_loss.py
(tests/unit/bench/test_bench_chunked_loss.py runs it small)."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import Grab

from mopd.distill.config import LossConfig
from mopd.distill.step import SingleProcess as OneProcess, train_step
from core.rollout import Sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rows(tiny_student_dir, teacher_hf, tiny_tokenizer):
    """Six rows of mixed lengths (one agent transcript with an observation, one empty
    completion, one teacher-forced), the teacher's full rows: two with 64 padding columns
    (renormalized away), one top-k row set, the rest plain."""
    from core.models import collate, completion_logprobs
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(str(tiny_student_dir))
    prompts = [torch.randint(10, 2000, (int(k),), generator=g).tolist() for k in (3, 9, 1, 14, 6, 5)]
    comps = [torch.randint(10, 2000, (int(k),), generator=g).tolist() for k in (5, 8, 0, 3, 11, 6)]
    masks = [None, [1, 1, 0, 0, 1, 1, 1, 1], None, None, None, None]
    b = collate(prompts, comps, 0, {})
    with torch.no_grad():
        own = completion_logprobs(student, b)
        full = torch.log_softmax(teacher_hf(b["input_ids"]).logits[:, :-1].float(), -1)
    tf, tl = [], []
    for i, (p, c) in enumerate(zip(prompts, comps)):
        r = full[i, len(p) - 1:len(p) - 1 + len(c)]
        # the sampled-token log-probs (kl=sampled) from the teacher's whole row
        tl.append(r.gather(-1, torch.tensor(c, dtype=torch.long)[:, None]).squeeze(-1).tolist() if c else [])
        if i in (1, 4):    # a padded teacher vocabulary
            r = torch.log_softmax(torch.cat([r, torch.randn(len(c), 64, generator=g)], -1), -1)
        if i == 3:         # top-k rows
            keep = r.topk(20, -1).indices
            r = torch.full_like(r, float("-inf")).scatter(-1, keep, r.gather(-1, keep))
            r = r - torch.logsumexp(r, -1, keepdim=True)
        tf.append(r)
    samples = [Sample(prompt_ids=p, completion_ids=c, finished=True, sampler_logprobs=own[i, :len(c)].tolist(),
                      loss_mask=masks[i]) for i, (p, c) in enumerate(zip(prompts, comps))]
    return {"samples": samples, "teacher_lp": tl, "teacher_full": tf, "dir": tiny_student_dir,
            "off": torch.tensor([False, False, False, False, False, True]),
            "domains": torch.tensor([0, 1, 0, 1, 0, 1]), "task": torch.tensor([0.2, 0.9, 0.5, 0.1, 0.7, 0.3])}


def _update(rows, loss_cfg, *, micro_batches=1, temperature=1.0, lora=False, gradient_checkpointing=False):
    from mopd.distill.config import LoraConfig
    from core.models import build_student

    torch.manual_seed(0)   # the same LoRA init every time
    model = build_student(str(rows["dir"]), lora=LoraConfig(enabled=True, r=4, alpha=8) if lora else None,
                          gradient_checkpointing=gradient_checkpointing)
    model.train()
    if lora:   # a trained adapter, so its branch is in the gradient
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    opt = Grab(p for p in model.parameters() if p.requires_grad)
    s = rows["samples"]
    res = train_step(OneProcess(), model, opt, SimpleNamespace(step=lambda: None), loss_cfg=loss_cfg, grad_clip=0.0,
                     prompt_ids=[x.prompt_ids for x in s], samples=s, teacher_lp=rows["teacher_lp"],
                     teacher_full=rows["teacher_full"], off_B=rows["off"], task_reward_B=rows["task"],
                     domain_ids_B=rows["domains"], n_domains=2, pad_id=0, vocab=2048,
                     sampling=[SimpleNamespace(temperature=temperature, top_p=1.0)] * len(s),
                     micro_batches=micro_batches)
    return res, opt.grads


def _same(a, b, tol=1e-5):
    (ra, ga), (rb, gb) = a, b
    assert abs(ra.loss.item() - rb.loss.item()) <= tol * max(1.0, abs(rb.loss.item()))
    assert len(ga) == len(gb) and len(ga) > 0
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, atol=tol, rtol=1e-4), (x - y).abs().max()
    for f in ("mask_BT", "trainer_lp_BT", "kl_log_BT"):
        assert torch.allclose(getattr(ra, f), getattr(rb, f), atol=tol)
    assert torch.allclose(ra.isw.weights_BT, rb.isw.weights_BT, atol=tol)


CASES = {
    "full-reverse": LossConfig(kl="full"),
    "full-forward-sharpened": LossConfig(kl="full", beta=0.0, teacher_temperature=0.5),
    "full-jsd-task-reward": LossConfig(kl="full", beta=0.5, task_reward_alpha=0.5, baseline="domain_mean"),
    "sampled-discounted": LossConfig(kl="sampled", discount=0.9, task_reward_alpha=0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_logits_give_the_unchunked_loss_and_gradient(rows, case):
    cfg = CASES[case]
    plain = _update(rows, cfg, temperature=0.7)
    _same(_update(rows, dataclasses.replace(cfg, logits_chunk=7), temperature=0.7), plain)


def test_chunked_logits_through_a_lora_student(rows):
    cfg = LossConfig(kl="full", beta=0.5)
    _same(_update(rows, dataclasses.replace(cfg, logits_chunk=5), lora=True), _update(rows, cfg, lora=True))


@pytest.mark.parametrize("case", ["sampled-discounted", "full-jsd-task-reward"])
@pytest.mark.parametrize("micro", [2, 4])
def test_micro_batches_make_the_update_of_one_batch(rows, case, micro):
    """The rows in `micro` micro-batches, gradients accumulated: the same gradient (and so
    the same optimizer step), loss and metrics' inputs; the baselines still see the whole
    minibatch (leave-one-out / domain mean across micro-batches)."""
    cfg = CASES[case]
    one = _update(rows, cfg, temperature=0.7)
    _same(_update(rows, cfg, temperature=0.7, micro_batches=micro), one, tol=1e-6)
    _same(_update(rows, dataclasses.replace(cfg, logits_chunk=4), temperature=0.7, micro_batches=micro), one)


@pytest.mark.parametrize("case", ["full-reverse", "sampled-discounted"])
@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_makes_the_same_update(rows, case, lora):
    """model.gradient_checkpointing recomputes the layers in backward: the same loss and
    gradients as keeping the activations, with chunked logits too, and for a LoRA student."""
    loss_cfg = CASES[case]
    _same(_update(rows, loss_cfg, lora=lora, gradient_checkpointing=True), _update(rows, loss_cfg, lora=lora))
    chunked = LossConfig(**{**loss_cfg.__dict__, "logits_chunk": 7})
    _same(_update(rows, chunked, lora=lora, gradient_checkpointing=True), _update(rows, loss_cfg, lora=lora))


def test_gradient_checkpointing_is_on_in_the_trainer_forward(rows):
    """The switch reaches the decoder layers (an HF model recomputes only in train mode)."""
    from core.models import build_student

    model = build_student(str(rows["dir"]), gradient_checkpointing=True)
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    assert not build_student(str(rows["dir"])).is_gradient_checkpointing


def test_chunk_and_micro_batch_settings_are_checked():
    from core.config import ConfigError, load_config
    from mopd.distill.config import DistillConfig

    base = ["model.path=x", "data.datasets=[{path: d.jsonl}]", "teachers={a: {path: t}}"]
    with pytest.raises(ConfigError, match="loss.logits_chunk must be >= 0"):
        load_config(DistillConfig, None, base + ["loss.logits_chunk=-1"])
    with pytest.raises(ConfigError, match="train.micro_batches must be >= 1"):
        load_config(DistillConfig, None, base + ["train.micro_batches=0"])


def tiny_distill_config(tmp_path, student, teacher):
    """A one-step `mopd distill` recipe on the tiny student and teacher (hf sampling, kl=full,
    four prompts a step, MLflow in tmp_path/mlflow.db)."""
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}], "domain": "a"})
                              for i in range(8)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data: {{datasets: [{{path: {data}}}]}}
teachers: {{a: {{path: {teacher}}}}}
rollout: {{backend: hf, max_new_tokens: 6}}
loss: {{kl: full}}
train: {{max_steps: 1, prompts_per_step: 4}}
mlflow: {{log_model: false, tracking_uri: "sqlite:///{tmp_path}/mlflow.db"}}
""")
    return cfg


def test_distill_with_chunks_and_micro_batches_makes_the_same_step(tiny_student_dir, tiny_teacher_dir, tmp_path):
    """`mopd distill` (in process) with loss.logits_chunk and train.micro_batches set: the
    settings reach the step, and its loss, gradient norm and KL are the plain run's."""
    from pipeline.cli import main as cli_main

    cfg = tiny_distill_config(tmp_path, tiny_student_dir, tiny_teacher_dir)
    hist = {}
    for name, extra in (("plain", []), ("chunked", ["loss.logits_chunk=5", "train.micro_batches=3"]),
                        ("recomputed", ["model.gradient_checkpointing=true", "loss.logits_chunk=5"])):
        assert cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / name), *extra]) == 0
        hist[name] = json.loads((tmp_path / name / "history.json").read_text())[0]
    for k in ("loss", "grad_norm", "reverse_kl/a", "tokens"):
        assert hist["chunked"][k] == pytest.approx(hist["plain"][k], rel=1e-5, abs=1e-6), k
        assert hist["recomputed"][k] == pytest.approx(hist["plain"][k], rel=1e-5, abs=1e-6), k
