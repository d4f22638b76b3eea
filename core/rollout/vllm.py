"""vLLM rollout: an engine living in this (the trainer's) process. After each optimizer
step the trainer pushes its new weights into the engine in memory with `sync_weights`,
so the next batch is sampled from exactly the weights being trained.

Every vLLM engine in this project (sampler and teachers) is started by
`start_vllm_engine`, the one place that sets vLLM's environment and engine options.
vllm itself is imported inside the functions that need it: it is an optional extra
(`cpu` / `gpu`), and everything else here works without it.
"""
from __future__ import annotations

import contextlib
import gc
import glob
import logging
import os
import random
import socket
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

from core.hf_dirs import check_vllm_servable
from core.rollout.base import Sample, _check_batch



def _configure_vllm_env() -> None:
    """The only environment variables this project sets for vLLM, and why.

    VLLM_ENABLE_V1_MULTIPROCESSING=0: run vLLM's engine core (scheduler + model) in
    this process instead of a child process. `sync_weights` then hands the trainer's
    tensors to the engine's model by reference (no pickling, no disk), several engines
    (a sampler and teachers) can live in one process, and `external_launcher` (one
    engine per torchrun/accelerate rank, what TRL's colocate mode uses) requires it.
    Also makes scripts that start engines work without an `if __name__ == "__main__"`
    guard, since nothing is spawned.

    The KV cache size is not set through the CPU-only VLLM_CPU_KVCACHE_SPACE but through
    the engine's device-neutral `kv_cache_memory_bytes` (see `start_vllm_engine`).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs several INFO lines per weight sync (and a harmless warning that the rotary
    # embedding has no weights to load); once per step, that buries the progress bar.
    # A user who wants them sets VLLM_LOGGING_LEVEL=INFO.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _quiet_vllm_logs() -> None:
    # A logger's filters apply to records created on it, so filter the module that logs it.
    lg = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _QuietReload) for f in lg.filters):
        lg.addFilter(_QuietReload())


class _QuietReload(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def _distributed_engine_kwargs() -> dict[str, Any]:
    """Engine options when torch.distributed is already initialized (accelerate/torchrun).

    One engine per rank, each sampling its own prompts (tensor_parallel_size 1), as TRL's
    colocate mode does: `external_launcher` makes vLLM reuse the existing process group
    and take its device from LOCAL_RANK instead of initializing a world of its own.
    """

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if not os.environ.get("MASTER_PORT"):

        with socket.socket() as s:
            s.bind(("", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return {"distributed_executor_backend": "external_launcher"}


@contextlib.contextmanager
def _keep_process_state() -> Iterator[None]:
    """Undo what starting an in-process engine does to the trainer's process.

    vLLM's worker seeds the global RNGs with the engine seed and sets torch to one
    intra-op thread (on CPU it also replaces `torch.set_num_threads` with a no-op).
    Those are right for a dedicated serving process, wrong for the trainer sharing it.
    """

    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])


# Engines alive in this process, and whether torch.distributed was started by vLLM
# (no launcher) rather than by accelerate/torchrun before the first engine.
_LIVE_ENGINES = 0
_VLLM_OWNS_DIST = False


def start_vllm_engine(model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 512,
                      kv_cache_gb: float | None = 1.0, enable_prefix_caching: bool = False,
                      gpu_memory_utilization: float = 0.3, **engine_kwargs: Any):
    """Start a `vllm.LLM` in this process. Used for the sampler and for teachers.

    kv_cache_gb: KV-cache size (`kv_cache_memory_bytes`, honoured on CPU and GPU); None lets
    vLLM size it from `gpu_memory_utilization` (on CPU: the fraction of RAM it may use).
    engine_kwargs go to `vllm.LLM` unchanged (e.g. enforce_eager=True, tensor_parallel_size).
    Stop it with `shutdown_vllm_engine` (or let it be garbage-collected).
    """
    global _LIVE_ENGINES, _VLLM_OWNS_DIST

    check_vllm_servable(model_path)   # before vLLM builds anything: an architecture it has no model for
    _configure_vllm_env()
    from vllm import LLM

    _quiet_vllm_logs()

    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, gpu_memory_utilization=gpu_memory_utilization,
        # Sampled-token log-probs straight from the model's logits, before temperature,
        # top-p or penalties: the log p_S(y_t) the loss needs, independent of sampling knobs.
        logprobs_mode="raw_logprobs",
        # Never split a prompt across engine steps: when a prefill is chunked, vLLM
        # discards the token sampled for the partial request and rewinds that request's
        # seeded generator, which CPU generators cannot do ("CPU Generator does not use
        # offset"). Whole prompts only, with a token budget big enough for a batch.
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(16384, max_model_len),
    )
    if kv_cache_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
    kwargs.update(_distributed_engine_kwargs())
    kwargs.update(engine_kwargs)
    if _LIVE_ENGINES == 0:
        _VLLM_OWNS_DIST = not (dist.is_available() and dist.is_initialized())
    with _keep_process_state():
        llm = LLM(**kwargs)
    _LIVE_ENGINES += 1
    # vLLM's in-process client shuts its engine down when collected, and that shutdown
    # also destroys vLLM's parallel groups and torch.distributed's default process group:
    # fatal for the other engines in this process and for the trainer's own group.
    # Replace it with a shutdown that only tears those down when vLLM created them and
    # this is the last engine.
    client = llm.llm_engine.engine_core
    if isinstance(getattr(client, "_finalizer", None), weakref.finalize):
        client._finalizer.detach()
        client._finalizer = weakref.finalize(client, _release_engine_core, client.engine_core)
    return llm


def _release_engine_core(engine_core) -> None:
    global _LIVE_ENGINES
    import vllm.v1.engine.core as core_mod

    _LIVE_ENGINES -= 1
    cleanup = core_mod.cleanup_dist_env_and_memory
    if _LIVE_ENGINES > 0 or not _VLLM_OWNS_DIST:
        core_mod.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()
    try:
        engine_core.shutdown()
    finally:
        core_mod.cleanup_dist_env_and_memory = cleanup


def shutdown_vllm_engine(llm) -> None:
    """Stop an engine started by `start_vllm_engine` and free its memory (idempotent).

    Other engines in this process and the trainer's torch.distributed group keep working.
    """
    client = llm.llm_engine.engine_core
    if isinstance(getattr(client, "_finalizer", None), weakref.finalize):
        client._finalizer()  # runs _release_engine_core, at most once
    else:
        client.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _checkpoint_tensor_names(model_path: str) -> set[str]:
    """Tensor names stored in a local safetensors checkpoint (empty if not local)."""
    names: set[str] = set()
    if not os.path.isdir(model_path):
        return names

    for f in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(f, framework="pt") as st:
            names.update(st.keys())
    # Buffers some old checkpoints carry that are not parameters of the HF model.
    return {n for n in names if not n.endswith("rotary_emb.inv_freq")}


def _read_model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copy a vLLM model's parameters to CPU under vLLM's own names (fused qkv_proj, ...).

    On CPU, vLLM packs linear weights into oneDNN/AMX kernels and leaves the Parameter
    empty; those are read back through the kernel itself (x = identity gives W^T, exact:
    every output is one weight times 1.0 plus zeros), so this shows what the kernel
    really multiplies by.
    """
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            t = p.detach()
            if p_name == "weight" and t.numel() == 0 and hasattr(module, "cpu_linear"):
                t = _unpack_cpu_linear(module, t.dtype)
            out[name] = t.to("cpu", copy=True)
    return out


def _unpack_cpu_linear(module: torch.nn.Module, dtype: torch.dtype, chunk: int = 1024) -> torch.Tensor:
    K = module.input_size_per_partition
    cols = []
    for start in range(0, K, chunk):
        eye = torch.zeros(min(chunk, K - start), K, dtype=dtype)
        eye[:, start:start + eye.shape[0]] = torch.eye(eye.shape[0], dtype=dtype)
        cols.append(module.cpu_linear(eye, module.weight, None))  # [chunk, N] = W[:, chunk]^T
    return torch.cat(cols, dim=0).t().contiguous()


class VLLMRollout:
    """A colocated vLLM engine (in this process) that samples for the student."""

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 512,
                 kv_cache_gb: float | None = 1.0, enable_prefix_caching: bool = False,
                 gpu_memory_utilization: float = 0.3, **engine_kwargs: Any):
        self.model_path = str(model_path)
        t0 = time.perf_counter()
        self.llm = start_vllm_engine(self.model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                     kv_cache_gb=kv_cache_gb, enable_prefix_caching=enable_prefix_caching,
                                     gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        self.start_seconds = time.perf_counter() - t0
        self._expected_names = _checkpoint_tensor_names(self.model_path)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seeds: list[int]) -> list[Sample]:
        from vllm import SamplingParams, TokensPrompt

        _check_batch(prompts, seeds, max_new_tokens)
        if not prompts:
            return []
        params = [SamplingParams(n=1, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=int(s), logprobs=0, detokenize=False) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False)
        samples = []
        for p, o in zip(prompts, outs, strict=True):
            c = o.outputs[0]
            ids = list(c.token_ids)
            samples.append(Sample(prompt_ids=list(p), completion_ids=ids,
                                  sampler_logprobs=[float(d[t].logprob) for d, t in zip(c.logprobs, ids, strict=True)],
                                  finished=c.finish_reason == "stop"))
        return samples

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (HF names, checkpoint layout) into the engine, in memory.

        Uses vLLM's in-place layerwise reload: each layer's weights are buffered until the
        layer is complete, then processed exactly like at load time (qkv / gate_up fusion,
        CPU kernel packing, quantization) and copied into the engine's existing storage
        (CUDA graphs and compiled code keep pointing at it). Tensors are streamed, so a
        generator that gathers one parameter at a time works; in layer order (as
        named_parameters yields them) only one layer is buffered at a time. Tensors are
        held by reference until their layer is complete: don't modify them in place before
        this returns. Pass every parameter: a layer given only part of its weights would be
        processed with garbage (missing checkpoint names raise, after the fact).

        (TRL's colocate path, `model_runner.model.load_weights(...)` per parameter, fails
        on vLLM-CPU: its linear weights are repacked for oneDNN at load time and the
        Parameters left empty, without a weight_loader. The layerwise reload repacks.)
        """
        seen: set[str] = set()

        def stream():
            for name, tensor in named_tensors:
                seen.add(name)
                yield name, tensor.detach()

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        missing = self._expected_names - seen
        if missing:
            raise RuntimeError(f"sync_weights: {len(missing)} checkpoint tensors were not passed, e.g. "
                               f"{sorted(missing)[:5]}; the sampler's weights are now inconsistent. "
                               "Pass all parameters (model.named_parameters()).")

    def read_weights(self) -> dict[str, torch.Tensor]:
        return self.llm.apply_model(_read_model_weights)[0]

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            llm, self.llm = self.llm, None
            shutdown_vllm_engine(llm)


