"""The experts' SFT trainer (experts/completion_sft.py) makes TRL's update: the same loss and
the same weights after two steps as TRL's SFTTrainer on the same rows, while its LM head
scores only the completion positions. Run through train_sft, the function the expert stage
calls, on the tiny model and on a Llama-3 stand-in (one with padded rows of several lengths)."""
from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experts import run as expert_run
from experts.completion_sft import completion_sft_trainer


def _rows(n=12):
    rows = []
    for i in range(n):
        q = " ".join(["what is", str(i), "plus", str(2 * i)] + ["and more"] * (i % 4))
        rows.append({"prompt": [{"role": "user", "content": q}],
                     "completion": [{"role": "assistant", "content": f"it is {3 * i}" + " ok" * (i % 3)}]})
    return datasets.Dataset.from_list(rows)


def _cfg(model_dir, steps=2):
    cfg = expert_run.ExpertConfig()
    cfg.domain, cfg.stage = "math", "sft"
    cfg.model.path = str(model_dir)
    cfg.train.max_steps, cfg.train.batch_size, cfg.train.lr, cfg.train.seed = steps, 4, 1e-2, 0
    cfg.train.logging_steps = 1
    return cfg


def _train(model_dir, tmp, trainer_cls, monkeypatch):
    monkeypatch.setattr("experts.completion_sft.completion_sft_trainer", lambda **kw: trainer_cls)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trained = expert_run.train_sft(_cfg(model_dir), model, tok, _rows(), tmp)
    return {k: v.detach().clone() for k, v in trained.state_dict().items()}


@pytest.mark.parametrize("which", ["tiny", "llama3"])
def test_same_update_as_trls_sft_trainer(which, tiny_student_dir, standins, tmp_path, monkeypatch):
    from trl import SFTTrainer

    model_dir = tiny_student_dir if which == "tiny" else standins["llama3"]
    ours = _train(model_dir, tmp_path / "ours", completion_sft_trainer(), monkeypatch)
    trl = _train(model_dir, tmp_path / "trl", SFTTrainer, monkeypatch)
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    moved = max((trl[k] - start[k]).abs().max().item() for k in trl)
    diff = max((ours[k] - trl[k]).abs().max().item() for k in trl)
    assert moved > 1e-3          # the steps did something
    assert diff < 1e-4 * max(1.0, moved), (diff, moved)


def test_loss_and_metrics_match_trl_on_one_batch(tiny_student_dir, tmp_path):
    """compute_loss itself, on one collated batch: loss, entropy and token accuracy."""
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(tiny_student_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_student_dir, dtype=torch.float32).train()
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, report_to="none", use_cpu=True,
                     completion_only_loss=True, max_length=256)
    got = {}
    for name, cls in (("ours", completion_sft_trainer()), ("trl", SFTTrainer)):
        tr = cls(model=model, args=args, train_dataset=_rows(6), processing_class=tok)
        batch = next(iter(tr.get_train_dataloader()))
        n = (batch["labels"][:, 1:] != -100).sum()
        got[name] = (tr.compute_loss(model, batch, num_items_in_batch=n).item(),
                     tr._metrics["train"]["entropy"][-1], tr._metrics["train"]["mean_token_accuracy"][-1])
    for a, b in zip(got["ours"], got["trl"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_bf16_precision_autocasts_the_sft_step(tiny_student_dir, tmp_path):
    """train.precision=bf16: the layers run in bf16 inside the step (TRL's own bf16=True does
    not autocast on a CPU), the weights stay fp32, and the run tracks the fp32 one."""
    seen = []
    got = {}
    for prec in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_student_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(tiny_student_dir)
        hook = model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        cfg = _cfg(tiny_student_dir)
        cfg.train.precision = prec
        trained = expert_run.train_sft(cfg, model, tok, _rows(), tmp_path / prec)
        hook.remove()
        got[prec] = {k: v.detach().clone() for k, v in trained.state_dict().items()}
        assert seen[-1] == (torch.bfloat16 if prec == "bf16" else torch.float32)
        assert all(v.dtype == torch.float32 for v in got[prec].values())
    diff = max((got["bf16"][k] - got["fp32"][k]).abs().max().item() for k in got["fp32"])
    assert 0 < diff < 5e-2


def test_bf16_precision_is_refused_for_rl():
    cfg = _cfg("/nonexistent")
    cfg.stage, cfg.train.precision = "rl", "bf16"
    with pytest.raises(ValueError, match="train.precision=bf16 is for sft stages"):
        cfg.validate()


def test_an_sft_expert_is_saved_with_its_kv_cache_on(tiny_student_dir, tmp_path):
    """transformers' Trainer sets config.use_cache=False while training; the saved expert
    must not keep it (generation without a KV cache, and a config that differs from an agent
    expert's, which weight averaging refused)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_student_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_student_dir)
    out = expert_run.train(_cfg(tiny_student_dir, steps=1), None, model, tok, _rows(), tmp_path)
    import json
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
