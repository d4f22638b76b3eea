"""The MOPD loop with its sampler as a server (rollout.backend server): `mopd teachers
serve` starts the student's sampler server, the run samples from it and pushes its
weights into it after every update, and the history is the in-process vLLM sampler's
(same seeds); the sampled log-probs stay the trainer's (on-policy); Ctrl-C on `serve`
leaves no process behind; a server that dies mid-run stops the run with its URL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import serve_real_vllm, tiny_mopd_run

pytestmark = [pytest.mark.server, pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm")
    return tiny_mopd_run(tmp_path_factory.mktemp("sampler_server"), domains=("alpha",),
                         data_extra="max_prompt_tokens: 64", recipe="""
rollout: {backend: vllm, max_new_tokens: 8, max_model_len: 256, kv_cache_gb: 0.25, enforce_eager: true}
train: {max_steps: 3, prompts_per_step: 4, lr: 1.0e-2, save_every: 0}
mlflow: {experiment: test, log_model: false}""")


def _go(cfg: Path, out: Path, *overrides: str) -> dict:
    from core.config import load_config
    from mopd.distill import DistillConfig, run

    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return run(load_config(DistillConfig, str(cfg), list(overrides)), out, progress=False)


def _serve(cfg: Path, out: Path):
    p = serve_real_vllm(cfg, out, "rollout.backend=server")
    return p, (out / "overrides.txt").read_text().split()


def test_server_sampler_same_history_as_the_in_process_engine(setup, tmp_path):
    import psutil

    local = _go(setup["cfg"], tmp_path / "local")["history"]
    p, overrides = _serve(setup["cfg"], tmp_path / "serve")
    try:
        assert overrides and overrides[-1].startswith("rollout.server.urls=[http://127.0.0.1:")
        kids = psutil.Process(p.pid).children(recursive=True)
        remote = _go(setup["cfg"], tmp_path / "remote", "rollout.backend=server", *overrides)["history"]
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive, alive
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert [h["step"] for h in remote] == [1, 2, 3]
    for x, y in zip(remote, local):
        for k in ("loss", "reverse_kl/alpha", "response_len/alpha"):
            assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-5), (x["step"], k, x[k], y[k])
        # the server held exactly the trainer's weights at every step (pushed after each update)
        assert x["mismatch/abs_max/alpha"] < 1e-3, x


def test_a_sampler_server_that_dies_stops_the_run_with_its_url(setup, tmp_path):
    from core.rollout import SamplerServerError

    p, overrides = _serve(setup["cfg"], tmp_path / "serve")
    url = overrides[-1].split("[", 1)[1].rstrip("]")
    try:
        def kill_after_first(step, m):
            if step == 1:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=120)
        from core.config import load_config
        from mopd.distill import DistillConfig, run

        cfg = load_config(DistillConfig, str(setup["cfg"]), ["rollout.backend=server", *overrides,
                                                             "rollout.server.max_retries=1", "train.max_steps=3"])
        with pytest.raises(SamplerServerError, match=url.replace(".", r"\.")):
            run(cfg, tmp_path / "run", progress=False, callbacks=[kill_after_first])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_trainer_processes_share_one_sampler_server(setup, tmp_path):
    """2 trainer processes (gloo, recipes/accelerate/cpu_ddp2.yaml) sampling from one
    server: rank 0 pushes the weights, rank 1 waits for the push, both sample their rows
    from it with their rows' seeds, and the update equals 1 process's with the server."""
    import torch
    from safetensors.torch import load_file

    p, overrides = _serve(setup["cfg"], tmp_path / "serve")
    common = ["--config", str(setup["cfg"]), "rollout.backend=server", *overrides, "train.max_steps=2",
              "train.optimizer=sgd", "train.lr=0.5", "rollout.server.group_port=29311"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    try:
        for n, out in ((1, tmp_path / "one"), (2, tmp_path / "two")):
            acc = REPO / "recipes/accelerate" / ("cpu.yaml" if n == 1 else "cpu_ddp2.yaml")
            r = subprocess.run([*launch, str(acc), "-m", "mopd.distill", "--out", str(out), *common],
                               capture_output=True, text=True, env=env, cwd=REPO)
            assert r.returncode == 0, r.stderr[-4000:]
            assert f"{n} process(es)" in r.stderr
        assert p.poll() is None
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "one", tmp_path / "two"))
    start = load_file(str(setup["student"] / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4
