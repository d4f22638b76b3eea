"""Many LoRA teachers on one base: the recipe's `adapter` form and its errors, adapters
checked against their base before any model starts, one model/engine per base with one
adapter per key, and the scores equal to the same adapters merged into full models."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import VLLM_TEST_KW, build_tiny, random_prompts, serve_real_vllm
from core.config import ConfigError, load_config
from mopd.distill import DistillConfig
from teachers.lora import AdapterView, HFLoraTeacher, merge_adapter, random_adapter
from teachers.resolve import TeacherError, check_adapter, resolve_teacher
from teachers.scoring import HFTeacher

BASE = ["model.path=/m", "data.datasets=[{path: /d.jsonl}]", "rollout.backend=hf"]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, tiny_teacher_dir):
    """Two random adapters (non-zero B) on the tiny teacher, and each merged into a full model."""
    d = tmp_path_factory.mktemp("lora")
    a = random_adapter(tiny_teacher_dir, d / "a", seed=1)
    b = random_adapter(tiny_teacher_dir, d / "b", seed=2, r=4)
    return SimpleNamespace(base=tiny_teacher_dir, a=a, b=b, ma=merge_adapter(tiny_teacher_dir, a, d / "ma"),
                           mb=merge_adapter(tiny_teacher_dir, b, d / "mb"), root=d)


def _pairs(n=6, seed=0):
    p = random_prompts(n, seed=seed, max_len=12)
    c = random_prompts(n, seed=seed + 100, min_len=1, max_len=8)
    return p, c


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("spec,match", [
    ("{backend: server, urls: [http://h:1], model: m, adapter: /a}", "a server teacher with an adapter needs path"),
    ("{path: /a, adapter: /a}", "adapter and path are both '/a'"),
])
def test_bad_adapter_specs_name_the_teacher(spec, match):
    with pytest.raises(ConfigError, match=f"teachers.math: {match}"):
        load_config(DistillConfig, None, [*BASE, f"teachers.math={spec}"])


def test_adapter_spec_loads():
    cfg = load_config(DistillConfig, None, [*BASE, "teachers.math={path: /base, adapter: /ad, backend: vllm}"])
    assert (cfg.teachers["math"].path, cfg.teachers["math"].adapter) == ("/base", "/ad")


def test_adapter_on_another_base_is_refused_before_loading(lora_dir, tmp_path, tiny_tokenizer):
    from teachers.routing import resolve_teachers

    other = build_tiny(tmp_path / "wide", seed=3, hidden_size=192, num_heads=3)
    with pytest.raises(TeacherError, match="config differs from the base.*hidden_size: 128 vs 192"):
        check_adapter(other, lora_dir.a)
    # the base it names is not here: the LoRA matrices' shapes against the base's weights
    import json
    import shutil
    moved = Path(shutil.copytree(lora_dir.a, tmp_path / "moved"))
    cfg = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "/nowhere"}))
    with pytest.raises(TeacherError, match=r"does not fit the base .*lora_A.* \[8, 128\] does not fit"):
        check_adapter(other, moved)
    check_adapter(lora_dir.base, moved)
    specs = {"math": SimpleNamespace(path=str(other), adapter=str(lora_dir.a), backend="vllm")}
    with pytest.raises(TeacherError, match=r"teacher for 'math'.*(config differs|does not fit)"):
        resolve_teachers(specs, ["math"], tiny_tokenizer, "student")
    # a full model given as the adapter, and an adapter given as the base: named as such
    with pytest.raises(TeacherError, match="not a peft LoRA adapter"):
        resolve_teacher(str(lora_dir.base), str(lora_dir.ma))
    with pytest.raises(TeacherError, match="is a LoRA adapter folder"):
        resolve_teacher(str(lora_dir.a), str(lora_dir.b))


def test_adapter_path_alone_finds_its_base(lora_dir):
    p = resolve_teacher(str(lora_dir.a))
    assert Path(p).resolve() == Path(lora_dir.base).resolve() and p.adapter == lora_dir.a
    assert resolve_teacher(str(lora_dir.ma)).adapter is None


# ----------------------------------------------------------------------------- scores (HF)
def test_hf_adapters_in_one_model_score_like_the_merged_models(lora_dir):
    p, c = _pairs()
    shared = HFLoraTeacher(str(lora_dir.base), {"a": str(lora_dir.a), "b": str(lora_dir.b)})
    got_a, got_b = shared.score(p, c, adapter="a"), shared.score(p, c, adapter="b")
    ref_a, ref_b = HFTeacher(str(lora_dir.ma)).score(p, c), HFTeacher(str(lora_dir.mb)).score(p, c)
    base = HFTeacher(str(lora_dir.base)).score(p, c)
    for ga, gb, ra, rb, b0 in zip(got_a, got_b, ref_a, ref_b, base):
        torch.testing.assert_close(ga, ra, atol=1e-4, rtol=0)
        torch.testing.assert_close(gb, rb, atol=1e-4, rtol=0)
        assert (ga - gb).abs().max() > 1e-3 and (ga - b0).abs().max() > 1e-3, "adapters do not change scores"
    # back to a: switching is not sticky, and full distributions agree too
    torch.testing.assert_close(shared.score_full(p[:2], c[:2], adapter="a")[0],
                               HFTeacher(str(lora_dir.ma)).score_full(p[:2], c[:2])[0], atol=1e-4, rtol=0)
    with pytest.raises(KeyError, match="no adapter 'x'"):
        shared.score(p, c, adapter="x")


def test_router_puts_adapters_of_one_base_in_one_model(lora_dir, tiny_tokenizer):
    from teachers.routing import TeacherRouter, resolve_teachers

    specs = {"math": SimpleNamespace(path=str(lora_dir.base), adapter=str(lora_dir.a), backend="hf"),
             "code": SimpleNamespace(path=str(lora_dir.base), adapter=str(lora_dir.b), backend="hf"),
             "chat": SimpleNamespace(path=str(lora_dir.ma), adapter="", backend="hf")}
    paths = resolve_teachers(specs, sorted(specs), tiny_tokenizer, "student")
    router = TeacherRouter.load(specs, paths, dtype="float32", vllm_kwargs={})
    t = router.teachers
    assert isinstance(t["math"], AdapterView) and isinstance(t["code"], AdapterView)
    assert t["math"].shared is t["code"].shared, "two adapters of one base got two models"
    assert isinstance(t["chat"], HFTeacher) and not isinstance(t["chat"], AdapterView)
    p, c = _pairs(4)
    rows = [SimpleNamespace(ids=p[i], teacher_key=k) for i, k in enumerate(["math", "code", "chat", "math"])]
    samples = [SimpleNamespace(completion_ids=c[i]) for i in range(4)]
    lp, full = [None] * 4, [None] * 4
    router.score(rows, samples, range(4), False, lp, full)
    want = {k: HFTeacher(str(m)) for k, m in [("math", lora_dir.ma), ("code", lora_dir.mb), ("chat", lora_dir.ma)]}
    for i, r in enumerate(rows):
        torch.testing.assert_close(torch.tensor(lp[i]), want[r.teacher_key].score([p[i]], [c[i]])[0], atol=1e-4, rtol=0)
    shared = t["math"].shared
    t["math"].close()
    assert shared.model is not None, "closing one view closed the model the other still uses"
    router.close()
    assert shared.model is None


# ----------------------------------------------------------------------------- registry
def test_registered_lora_expert_resolves_to_base_plus_adapter(lora_dir, tmp_path, monkeypatch):
    import mlflow

    from core.tracking import start_run
    from teachers.registry import list_teachers

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with start_run(experiment="e", uri=uri) as run:
        mlflow.log_artifacts(str(lora_dir.a), "adapter")
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("math-expert")
    mv = client.create_model_version("math-expert", source=f"runs:/{run.info.run_id}/adapter",
                                     run_id=run.info.run_id, tags={"base": str(lora_dir.base), "adapter": "true"})
    client.set_registered_model_alias("math-expert", "teacher", mv.version)
    p = resolve_teacher("models:/math-expert@teacher", tracking_uri=uri)
    assert Path(p).resolve() == Path(lora_dir.base).resolve()
    assert (p.adapter / "adapter_config.json").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    try:
        [e] = list_teachers(student=str(lora_dir.base))
    finally:
        mlflow.set_tracking_uri("")
    assert (e.base, e.fit) == (str(lora_dir.base), "ok")


# ----------------------------------------------------------------------------- expert option
@pytest.mark.parametrize("over,match", [
    (["model.keep_adapter=true"], "needs model.lora.enabled=true"),
    (["model.keep_adapter=true", "model.lora.enabled=true", "quant.enabled=true"], "cannot express"),
])
def test_expert_keep_adapter_config_errors(over, match):
    from experts.run import ExpertConfig

    with pytest.raises(ConfigError, match=match):
        load_config(ExpertConfig, None, ["domain=math", "model.path=/m", *over])


# ----------------------------------------------------------------------------- scores (vLLM)
@pytest.mark.vllm
def test_vllm_adapters_in_one_engine_score_like_the_merged_models(lora_dir):
    pytest.importorskip("vllm")
    from teachers.lora import VLLMLoraTeacher

    p, c = _pairs(8, seed=3)
    eng = VLLMLoraTeacher(str(lora_dir.base), {"a": str(lora_dir.a), "b": str(lora_dir.b)}, **VLLM_TEST_KW)
    try:
        got_a, got_b = eng.score_many([("a", p, c), ("b", p, c)])
    finally:
        eng.close()
    ref_a, ref_b = HFTeacher(str(lora_dir.ma)).score(p, c), HFTeacher(str(lora_dir.mb)).score(p, c)
    for ga, gb, ra, rb in zip(got_a, got_b, ref_a, ref_b):
        torch.testing.assert_close(ga, ra, atol=1e-3, rtol=0)
        torch.testing.assert_close(gb, rb, atol=1e-3, rtol=0)
        assert (ga - gb).abs().max() > 1e-3


def test_expert_keep_adapter_registers_base_plus_adapter(tmp_path, tiny_student_dir, monkeypatch):
    """A LoRA expert with keep_adapter: DIR/adapter is a peft adapter on model.path, the
    registered version is that adapter with tags base/adapter, and `models:/...@teacher`
    resolves to base + adapter that score like the merged DIR/model."""
    from pipeline.expert import main as expert_main

    REPO = Path(__file__).resolve().parents[3]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rc = expert_main(["--config", str(REPO / "recipes/experts/math/sft-low.yaml"), "--out", str(tmp_path / "x"),
                      f"model.path={tiny_student_dir}", "train.max_steps=2", "data.n_train=8", "data.n_test=2",
                      "train.batch_size=4", "eval.score=false", "quant.enabled=false", "model.lora.enabled=true",
                      "model.lora.r=4", "model.keep_adapter=true", "train.lr=0.05", "mlflow.register=true"])
    assert not rc
    summary = json.loads((tmp_path / "x" / "summary.json").read_text())
    assert summary["base"] == str(Path(tiny_student_dir).resolve())
    p = resolve_teacher(summary["model_uri"], tracking_uri=uri)
    assert Path(p).resolve() == Path(tiny_student_dir).resolve() and (p.adapter / "adapter_config.json").exists()
    pr, co = _pairs(3)
    got = HFLoraTeacher(str(p), {"math": str(p.adapter)}).score(pr, co, adapter="math")
    want = HFTeacher(str(tmp_path / "x" / "model")).score(pr, co)
    base = HFTeacher(str(tiny_student_dir)).score(pr, co)
    for g, w, b in zip(got, want, base):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    assert max((g - b).abs().max() for g, b in zip(got, base)) > 1e-4, "2 SFT steps left the adapter at zero"
    # the RL stage from the registered SFT adapter trains on in that adapter, on the same base
    from experts.run import ExpertConfig, load_model, lora_base_ref
    from core.config import load_config as load

    rl = load(ExpertConfig, None, ["domain=math", "stage=rl", f"model.path={summary['model_uri']}",
                                   "model.lora.enabled=true", "model.keep_adapter=true", "quant.enabled=false"])
    model, _ = load_model(rl)
    trainable = [n for n, q in model.named_parameters() if q.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert lora_base_ref(rl) == str(Path(tiny_student_dir).resolve())
    with pytest.raises(ValueError, match="is a LoRA adapter: training on in it needs"):
        load_model(load(ExpertConfig, None, ["domain=math", "stage=rl", f"model.path={p.adapter}"]))


def test_teachers_validate_checks_an_adapter_teacher(lora_dir, tiny_student_dir, tmp_path, capsys):
    from pipeline.cli import _teachers_validate

    other = build_tiny(tmp_path / "wide", seed=3, hidden_size=192, num_heads=3)
    (tmp_path / "d.jsonl").write_text("")
    common = [f"model.path={tiny_student_dir}", f"data.datasets=[{{path: {tmp_path / 'd.jsonl'}}}]",
              "rollout.backend=hf"]
    ok = SimpleNamespace(config=None,
                         overrides=[*common, f"teachers.math={{path: {lora_dir.base}, adapter: {lora_dir.a}}}"])
    assert _teachers_validate(ok) == 0
    assert f"adapter {lora_dir.a}, fits)" in capsys.readouterr().out
    bad = SimpleNamespace(config=None,
                          overrides=[*common, f"teachers.math={{path: {other}, adapter: {lora_dir.a}}}"])
    assert _teachers_validate(bad) == 2
    assert "teacher for 'math': adapter" in capsys.readouterr().err



def test_serve_plans_one_lora_server_per_base(tmp_path, lora_dir):
    """`mopd teachers serve` with LoRA server teachers: one server of the base with
    --enable-lora, one --lora-modules entry per teacher, named by its `model`."""
    from teachers import serve

    s = lora_dir
    specs = load_config(DistillConfig, None, [
        *BASE, f"teachers.math={{path: {s.base}, adapter: {s.a}, backend: server, model: math-lora}}",
        f"teachers.code={{path: {s.base}, adapter: {s.b}, backend: server, model: code-lora}}",
        f"teachers.chat={{path: {s.base}, backend: server, model: chat}}"]).teachers
    paths = {k: Path(s.base) for k in specs}
    servers = serve.plan(specs, paths, tmp_path, adapters={"math": Path(s.a), "code": Path(s.b)})
    assert len(servers) == 2
    lora = next(x for x in servers if x.loras)
    assert sorted(lora.keys) == ["code", "math"] and lora.loras == {"math-lora": str(s.a), "code-lora": str(s.b)}
    cmd = " ".join(lora.cmd)
    assert "--enable-lora --max-loras 2 --max-lora-rank 8 --lora-modules" in cmd
    assert f"code-lora={s.b}" in cmd and f"math-lora={s.a}" in cmd
    plain = next(x for x in servers if not x.loras)
    assert plain.keys == ["chat"] and "--enable-lora" not in plain.cmd
    assert serve._lora_rank(12) == 16


@pytest.mark.server
@pytest.mark.vllm
def test_serve_lora_teachers_in_one_real_server_score_like_the_merged_models(tmp_path, lora_dir, tiny_tokenizer):
    """One vLLM server of the base with both adapters as LoRA modules: each teacher's
    server scores equal its adapter merged into a full HF model; Ctrl-C stops it."""
    import yaml

    pytest.importorskip("vllm")
    from teachers.server import ServerTeacher

    s = lora_dir
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{path: {s.base}}}\ndata: {{datasets: [{{path: /nowhere.jsonl}}]}}\n"
                      f"rollout: {{backend: hf}}\nteachers:\n"
                      f"  math: {{path: {s.base}, adapter: {s.a}, backend: server, model: math-lora}}\n"
                      f"  code: {{path: {s.base}, adapter: {s.b}, backend: server, model: code-lora}}\n")
    out = tmp_path / "serve"
    p = serve_real_vllm(recipe, out, "--vllm-arg=--kv-cache-memory-bytes=268435456")
    try:
        urls = yaml.safe_load((out / "teachers.yaml").read_text())["teachers"]
        assert urls["math"] == urls["code"]            # one server for both adapters
        prompts, comps = _pairs()
        for key, model, merged in (("math", "math-lora", s.ma), ("code", "code-lora", s.mb)):
            t = ServerTeacher(key, urls[key]["urls"], model, timeout_s=60, max_retries=1)
            t.check_tokenizer(tiny_tokenizer)
            got = t.score(prompts, comps)
            t.close()
            want = HFTeacher(str(merged), device="cpu").score(prompts, comps)
            assert max((x - y).abs().max().item() for x, y in zip(got, want)) < 1e-3, key
        p.send_signal(2)
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
