"""The sampler as a server: the student's rollouts come from a vLLM server in another
process (or node), and the trainer pushes its new weights into it after every update.

Sampling uses vLLM's token-in/token-out route `/inference/v1/generate` (the server runs
with `--enable-scale-out`): token ids in, sampled token ids out with each token's raw
log-prob (`--logprobs-mode raw_logprobs`) and the weights version that produced it. The
weights go through vLLM's own weight-update API (`/start_weight_update`,
`/update_weights`, `/finish_weight_update`, served in `VLLM_SERVER_DEV_MODE`) over the
transport the server was started with: `gloo` (this project's `mopd_gloo` backend,
core/rollout/weight_transfer.py; CPU and GPU) or `nccl` (vLLM's, GPU only, through TRL's
`VLLMClient`). `mopd teachers serve` starts such a server for a recipe with
`rollout.backend: server` (teachers/serve.py has the exact flags).

Every weight push carries a version (the trainer's update count); every sampled token
reports the version it came from, and a token from another version than the last push is
an error here, not a silently off-policy sample. Several trainer ranks share the servers
in `urls` round-robin (rank r samples from urls[r % n]); the lowest rank on each server
pushes to it, the others wait at a barrier.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from core.exitcodes import Unreachable
from core.http import Retryable, json_request
from core.rollout.base import Sample, _check_batch


class SamplerServerError(RuntimeError):
    """The sampler server cannot be used: unreachable, misconfigured, or a reply that cannot be trusted."""


class SamplerServerUnreachable(SamplerServerError, Unreachable):
    """The sampler server did not answer `max_retries + 1` attempts (exit code 3)."""


def _refusal_hint(r) -> str:
    if r.status_code == 403 and "scale-out" in r.text.lower():
        return " (start the server with --enable-scale-out, as `mopd teachers serve` does)"
    if r.status_code == 404:
        return (" (vLLM's weight-update routes need VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config; "
                "`mopd teachers serve` starts the sampler server with both)")
    return ""


def _own_address(url: str) -> str:
    """The address of this host as the server sees it (the interface that routes to it)."""
    host = httpx.URL(url).host or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))   # no packet is sent: only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class ServerRollout:
    """A `Rollout` backed by a vLLM server (see the module docstring)."""

    def __init__(self, urls: list[str] | str, *, transfer: str = "gloo", group_host: str = "", group_port: int = 51216,
                 timeout_s: float = 300.0, max_retries: int = 3, backoff_s: float = 1.0, concurrency: int = 32,
                 rank: int = 0, world_size: int = 1, check: bool = True):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise SamplerServerError("rollout.backend=server needs rollout.server.urls (start the server with "
                                     "`mopd teachers serve --config RECIPE --out DIR` and pass its overrides)")
        if transfer not in ("gloo", "nccl"):
            raise SamplerServerError(f"rollout.server.transfer must be gloo or nccl, got {transfer!r}")
        i = rank % len(urls)
        self.url = urls[i].rstrip("/")
        self.is_sender = rank == i              # the lowest rank on this server pushes the weights
        self.transfer, self.timeout_s = transfer, timeout_s
        self.max_retries, self.backoff_s, self.concurrency = max_retries, backoff_s, concurrency
        self.group_host = group_host or _own_address(self.url)
        self.group_port = group_port + i        # one rendezvous port per server
        self.world_size = world_size
        self.version = 0                        # weights version the server holds (0: its checkpoint)
        self.bytes_sent = 0
        self._sender = None
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s),
                                   limits=httpx.Limits(max_connections=max(concurrency, 1)))
        if check:
            self.check()

    # --- HTTP -------------------------------------------------------------------------
    def _once(self, method: str, path: str, payload: dict | None) -> dict:
        return json_request(self.client, method, self.url + path, payload, who="sampler server",
                            error=SamplerServerError, hint=_refusal_hint, empty_ok=True)

    def _request(self, method: str, path: str, payload: dict | None = None, *, retry: bool = True) -> dict:
        last = ""
        for rnd in range(self.max_retries + 1 if retry else 1):
            if rnd:
                time.sleep(self.backoff_s * 2 ** (rnd - 1))
            try:
                out = self._once(method, path, payload)
            except Retryable as e:
                last = str(e)
                continue
            if rnd:   # a failure the retry covered is still said: a flaky sampler server is worth knowing
                print(f"[mopd] sampler server {self.url}: {method} {path} failed ({last.split(':')[0]}), "
                      f"answered on attempt {rnd + 1}", file=sys.stderr)
            return out
        raise SamplerServerUnreachable(f"sampler server {self.url} is unreachable ({method} {path}, "
                                 f"{self.max_retries + 1 if retry else 1} attempt(s)): {last}")

    def _post(self, path: str, payload: dict) -> dict:
        # weight-update calls change the server's state: never sent twice
        return self._request("POST", path, payload, retry=False)

    # --- checks -----------------------------------------------------------------------
    def check(self) -> None:
        """Before any training: the server answers, serves the token route, and reports raw
        log-probs (the loss needs log p_S before temperature: the top token's log-prob must
        not move with the temperature)."""
        self._request("GET", "/health")
        lp = []
        for temp in (1.0, 0.5):
            out = self._request("POST", "/inference/v1/generate", {
                "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "temperature": temp, "logprobs": 2,
                                                            "seed": 0, "detokenize": False}})
            # the sampled token comes first, then the top ones: the rank-1 entry is the model's top token
            top = [t for t in self._choice(out, 1)["logprobs"]["content"][0].get("top_logprobs") or []
                   if t.get("rank") == 1]
            if not top:
                raise SamplerServerError(f"sampler server {self.url}: a generate reply with logprobs=2 has no rank-1 "
                                         f"candidate: {json.dumps(out)[:300]}")
            lp.append(top[0]["logprob"])
        if abs(lp[0] - lp[1]) > 1e-4:
            raise SamplerServerError(f"sampler server {self.url} reports log-probs after temperature ({lp[0]:.4f} at "
                                     f"T=1, {lp[1]:.4f} at T=0.5 for the same top token); start it with "
                                     f"--logprobs-mode raw_logprobs (as `mopd teachers serve` does)")

    def _choice(self, out: dict, n_tokens_max: int) -> dict:
        try:
            c = out["choices"][0]
            ids = c["token_ids"]
            content = c["logprobs"]["content"]
        except (KeyError, IndexError, TypeError):
            raise SamplerServerError(f"sampler server {self.url}: a generate reply without choices[0].token_ids "
                                     f"and logprobs: {json.dumps(out)[:300]}") from None
        if not isinstance(ids, list) or len(content) != len(ids) or len(ids) > n_tokens_max:
            raise SamplerServerError(f"sampler server {self.url}: {len(ids)} tokens with {len(content)} log-probs "
                                     f"(max_tokens {n_tokens_max})")
        return c

    # --- the Rollout protocol -----------------------------------------------------------
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seeds: list[int]) -> list[Sample]:
        _check_batch(prompts, seeds, max_new_tokens)
        if not prompts:
            return []

        def one(k: int) -> Sample:
            out = self._request("POST", "/inference/v1/generate", {
                "token_ids": list(map(int, prompts[k])),
                "sampling_params": {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                    "seed": int(seeds[k]), "logprobs": 0, "detokenize": False}})
            c = self._choice(out, max_new_tokens)
            ids = [int(t) for t in c["token_ids"]]
            lps = []
            for j, (d, t) in enumerate(zip(c["logprobs"]["content"], ids, strict=True)):
                if int(d["token_id"]) != t or not isinstance(d["logprob"], (int, float)) or d["logprob"] != d["logprob"]:
                    raise SamplerServerError(f"sampler server {self.url}: log-prob {j} of a sample is for token "
                                             f"{d.get('token_id')} (sampled {t}) or not a number ({d.get('logprob')})")
                lps.append(float(d["logprob"]))
            versions = {str(v.get("version")) for v in c.get("weight_versions") or []}
            want = "default" if self.version == 0 else str(self.version)
            if versions and versions != {want}:
                raise SamplerServerError(f"sampler server {self.url} sampled with weights version(s) "
                                         f"{sorted(versions)}, the trainer last pushed {want}: another trainer "
                                         f"pushes to this server, or a push was lost")
            return Sample(prompt_ids=list(prompts[k]), completion_ids=ids, sampler_logprobs=lps,
                          finished=c.get("finish_reason") == "stop")

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as ex:
            return list(ex.map(one, range(len(prompts))))

    def _open_sender(self):
        if self.transfer == "gloo":
            from core.rollout.weight_transfer import GlooSender

            n = int(self._request("GET", "/get_world_size").get("world_size", 1))
            return GlooSender(self._post, host=self.group_host, port=self.group_port, world_size=n,
                              timeout_s=self.timeout_s)
        return _NcclSender(self.url, self.group_port)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the trainer's weights (HF names) as the next version; every rank calls it."""
        items = list(named_tensors)   # gathered on every rank (FSDP full_tensor is a collective)
        if self.is_sender:
            if self._sender is None:
                self._sender = self._open_sender()
            self.bytes_sent += self._sender.send(items, str(self.version + 1))
            self._request("POST", "/reset_prefix_cache", {})
        self.version += 1
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.barrier()   # no rank samples before its server holds the new weights

    def read_weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a server sampler's weights are not read back; its sampled log-probs against the "
                                  "trainer's (the |Δ log p| sampler/trainer metric) show whether they match")

    def close(self) -> None:
        if self._sender is not None:
            try:
                self._request("POST", "/shutdown_weight_transfer_engine", {}, retry=False)
            except SamplerServerError:
                pass
            self._sender.close()
            self._sender = None
        self.client.close()


class _NcclSender:
    """vLLM's NCCL transport (GPU servers) through TRL's `VLLMClient`, which drives the
    same weight-update routes. Not exercised on this project's CPU machines."""

    def __init__(self, url: str, port: int):
        from trl.generation.vllm_client import VLLMClient

        self.client = VLLMClient(base_url=url, group_port=port)
        self.client.init_communicator(device=torch.cuda.current_device())

    def send(self, items: list[tuple[str, torch.Tensor]], version: str) -> int:
        meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in items]
        self.client.update_named_params(meta, iter(items))
        self.client._post(f"{self.client.base_url}/update_weight_version", json={"new_version": version})
        return sum(t.numel() * t.element_size() for _, t in items)

    def close(self) -> None:
        self.client.close_communicator()
