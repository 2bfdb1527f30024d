"""Sharing a sender's KV pools with a receiver on the same host, for the pull path.

A sender offers its stacked pools (``[layers, 2, num_blocks, *block_shape]``, one allocation)
in its HELLO: a small JSON descriptor with the CUDA IPC handle of the allocation (what
``torch.multiprocessing`` sends for a CUDA tensor) and the view's shape, strides and offset.
A receiver on the same host maps it into its own device (CUDA opens the peer memory with peer
access enabled, so the receiver's kernels read it over NVLink) and then copies each message's
blocks straight from the sender's pools into its own: no staging buffer on either side and
no payload message, one kernel per message instead of gather + wire + scatter.

The descriptor is JSON, never pickle: it comes from the network. A receiver that cannot map
it (another host, another container, pools that are not one allocation, IPC refused) says so
in its HELLO_OK and the link keeps the staged path. Same-process pools (a sender and a
receiver in one process, where CUDA refuses to open its own handles) resolve through a
process-local table instead.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import uuid
import weakref

import torch

from pdserve.kvtransfer.layout import dtype_name

logger = logging.getLogger(__name__)

_LOCAL: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> stacked pools of this process
MAX_DESCRIPTOR_BYTES = 4096


def host_id() -> str:
    """This host's identity: its name and boot id (containers of one host share the boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def export_pools(stacked: torch.Tensor | None) -> bytes:
    """The descriptor of ``stacked`` (empty when there is nothing to offer)."""
    if stacked is None:
        return b""
    token = uuid.uuid4().hex
    _LOCAL[token] = stacked
    desc = {"host": host_id(), "pid": os.getpid(), "token": token, "shape": list(stacked.shape),
            "stride": list(stacked.stride()), "offset": stacked.storage_offset(), "dtype": dtype_name(stacked.dtype),
            "device": stacked.device.type}
    if stacked.is_cuda:
        try:
            (_, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = stacked.untyped_storage()._share_cuda_()
        except Exception as e:  # an allocator without IPC (e.g. expandable segments on an old torch)
            logger.info("KV pools cannot be shared over CUDA IPC (%s: %s); the staged path stays", type(e).__name__, e)
        else:
            desc["cuda"] = {"handle": _b64(handle), "size": int(size), "offset": int(offset),
                            "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
                            "event_handle": _b64(event_handle or b""), "event_sync": bool(event_sync)}
    blob = json.dumps(desc).encode()
    return blob if len(blob) <= MAX_DESCRIPTOR_BYTES else b""


def import_pools(blob: bytes, local: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
    """The sender's stacked pools mapped for reading on ``local``'s device, or None and why not.
    ``local`` is the receiver's own stacked pools: the layers, K/V and block shape must match
    (the number of blocks may differ)."""
    if not blob:
        return None, "the sender offered no pools"
    if local is None:
        return None, "the receiver's pools are not one allocation"
    try:
        desc = json.loads(bytes(blob).decode())
        shape, stride, offset = [int(x) for x in desc["shape"]], [int(x) for x in desc["stride"]], int(desc["offset"])
        same_process = desc["host"] == host_id() and int(desc["pid"]) == os.getpid()
        if desc["host"] != host_id():
            return None, "another host"
        if (len(shape) != local.dim() or shape[:2] != list(local.shape[:2]) or shape[3:] != list(local.shape[3:])
                or desc["dtype"] != dtype_name(local.dtype)):
            return None, f"pools {shape} {desc['dtype']} do not match {list(local.shape)}"
        if same_process:
            pools = _LOCAL.get(desc["token"])
            if pools is None or pools.device != local.device:
                return None, "same process, pools gone or on another device"
            return pools, "same process"
        if not (local.is_cuda and desc.get("cuda")):
            return None, "pools of another process that are not CUDA memory"
        c = desc["cuda"]
        storage = torch.UntypedStorage._new_shared_cuda(
            local.device.index, base64.b64decode(c["handle"]), int(c["size"]), int(c["offset"]),
            base64.b64decode(c["ref_handle"]), int(c["ref_offset"]), base64.b64decode(c["event_handle"]),
            bool(c["event_sync"]))
        need = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
        if need * local.element_size() > storage.nbytes():
            return None, "the view runs past the shared allocation"
        pools = torch.empty(0, dtype=local.dtype, device=local.device)
        pools.set_(storage, offset, shape, stride)
        return pools, "CUDA IPC"
    except Exception as e:  # a malformed descriptor or a refused mapping: the staged path
        return None, f"{type(e).__name__}: {e}"
