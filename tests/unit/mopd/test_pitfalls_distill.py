"""Issue 44's pitfalls through `mopd distill` (in process, HF sampler, tiny Llama-3-style
models): a student and teacher with attention_dropout 0.1 and a tokenizer without a pad
token, a teacher with a padded vocabulary, temperature 0.7 with the sampled estimator,
the leave-one-out baseline, a LoRA student with dropout 0.1; and the preflight's refusals,
before any model loads. The maths of each is checked exactly in test_pitfalls.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mopd.distill import step as step_module
from pipeline.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llama(root: Path, tok, *, vocab_size: int, seed: int, scale: float = 1.0) -> Path:
    """A tiny Llama 3-style checkpoint: attention_dropout 0.1, no pad token."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      attention_dropout=0.1, eos_token_id=tok.eos_token_id, pad_token_id=None, bos_token_id=None,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
        m.lm_head.weight[tok.eos_token_id] *= 20.0   # about half the samples end with EOS
    m.save_pretrained(str(root))
    tok.save_pretrained(str(root))
    return root


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    from core.tiny import load_tokenizer

    root = tmp_path_factory.mktemp("pitfalls")
    tok = load_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None
    n = len(tok)
    student = _llama(root / "student", tok, vocab_size=n, seed=0, scale=3.0)
    teacher = _llama(root / "teacher", tok, vocab_size=n + 64, seed=0, scale=6.0)   # padded vocabulary, larger
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"tell me about {i}"}],
                                          "domain": "a"}) for i in range(8)) + "\n")
    return {"root": root, "student": student, "teacher": teacher, "data": data, "tok": tok}


def _recipe(s: dict, path: Path, extra: str = "") -> Path:
    path.write_text(f"""
model: {{path: {s['student']}}}
data: {{datasets: [{{path: {s['data']}}}]}}
teachers: {{a: {{path: {s['teacher']}}}}}
rollout: {{backend: hf, max_new_tokens: 8}}
train: {{max_steps: 2, prompts_per_step: 4, lr: 0.01}}
mlflow: {{log_model: false, tracking_uri: "sqlite:///{s['root']}/mlflow.db"}}
{extra}
""")
    return path


def _distill(cfg: Path, out: Path, *overrides: str) -> list[dict]:
    assert cli_main(["distill", "--config", str(cfg), "--out", str(out), *overrides]) == 0
    return json.loads((out / "history.json").read_text())


def test_llama3_without_pad_token_with_dropout_and_temperature_distills(llama_setup, tmp_path, monkeypatch):
    """kl=sampled at temperature 0.7 with the leave-one-out baseline, a student and teacher
    with attention_dropout 0.1, no pad token, the teacher's vocabulary padded: the run
    ends, the step-1 sampler/trainer mismatch is <= 1e-5 (dropout off), and each
    completion's loss mask keeps its first EOS and drops the padding."""
    seen = []
    real = step_module.collate

    def spy(prompts, completions, pad_id, extra, token_mask=None, **kw):
        b = real(prompts, completions, pad_id, extra, token_mask, **kw)
        seen.append((pad_id, [list(c) for c in completions], b["mask"].clone()))
        return b
    monkeypatch.setattr(step_module, "collate", spy)
    cfg = _recipe(llama_setup, tmp_path / "run.yaml",
                  "rollout: {backend: hf, max_new_tokens: 8, temperature: 0.7}\nloss: {baseline: leave_one_out}")
    hist = _distill(cfg, tmp_path / "out")
    assert len(hist) == 2 and all(math.isfinite(h["loss"]) for h in hist)
    assert hist[0]["mismatch/abs_max/a"] <= 1e-5, hist[0]["mismatch/abs_max/a"]
    assert hist[0]["is/masked_frac/a"] == 0.0
    eos = llama_setup["tok"].eos_token_id
    ended = 0
    for pad_id, comps, mask in seen:
        assert pad_id is None
        for i, c in enumerate(comps):
            assert mask[i, :len(c)].tolist() == [1.0] * len(c) and not mask[i, len(c):].any()
            ended += bool(c) and c[-1] == eos and eos not in c[:-1]
    assert ended > 0 and any(len(c) < mask.shape[1] for _, cs, mask in seen for c in cs)   # EOS rows and padding


def test_lora_student_with_dropout_and_full_kl_over_a_padded_teacher(llama_setup, tmp_path):
    """A LoRA student with lora dropout 0.1 (whose branch is nonzero from step 2 on), loss
    kl=full against a teacher with 64 more vocabulary rows than the tokenizer: the mismatch
    stays <= 1e-5 at every step and the KL is finite and >= 0."""
    cfg = _recipe(llama_setup, tmp_path / "run.yaml", "loss: {kl: full}")
    hist = _distill(cfg, tmp_path / "out", "model.lora.enabled=true", "model.lora.dropout=0.1", "model.lora.r=4",
                    "train.max_steps=3", "train.lr=0.05")
    assert len(hist) == 3
    for h in hist:
        assert h["mismatch/abs_max/a"] <= 1e-5, h["mismatch/abs_max/a"]
        assert math.isfinite(h["loss"]) and math.isfinite(h["reverse_kl/a"]) and h["reverse_kl/a"] >= 0.0


def test_keeping_dropout_warns_and_shows_the_mismatch(llama_setup, tmp_path):
    """model.dropout=true: the warning, and the mismatch the issue measured is back."""
    cfg = _recipe(llama_setup, tmp_path / "run.yaml")
    with pytest.warns(UserWarning, match="model.dropout=true"):
        hist = _distill(cfg, tmp_path / "out", "model.dropout=true", "train.max_steps=1")
    assert hist[0]["mismatch/abs_mean/a"] > 1e-3


def test_preflight_refuses_a_student_vocabulary_below_the_tokenizer(llama_setup, tmp_path, capsys):
    import shutil

    small = tmp_path / "small"
    shutil.copytree(llama_setup["student"], small)
    c = json.loads((small / "config.json").read_text())
    c["vocab_size"] = 1000
    (small / "config.json").write_text(json.dumps(c))
    (small / "model.safetensors").write_bytes(b"not weights: the check must come before any load")
    cfg = _recipe(llama_setup, tmp_path / "run.yaml")
    assert cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / "out"), f"model.path={small}"]) == 2
    err = capsys.readouterr().err
    assert "vocab_size 1000, below its tokenizer's 2048 tokens" in err, err


def test_preflight_refuses_a_tokenizer_without_eos(llama_setup, tmp_path, capsys):
    import shutil

    no_eos = tmp_path / "no_eos"
    shutil.copytree(llama_setup["student"], no_eos)
    for f, keys in (("tokenizer_config.json", ("eos_token",)), ("config.json", ("eos_token_id",)),
                    ("generation_config.json", ("eos_token_id",))):
        p = no_eos / f
        if p.exists():
            d = json.loads(p.read_text())
            for k in keys:
                d[k] = None
            p.write_text(json.dumps(d))
    (no_eos / "model.safetensors").write_bytes(b"not weights")
    cfg = _recipe(llama_setup, tmp_path / "run.yaml")
    assert cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / "out"), f"model.path={no_eos}"]) == 2
    err = capsys.readouterr().err
    assert "has no EOS token" in err, err


def test_the_llama3_standin_distills_without_a_pad_token(standins, tmp_path):
    """The Llama 3 stand-in (its family's tokenizer: header tokens, <|eot_id|>, no pad
    token) as student and teacher, loss.kl=full: the run ends, the sampler/trainer mismatch
    is <= 1e-5 and the KL of the student to itself 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(standins["llama3"]))
    assert tok.pad_token is None
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}], "domain": "a"})
                              for i in range(4)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
model: {{path: {standins['llama3']}}}
data: {{datasets: [{{path: {data}}}]}}
teachers: {{a: {{path: {standins['llama3']}}}}}
rollout: {{backend: hf, max_new_tokens: 6}}
loss: {{kl: full}}
train: {{max_steps: 1, prompts_per_step: 4}}
mlflow: {{log_model: false, tracking_uri: "sqlite:///{tmp_path}/mlflow.db"}}
""")
    hist = _distill(cfg, tmp_path / "out")
    assert len(hist) == 1 and math.isfinite(hist[0]["loss"]) and hist[0]["mismatch/abs_max/a"] <= 1e-5
    assert hist[0]["reverse_kl/a"] == pytest.approx(0.0, abs=1e-5)   # the student is its own teacher


def test_an_error_inside_a_step_closes_the_sampler_and_teachers(llama_setup, tmp_path, monkeypatch):
    """A step that raises ends the run FAILED and closes its engines (a vLLM engine left
    open holds its memory and threads, and the next engine in the process fails)."""
    from mopd.distill import loop
    from mopd.distill.trainer import MOPDTrainer

    closed = []
    real_close = MOPDTrainer.close
    monkeypatch.setattr(MOPDTrainer, "close", lambda self: (closed.append(self.step), real_close(self)))

    def boom(step, m):
        raise RuntimeError("a step failed")
    cfg = loop.load_config(loop.DistillConfig, str(_recipe(llama_setup, tmp_path / "run.yaml")), [])
    with pytest.raises(RuntimeError, match="a step failed"):
        loop.run(cfg, tmp_path / "out", progress=False, callbacks=[boom])
    assert closed == [1]
