"""A checkpoint folder that cannot be used (no tokenizer, no config.json, an architecture
vLLM cannot serve when a vLLM backend would load it) is a clear error from `mopd distill`
and `mopd expert` before any model loads, naming the folder and the fix."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import one_domain_recipe
from pipeline.cli import main as cli_main

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _copy(src, dst, drop=(), arch=None):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop) if drop else None)
    if arch:
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**c, "architectures": [arch]}))
    return dst


def _recipe(tmp_path, student, teacher, backend="hf", teacher_backend="hf"):
    return one_domain_recipe(tmp_path, student, teacher, backend=backend, teacher_backend=teacher_backend)


def _distill_error(tmp_path, capsys, cfg) -> str:
    out = tmp_path / "out"
    assert cli_main(["distill", "--config", str(cfg), "--out", str(out)]) == 2
    assert not (out / "config.yaml").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("who", ["student", "teacher"])
def test_folder_without_tokenizer(standins, tmp_path, capsys, no_model_loads, who):
    bad = _copy(standins["qwen3"], tmp_path / "no_tok", drop=TOKENIZER)
    ok = standins["qwen3"]
    err = _distill_error(tmp_path, capsys, _recipe(tmp_path, *((bad, ok) if who == "student" else (ok, bad))))
    assert f"{bad} has no tokenizer" in err and f"save_pretrained('{bad}')" in err
    assert ("model.path:" if who == "student" else "teacher for 'a'") in err


@pytest.mark.parametrize("who", ["student", "teacher"])
def test_folder_without_config(standins, tmp_path, capsys, no_model_loads, who):
    bad = _copy(standins["qwen3"], tmp_path / "no_cfg", drop=("config.json",))
    ok = standins["qwen3"]
    err = _distill_error(tmp_path, capsys, _recipe(tmp_path, *((bad, ok) if who == "student" else (ok, bad))))
    assert str(bad) in err and "has no config.json" in err and "the folder that holds config.json" in err


def test_architecture_vllm_cannot_serve(standins, tmp_path, capsys, no_model_loads):
    pytest.importorskip("vllm")
    mpt = _copy(standins["qwen3"], tmp_path / "mpt", arch="MptForCausalLM")   # transformers has it, vLLM not
    ok = standins["qwen3"]
    err = _distill_error(tmp_path, capsys, _recipe(tmp_path, mpt, ok, backend="vllm"))
    assert f"model.path: {mpt} is a MptForCausalLM, which vLLM" in err and "(rollout.backend=hf)" in err
    err = _distill_error(tmp_path, capsys, _recipe(tmp_path, ok, mpt, teacher_backend="vllm"))
    assert f"teacher for 'a' ({mpt}): {mpt} is a MptForCausalLM" in err and "(teachers.a.backend=hf)" in err
    # the families the stand-ins cover are all servable
    from core.hf_dirs import hf_dir_problem
    assert all(hf_dir_problem(p, vllm=True) is None for p in standins.values())


def test_expert_start_without_tokenizer(standins, tmp_path, capsys, no_model_loads):
    from pathlib import Path

    bad = _copy(standins["qwen3"], tmp_path / "no_tok", drop=TOKENIZER)
    recipe = Path(__file__).resolve().parents[3] / "recipes/experts/math/sft-low.yaml"
    with pytest.raises(SystemExit) as e:      # pipeline.expert exits 2 itself
        cli_main(["expert", "--config", str(recipe), "--out", str(tmp_path / "e"), f"model.path={bad}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"model.path: {bad} has no tokenizer" in err


def test_a_vllm_engine_refuses_an_architecture_vllm_cannot_serve_before_loading(standins, tmp_path,
                                                                                no_model_loads):
    """Wherever a vLLM engine is built for a checkpoint (the sampler, a vllm teacher, mopd
    eval's vllm backend: core.rollout.start_vllm_engine) or `mopd teachers serve` would
    start a server on it: an architecture vLLM has no model for is an error naming the
    folder, the architecture and the fix, before vLLM builds anything."""
    pytest.importorskip("vllm")
    from core.hf_dirs import UnservableCheckpoint
    from core.rollout import VLLMRollout
    from teachers.resolve import TeacherError
    from teachers.scoring import VLLMTeacher
    from teachers.serve import plan

    odd = _copy(standins["qwen3"], tmp_path / "odd", arch="NoSuchArchForCausalLM")   # neither vLLM nor transformers
    for build in (lambda: VLLMRollout(str(odd)), lambda: VLLMTeacher(str(odd))):
        with pytest.raises(UnservableCheckpoint) as e:
            build()
        assert f"{odd} is a NoSuchArchForCausalLM, which vLLM" in str(e.value)
        assert "rollout.backend=hf for the sampler, teachers.<key>.backend=hf for a teacher" in str(e.value)
    from mopd.distill.config import TeacherSpec
    spec = TeacherSpec(backend="server", urls=["http://127.0.0.1:9"], model="m")
    with pytest.raises(TeacherError, match=rf"teacher 'a': {odd} is a NoSuchArchForCausalLM.*teachers.a.backend=hf"):
        plan({"a": spec}, {"a": odd}, tmp_path / "serve")
    # a servable one passes the same check (the engine itself is the vLLM tests')
    from core.hf_dirs import check_vllm_servable
    check_vllm_servable(standins["qwen3"])
