"""NIXL itself, for both roles: its bindings (imported on first use), an agent with the UCX
plugin, the pools checked and registered once, descriptor lists, and the wait for a transfer.

NIXL's agent runs its UCX progress thread (``enable_prog_thread``); the initiator (the sender of a
WRITE, the receiver of a READ) waits by polling ``check_xfer_state``, yielding the GIL between
polls. Transfer handles are made per message from descriptor lists (``initialize_xfer``); memory
is registered once per pool and per staging size, never per message."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
import uuid

import numpy as np
import torch

from pdserve.kvtransfer.base import KVCaches
from pdserve.kvtransfer.errors import KVTransferError

logger = logging.getLogger(__name__)


def load_nixl():
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``); KVTransferError naming
    what failed when it cannot be imported. The ``nixl`` meta package picks its CUDA flavour from
    the CUDA stack already imported (cuda-bindings 12 picks nixl-cu12); the flavour wheels
    ``nixl_cu13`` and ``nixl_cu12`` are tried directly after it."""
    errors = []
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise KVTransferError("NIXL is not importable (pip install 'pdserve[nixl]'): " + "; ".join(errors))


def _agent(api, role: str, progress_thread: bool = True):
    """A NIXL agent with the UCX plugin; ``progress_thread``: NIXL's own thread progresses UCX
    (it busy-polls: on a host of few cores it competes with the caller, who otherwise progresses
    UCX by checking its transfers' state)."""
    name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


_CUDA_WARNED = threading.Event()


def _warn_on_cuda(device: torch.device, op: str) -> None:
    """Once per process: this backend on CUDA pools is far slower than the UCX backend."""
    if device.type == "cuda" and not _CUDA_WARNED.is_set():
        _CUDA_WARNED.set()
        took = {"write": "21 ms (WRITE)", "direct": "98 ms (DIRECT)"}.get(op, "3.8 s (READ)")
        logger.warning("the NIXL KV backend is slow on GPUs: on one H200 a 2k-token Llama-3.1-8B KV took %s, "
                       "against 1.8 ms on the UCX backend; use --kv-backend ucx there (docs/results.md)", took)


def _mem(device: torch.device) -> tuple[str, int]:
    """NIXL memory type and device id of tensors on ``device``."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    if device.type != "cpu":
        raise ValueError(f"the NIXL backend moves CPU or CUDA pools, not {device.type}")
    return "DRAM", 0


def _pools(kv_caches: KVCaches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pools = [(k, v) for k, v in kv_caches]
    if not pools:
        raise ValueError("kv_caches is empty")
    for k, v in pools:
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("the NIXL backend needs contiguous K and V pools")
    return pools


def _pool_addresses(pools) -> list[list[int]]:
    """[layer][K, V] base addresses of ``pools``, as a handshake offers them."""
    return [[k.data_ptr(), v.data_ptr()] for k, v in pools]


def _register(agent, pools, mem: str, dev: int):
    """Register every distinct allocation under ``pools`` once (pools that are views of one
    allocation share it); returns the registration descriptor list."""
    regions = {}
    for pair in pools:
        for t in pair:
            storage = t.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
    return agent.register_memory([(ptr, n, dev, "") for ptr, n in sorted(regions.items())], mem)


def _descs(parts: list[tuple[np.ndarray, np.ndarray]], dev: int) -> np.ndarray:
    """NIXL descriptors ``[n, 3]`` (address, bytes, device) from (addresses, sizes) pairs."""
    out = np.empty((sum(a.size for a, _ in parts), 3), dtype=np.uint64)
    at = 0
    for addrs, sizes in parts:
        out[at:at + addrs.size, 0] = addrs
        out[at:at + addrs.size, 1] = sizes
        at += addrs.size
    out[:, 2] = dev
    return out


def _bind_device(device: torch.device) -> None:
    """Make ``device``'s CUDA context current in the calling thread, which registers memory or posts
    NIXL transfers (UCX's CUDA transports work through the thread's current context).
    ``set_device`` alone does not bind it (torch skips it when the device number is already the
    thread's); a runtime call does."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device).query()


def _own_stream(device: torch.device):
    """A context that makes a new stream of ``device`` the calling thread's current one (CUDA;
    nothing elsewhere)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def _wait_xfer(agent, handle, what: str, state: str | None = None) -> None:
    """Post ``handle`` (or, given the ``state`` its post returned, only wait) until NIXL says DONE."""
    if state is None:
        state = agent.transfer(handle)
    while state == "PROC":
        time.sleep(0)  # yield the GIL; NIXL's progress thread moves the bytes
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise KVTransferError(f"NIXL {what} failed (state {state})")
