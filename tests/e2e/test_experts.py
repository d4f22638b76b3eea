"""The expert framework: every domain has its pieces, recipes load, bad input is named
before any work, and `mopd expert` runs SFT then GRPO end to end on a tiny model,
registering the result as a teacher."""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch

from evals.run import load_evaluate
from experts.registry import load_domain
from experts.run import ExpertConfig, check, registered_name
from core.config import load_config
from pipeline.expert import main as expert_main

REPO = Path(__file__).resolve().parents[2]
DOMAINS = sorted(p.name for p in (REPO / "recipes" / "experts").iterdir() if p.is_dir())


@pytest.fixture
def tiny_dir(tiny_student_dir) -> str:
    return str(tiny_student_dir)


def test_some_domains_exist():
    assert {"math", "code", "tool_use", "instruction_following", "chat"} <= set(DOMAINS)


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_domain_has_data_reward_eval_and_recipes(domain):
    """A domain is added by creating its folders and recipes only."""
    d = load_domain(domain)
    for fn in ("make_dataset", "corrupt", "pretrain_rows"):
        assert callable(getattr(d.data, fn, None)), f"experts/{domain}/data.py: {fn}"
    assert d.data.DOMAIN == domain
    assert list(inspect.signature(d.reward).parameters)[:2] == ["prompts", "completions"]
    assert callable(load_evaluate(domain))
    recipes = sorted((REPO / "recipes" / "experts" / domain).glob("*.yaml"))
    stages = {load_config(ExpertConfig, p).stage for p in recipes}
    assert stages == {"sft", "rl"}, recipes
    for p in recipes:
        cfg = load_config(ExpertConfig, p)
        assert cfg.domain == domain, p
        efforts = tuple(getattr(d.data, "EFFORTS", ()) or ())
        assert (cfg.effort in efforts) if efforts else cfg.effort is None, p
    # a few rows of its data in the agreed shape
    kw = {"effort": d.data.EFFORTS[0]} if getattr(d.data, "EFFORTS", ()) else {}
    ds = d.data.make_dataset("test", 4, seed=0, **kw)
    assert {"prompt", "completion", "domain"} <= set(ds.column_names)
    assert set(ds["domain"]) == {domain}
    # a multi-turn domain's reference is the whole episode (its message list)
    multi_turn = getattr(d.data, "MULTI_TURN", False)
    refs = [list(c) if multi_turn else c[-1]["content"] for c in ds["completion"]]
    cols = {c: ds[c] for c in ds.column_names if c not in ("prompt", "completion")}
    if domain != "chat":  # chat's reward needs a trained reward model (tests/unit/experts/test_chat.py)
        # the references score 1 (kernel's one-call experts: at least CHECK_REFERENCE_MIN, since
        # 1.0 is the speed of light, issue 45)
        least = float(getattr(d.data, "CHECK_REFERENCE_MIN", 1.0))
        assert all(least <= r <= 1.0 for r in d.reward(ds["prompt"], refs, **cols)), domain
    pre = d.data.pretrain_rows(8, seed=0)
    assert {"prompt", "completion"} <= set(pre.column_names)


def test_registered_names():
    assert registered_name("math", "low") == "math-low-expert"
    assert registered_name("code", None) == "code-expert"


def _cfg(tmp_path, **over):
    cfg = ExpertConfig(domain="math", stage="sft", effort="low")
    cfg.model.path = str(over.pop("path", tmp_path))
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_bad_input_is_named_before_any_work(tmp_path, tiny_dir):
    with pytest.raises(ValueError, match="no domain 'nosuch': registered are"):
        check(ExpertConfig(domain="nosuch", model=_cfg(tmp_path).model), tmp_path / "o")
    with pytest.raises(ValueError, match=r"efforts \['low', 'high'\]"):
        check(_cfg(tmp_path, path=tiny_dir, effort=None), tmp_path / "o")
    with pytest.raises(ValueError, match="has no efforts"):
        check(_cfg(tmp_path, path=tiny_dir, domain="code", effort="low"), tmp_path / "o")
    with pytest.raises(ValueError, match="not an HF checkpoint"):
        check(_cfg(tmp_path / "nope"), tmp_path / "o")
    cfg = _cfg(tmp_path, path=tiny_dir, stage="rl")
    cfg.rl.reward_kwargs = {"bogus": "1"}
    with pytest.raises(ValueError, match="bogus"):
        check(cfg, tmp_path / "o")
    # the reward's own preflight (here: no browser for frontend) runs before any model loads
    os.environ["MOPD_CHROMIUM"] = str(tmp_path / "no-such-chromium")
    try:
        with pytest.raises(Exception, match="no-such-chromium"):
            check(_cfg(tmp_path, path=tiny_dir, domain="frontend", effort=None), tmp_path / "o")
    finally:
        del os.environ["MOPD_CHROMIUM"]
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds"):
        check(_cfg(tmp_path, path=tiny_dir), tmp_path / "done")
    assert not (tmp_path / "o").exists()


def test_expert_sft_then_rl_registers_a_teacher(tmp_path, tiny_dir, monkeypatch):
    """Both stages through the real entry point on a tiny random model (a few steps): the
    summary has the issue's keys, the RL stage registers math-low-expert@teacher, and
    `mopd teachers list` finds it and checks it fits the student."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    common = ["domain=math", "effort=low", "data.n_train=32", "data.n_test=8", "train.batch_size=4",
              "eval.max_new_tokens=8", "train.logging_steps=1", "quant.enabled=true", "quant.group_size=32"]
    rc = expert_main(["--config", str(REPO / "recipes/experts/math/sft-low.yaml"),
                      "--out", str(tmp_path / "sft"), f"model.path={tiny_dir}", "train.max_steps=3", *common])
    assert not rc
    s = json.loads((tmp_path / "sft" / "summary.json").read_text())
    assert {"domain", "effort", "stage", "score_base", "score_sft", "score", "checkpoint", "model_uri"} <= set(s)
    assert s["stage"] == "sft" and s["score_sft"] == s["score"] and s["model_uri"] is None
    assert (Path(s["checkpoint"]) / "config.json").exists()

    import mlflow

    from core.tracking import start_run

    # the RL stage nests under a parent run handed down in its config (as the pipeline does)
    with start_run(experiment="mopd-experts", uri=os.environ["MLFLOW_TRACKING_URI"]) as parent:
        parent_id = parent.info.run_id
    rc = expert_main(["--config", str(REPO / "recipes/experts/math/rl-low.yaml"),
                      "--out", str(tmp_path / "rl"), f"model.path={tmp_path / 'sft' / 'model'}",
                      f"model.base={tiny_dir}", "train.max_steps=2", "rl.num_generations=2",
                      "rl.max_completion_length=8", f"mlflow.parent_run_id={parent_id}", *common])
    assert not rc
    r = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert set(r) == {"domain", "effort", "stage", "score_base", "score_sft", "score", "cost", "checkpoint",
                      "model_uri", "train_seconds", "mlflow_run_id", "tracking_uri"}
    # the checkpoint's completion tokens per held-out task: 8 rows, at most eval.max_new_tokens each
    assert r["cost"]["n"] == 8 and 1 <= r["cost"]["tokens"]["mean"] <= r["cost"]["tokens"]["p90"] <= 8
    assert r["stage"] == "rl" and r["score_sft"] == s["score"] and r["score_base"] == s["score_base"]
    assert r["model_uri"] == "models:/math-low-expert@teacher"

    from teachers.registry import list_teachers

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    run = mlflow.get_run(r["mlflow_run_id"])
    assert run.data.tags["domain"] == "math" and run.data.tags["stage"] == "rl"
    assert run.data.tags["mlflow.parentRunId"] == parent_id
    assert mlflow.get_run(s["mlflow_run_id"]).data.tags.get("mlflow.parentRunId") is None
    assert "score" in run.data.metrics
    entries = list_teachers(student=tiny_dir)
    assert [(e.domain, e.effort, e.fit) for e in entries] == [("math", "low", "ok")]
    from teachers.resolve import resolve_ref
    assert (resolve_ref("models:/math-low-expert@teacher") / "config.json").exists()
    # both stages' models are MLflow transformers models: they load as a pipeline and generate
    import mlflow.transformers
    for run_id in (s["mlflow_run_id"], r["mlflow_run_id"]):
        pipe = mlflow.transformers.load_model(f"runs:/{run_id}/model")
        n = len(pipe.tokenizer("2 + 2 =")["input_ids"])
        ids = pipe("2 + 2 =", max_new_tokens=3, min_new_tokens=3, do_sample=False,
                   return_tensors=True)[0]["generated_token_ids"]
        assert len(ids) == n + 3
    assert mlflow.MlflowClient().get_model_version_by_alias("math-low-expert", "teacher").source.startswith("models:/m-")


@pytest.mark.parametrize("domain", ["math", "tool_use", "instruction_following"])
def test_rewards_check_cli(domain, tmp_path):
    """`mopd rewards check` on the procedural test split: references pass, corruptions fail."""
    from pipeline.cli import main

    out = tmp_path / "check.json"
    assert main(["rewards", "check", "--domain", domain, "--n", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"domain", "dataset", "n", "reference_mean", "corrupted_mean"} <= set(res)
    assert res["domain"] == domain and res["dataset"] == "procedural" and res["n"] >= 40
    assert res["reference_mean"] == 1.0 and res["corrupted_mean"] <= 0.05


def test_rewards_check_names_bad_input(tmp_path, capsys):
    from pipeline.cli import main

    assert main(["rewards", "check", "--domain", "nosuch"]) == 2
    assert "no domain 'nosuch'" in capsys.readouterr().err
    assert main(["rewards", "check", "--domain", "math", "--dataset", "nosuch"]) == 2
    assert "'procedural'" in capsys.readouterr().err


def test_rl_with_trl_vllm_and_qat_is_refused():
    """TRL's vLLM sync would sample with unquantized weights: refused at config load."""
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="use_vllm"):
        load_config(ExpertConfig, REPO / "recipes/experts/code/rl.yaml", ["rl.use_vllm=true"])
    assert load_config(ExpertConfig, REPO / "recipes/experts/code/rl.yaml",
                       ["rl.use_vllm=true", "quant.enabled=false"]).rl.use_vllm


def test_expert_lora_with_qat_exports_a_plain_checkpoint(tmp_path, tiny_dir, monkeypatch):
    """A LoRA student with QAT: the saved model is the merged, fake-quantized weights in a
    plain HF checkpoint (no adapter keys), loadable like any other."""
    from safetensors.torch import load_file

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    rc = expert_main(["--config", str(REPO / "recipes/experts/math/sft-low.yaml"), "--out", str(tmp_path / "l"),
                      f"model.path={tiny_dir}", "train.max_steps=2", "data.n_train=16", "data.n_test=4",
                      "train.batch_size=4", "eval.max_new_tokens=4", "eval.score_base=false",
                      "model.lora.enabled=true", "model.lora.r=4", "quant.group_size=32"])
    assert not rc
    sd = load_file(str(tmp_path / "l" / "model" / "model.safetensors"))
    assert not any("lora" in k for k in sd)
    base = load_file(str(Path(tiny_dir) / "model.safetensors"))
    assert set(sd) == set(base)
    assert not torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
