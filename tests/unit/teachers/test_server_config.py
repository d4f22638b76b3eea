"""The recipe side of server teachers: TeacherSpec fields, and the loss a backend can
serve refused at load time (before any model or sampler starts)."""
from __future__ import annotations

import pytest

from core.config import ConfigError, load_config
from mopd.distill import DistillConfig

BASE = ["model.path=/m", "data.datasets=[{path: /d.jsonl}]", "rollout.backend=hf"]


def _load(*teacher_overrides, extra=()):
    return load_config(DistillConfig, None, [*BASE, *teacher_overrides, *extra])


def test_server_teacher_loads_without_path():
    cfg = _load("teachers.code={backend: server, urls: [http://h:8000, http://h2:8000], model: code-expert, "
                "timeout_s: 5, max_retries: 1}")
    t = cfg.teachers["code"]
    assert (t.backend, t.urls, t.model, t.timeout_s, t.max_retries, t.path) == (
        "server", ["http://h:8000", "http://h2:8000"], "code-expert", 5.0, 1, "")


@pytest.mark.parametrize("spec,match", [
    ("{backend: server, urls: [http://h:8000]}", "teachers.code: backend server needs model"),
    ("{backend: server, urls: [h:8000], model: m}", "teachers.code: urls: 'h:8000' is not an http"),
    ("{backend: server, urls: [http://h:1], model: m, concurrency: 0}", "concurrency must be >= 1"),
    ("{backend: server, urls: [http://h:1], model: m, timeout_s: 0}", "timeout_s must be > 0"),
    ("{backend: hf}", "path is required with backend hf"),
    ("{path: /t, urls: [http://h:1]}", "urls / model are for backend server"),
])
def test_bad_server_specs_name_the_teacher(spec, match):
    with pytest.raises(ConfigError, match=match):
        _load(f"teachers.code={spec}")


def test_kl_full_with_a_server_teacher_is_a_config_error():
    with pytest.raises(ConfigError, match=r"loss.kl=full .* teachers \['code \(server\)'\]"):
        _load("teachers.code={backend: server, urls: [http://h:8000], model: m}", extra=["loss.kl=full"])
    # correct_below also needs the whole distribution: refused the same way (kl=full required)
    with pytest.raises(ConfigError, match="correct_below"):
        _load("teachers.code={backend: server, urls: [http://h:8000], model: m}", extra=["rollout.correct_below=0.1"])


def test_resolve_teachers_checks_a_server_teacher_and_needs_urls(tiny_student_dir, tiny_tokenizer):
    from teachers.resolve import TeacherError
    from teachers.routing import resolve_teachers

    cfg = _load("teachers.code={backend: server, model: m}")   # urls come from `mopd teachers serve`
    with pytest.raises(TeacherError, match=r"teacher 'code': backend server needs urls.*mopd teachers serve"):
        resolve_teachers(cfg.teachers, ["code"], tiny_tokenizer, str(tiny_student_dir))
    cfg = _load("teachers.code={backend: server, urls: ['http://127.0.0.1:9'], model: m, max_retries: 0}")
    with pytest.raises(TeacherError, match=r"teacher 'code' is unreachable.*http://127.0.0.1:9"):
        resolve_teachers(cfg.teachers, ["code"], tiny_tokenizer, str(tiny_student_dir))


def test_top_k_on_the_in_process_vllm_backend():
    """top_k > 0 makes a vllm teacher serve loss.kl=full (its top-k rows); on hf it is an
    error (whole distributions already), and on a vllm LoRA adapter one naming the fix."""
    cfg = _load("teachers.code={path: /t, backend: vllm, top_k: 8}", extra=["loss.kl=full"])
    assert (cfg.teachers["code"].backend, cfg.teachers["code"].top_k) == ("vllm", 8)
    with pytest.raises(ConfigError, match=r"loss.kl=full .* teachers \['code \(vllm\)'\].*set top_k \(server, vllm\)"):
        _load("teachers.code={path: /t, backend: vllm}", extra=["loss.kl=full"])
    with pytest.raises(ConfigError, match="backend hf returns whole distributions already"):
        _load("teachers.code={path: /t, top_k: 8}")
    with pytest.raises(ConfigError, match="merge the adapter into its base"):
        _load("teachers.code={path: /t, adapter: /a, backend: vllm, top_k: 8}")
