"""Benchmark KV transfer between two processes over UCX, against raw ``ucxx`` in the same run.

For the KV of one prompt (all layers, K and V, non-contiguous blocks of 16 tokens) the
sender process pushes every layer to a receiver process and waits for its acknowledgement.
Reported, median of ``--repeat`` transfers after a warm-up:

- ``kvx``: pdserve's UCX backend end to end, first ``send_layer`` to the receiver's ACK as
  the sender sees it, and the per-transfer breakdown (``TransferResult.phases``: stage,
  queue, wire, ack on the sender; scatter, land on the receiver). Between processes on one
  host the receiver maps the sender's pools (CUDA IPC) and pulls each message's blocks in one
  copy kernel (the default); ``kvx staged`` is the same with ``pull=False``: gather into a
  staging buffer, the payload over UCX, scatter. Both are checked: the received blocks must
  equal the sent ones, byte for byte;
- ``raw same``: raw ``ucxx`` between two other processes moving the same payload bytes in
  the same messages (one per layer, K then V), every send and receive posted at once, from
  the first send posted to the receiver's report that all landed;
- ``raw one``: raw ``ucxx`` moving the same bytes in one message (context: the link);
- ``nccl same`` / ``nccl one``: NCCL send/recv through ``torch.distributed`` between two other
  processes, the same messages / one message (only when sender and receiver are on different
  GPUs: NCCL does not run two ranks on one GPU), from a barrier to the receiver's synchronize;
- ``nixl W`` / ``nixl R`` (``same``: one descriptor per layer; ``one``: one descriptor): raw
  NIXL (its UCX plugin) between two other processes moving the same bytes, WRITE posted by the
  sender, READ posted by the receiver, descriptor lists prepared once and one transfer handle
  re-posted, from the post to the initiator's DONE (spinning on ``check_xfer_state``); the landed
  bytes are checked. ``--nixl-diag`` adds the variants that cost throughput (a handle made per
  transfer with ``initialize_xfer``; 1 ms sleeps between state checks);
- ``kvx nixl`` / ``nixl read``: pdserve's NIXL backend (``--kv-backend nixl``) end to end, as
  ``kvx``: the sender gathers each layer's blocks and WRITEs them (one descriptor per slot) into the
  receiver's staging, which scatters them (the default), WRITEs them straight into the reserved
  blocks (``op="direct"``, a descriptor per run of blocks), or the receiver READs them (``op="read"``); then
  ACK; checked byte for byte. NIXL rows are left out, with the reason, where
  NIXL is not importable (``pip install 'pdserve[nixl]'``);
- ``fake``: the in-process fake backend (gather + copy + scatter, no network);
- ``copy``: a plain device copy of the same bytes on the sender's device.

Shapes: ``--device cpu``: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32);
``--device cuda``: Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16). The receiver
runs on ``--receiver-device`` (default: the sender's device: two processes on one GPU).

    python -m benchmarks.bench_kvtransfer [--device cpu|cuda] [--receiver-device cuda:1]
        [--tokens 2048 8192] [--repeat 5] [--no-nixl] [--nixl-diag]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.kvtransfer import settings, trace

# This process's KV plane from its environment (PDSERVE_KV_TRACE=1: print where the time goes; the
# GIL switch interval, the UCX progress mode): here, and in each child of the spawn context, which
# imports this module again
settings.configure(settings.KVSettings.from_environment())

BLOCK_SIZE = 16
RAW_TAG = 0x5244


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def layer_bytes(self, tokens: int) -> int:
        return 2 * tokens * self.num_kv_heads * self.head_dim * self.itemsize

    def kv_bytes(self, tokens: int) -> int:
        return self.num_layers * self.layer_bytes(tokens)


SHAPES = {
    "cpu": Shape("SmolLM2-135M", 30, 3, 64, "float32"),
    "cuda": Shape("Llama-3.1-8B", 32, 8, 128, "bfloat16"),
}


def make_caches(shape: Shape, num_blocks: int, device: str, fill: bool):
    """Per-layer (K, V) pools, views of one [layers, 2, ...] allocation as the engine makes them."""
    dims = (shape.num_layers, 2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    dtype = getattr(torch, shape.dtype)
    pools = torch.randn(dims, device=device).to(dtype) if fill else torch.zeros(dims, dtype=dtype, device=device)
    return [(pools[i, 0], pools[i, 1]) for i in range(shape.num_layers)]


def block_digest(caches, block_ids) -> int:
    """An exact fingerprint of the K and V bytes of ``block_ids`` in every layer, in order."""
    total = 0
    weights = torch.arange(1, len(block_ids) + 1, dtype=torch.int64, device=caches[0][0].device)
    for layer, (k, v) in enumerate(caches):
        for which, pool in enumerate((k, v)):
            words = pool[block_ids].reshape(len(block_ids), -1).view(torch.int32).to(torch.int64).sum(dim=1)
            total += int((words * weights).sum().item()) * (2 * layer + which + 1)
    return total


def _receiver_main(conn, shape: Shape, num_blocks: int, device: str, backend: str = "ucx") -> None:
    """Child process: a pdserve receiver (``backend``) driven over a Pipe."""
    from pdserve import kvtransfer

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    caches = make_caches(shape, num_blocks, device, fill=False)
    receiver = kvtransfer.create_receiver(backend, caches)
    conn.send(receiver.address())
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            receiver.close()
            conn.send(None)
            return
        if cmd == "expect":
            receiver.expect(*args)
            conn.send(None)
        elif cmd == "wait":
            conn.send(receiver.wait(*args))
        elif cmd == "digest":
            conn.send(block_digest(caches, args[0]))
        elif cmd == "zero":
            for k, v in caches:
                k.zero_()
                v.zero_()
            conn.send(None)
        elif cmd == "metrics":
            conn.send(receiver.metrics())
        elif cmd == "trace":
            from pdserve.kvtransfer import trace

            conn.send(trace.drain())


def _raw_receiver_main(conn, device: str) -> None:
    """Child process: raw ucxx receives of whatever message sizes the parent announces."""
    from pdserve.kvtransfer.ucx_runtime import UcxRuntime

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    rt = UcxRuntime.acquire()
    conn.send(rt.worker_address)
    while True:
        cmd, sizes = conn.recv()
        if cmd == "stop":
            conn.send(None)
            break
        buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]

        async def receive_all():
            tasks = [asyncio.get_running_loop().create_task(rt.ucxx.recv(b if b.is_cuda else b.numpy(), RAW_TAG))
                     for b in buffers]
            await asyncio.sleep(0)  # every receive posted
            conn.send("posted")
            await asyncio.gather(*tasks)

        rt.call(receive_all(), timeout=120)
        conn.send("landed")
    UcxRuntime.release()


def raw_ucxx_gbps(sizes: list[int], device: str, receiver_device: str, repeat: int) -> float:
    """GB/s of raw ucxx moving messages of ``sizes`` bytes (all posted at once) to a receiver
    process: first send posted to the receiver's report that every message landed."""
    from pdserve.kvtransfer.ucx_runtime import UcxRuntime

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_raw_receiver_main, args=(child_conn, receiver_device), daemon=True)
    child.start()
    rt = UcxRuntime.acquire()
    try:
        if not conn.poll(120):
            raise RuntimeError("raw ucxx receiver did not start")
        address = conn.recv()
        ucxx = rt.ucxx

        async def connect():
            return await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False)

        ep = rt.call(connect())
        buffers = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in sizes]
        wires = [b if b.is_cuda else b.numpy() for b in buffers]
        if device.startswith("cuda"):
            torch.cuda.synchronize()

        async def send_all():
            await asyncio.gather(*(ep.send(w, tag=RAW_TAG, force_tag=True) for w in wires))

        times = []
        for _ in range(repeat + 1):
            conn.send(("recv", sizes))
            if conn.recv() != "posted":
                raise RuntimeError("raw ucxx receiver failed")
            start = time.perf_counter()
            rt.call(send_all(), timeout=120)
            if conn.recv() != "landed":
                raise RuntimeError("raw ucxx receiver failed")
            times.append(time.perf_counter() - start)
        conn.send(("stop", None))
        conn.recv()
    finally:
        UcxRuntime.release()
        child.join(30)
        if child.is_alive():
            child.kill()
    return sum(sizes) / statistics.median(times[1:]) / 1e9


def _nccl_main(rank: int, port: int, device: str, sizes: list[int], repeat: int, conn) -> None:
    """Child process: one NCCL rank; rank 0 sends ``sizes`` to rank 1, ``repeat + 1`` times."""
    import torch.distributed as dist

    torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device(device))
    try:
        if rank == 0:
            buffers = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for n in sizes]
        else:
            buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        times = []
        for _ in range(repeat + 1):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            op = dist.isend if rank == 0 else dist.irecv
            ops = [dist.P2POp(op, b, 1 - rank) for b in buffers]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        conn.send(times)
    finally:
        dist.destroy_process_group()


def nccl_gbps(sizes: list[int], device: str, receiver_device: str, repeat: int) -> float | None:
    """GB/s of NCCL send/recv of ``sizes`` bytes between two processes (receiver's clock, from a
    barrier to its synchronize after every receive); None when both ends share a GPU."""
    if not device.startswith("cuda") or torch.device(device) == torch.device(receiver_device):
        return None
    from pdserve.loadgen.launcher import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_nccl_main, args=(rank, port, dev, sizes, repeat, pipes[rank][1]), daemon=True)
             for rank, dev in enumerate((device, receiver_device))]
    for p in procs:
        p.start()
    try:
        if not pipes[1][0].poll(180):
            raise RuntimeError("NCCL receiver did not report")
        times = pipes[1][0].recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return sum(sizes) / statistics.median(times[1:]) / 1e9


def nixl_missing() -> str | None:
    """Why NIXL cannot run here (None: it can)."""
    from pdserve.kvtransfer.errors import KVTransferError
    from pdserve.kvtransfer.nixl import load_nixl

    try:
        load_nixl()
    except KVTransferError as e:
        return str(e)
    return None


def _nixl_pattern(total: int, device: str) -> torch.Tensor:
    """The bytes the NIXL source holds: the same on both sides, to check what landed."""
    gen = torch.Generator().manual_seed(total)
    return torch.randint(0, 255, (total,), dtype=torch.uint8, generator=gen).to(device)


def _nixl_side(total: int, device: str, source: bool, progress_thread: bool = True):
    """A NIXL agent with one registered buffer of ``total`` bytes (the pattern when ``source``)."""
    from pdserve.kvtransfer.nixl.agent import _agent, _mem, load_nixl

    api = load_nixl()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    buf = _nixl_pattern(total, device) if source else torch.zeros(total, dtype=torch.uint8, device=device)
    mem, dev = _mem(buf.device)
    agent = _agent(api, "raw", progress_thread)
    agent.register_memory([(buf.data_ptr(), total, dev, "")], mem)
    return agent, buf, mem, dev


def _nixl_block_descs(base: int, offsets: list[int], size: int, dev: int):
    import numpy as np

    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = base + np.asarray(offsets, dtype=np.uint64)
    out[:, 1] = size
    out[:, 2] = dev
    return out


def kv_block_offsets(shape: "Shape", pool_blocks: int, block_ids: list[int]) -> list[int]:
    """Byte offsets, in stacked pools ``[layers, 2, pool_blocks, block]``, of the K then V block of
    each id, layer by layer: the descriptors a per-block transfer of those blocks posts."""
    block = shape.layer_bytes(BLOCK_SIZE) // 2
    return [((layer * 2 + kv) * pool_blocks + b) * block
            for layer in range(shape.num_layers) for kv in (0, 1) for b in block_ids]


def _landed_ok(buf, total: int, device: str, blocks) -> bool:
    """Whether each destination block of a per-block transfer holds its source block's bytes."""
    src_off, dst_off, size = blocks[0], blocks[1], blocks[2]
    pattern = _nixl_pattern(total, device).view(-1, size)
    src_rows = torch.tensor([o // size for o in src_off], device=buf.device)
    dst_rows = torch.tensor([o // size for o in dst_off], device=buf.device)
    return torch.equal(buf.view(-1, size)[dst_rows], pattern[src_rows])


def _nixl_descs(base: int, sizes: list[int], dev: int):
    import numpy as np

    out = np.empty((len(sizes), 3), dtype=np.uint64)
    out[:, 0] = base + np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.uint64)]).astype(np.uint64)
    out[:, 1] = sizes
    out[:, 2] = dev
    return out


def _nixl_initiator_main(conn, op: str, sizes: list[int], device: str, repeat: int, prepped: bool, poll: str,
                         progress_thread: bool = True, thread: str = "", blocks=None) -> None:
    """Child process: the NIXL initiator. WRITE: it holds the source (sender side); READ: the
    destination (receiver side). ``prepped``: descriptor lists prepared once and one transfer
    handle re-posted (else ``initialize_xfer`` per transfer); ``poll``: ``spin`` (check the state
    back to back) or ``sleep`` (1 ms between checks); ``progress_thread``: NIXL's own UCX progress
    thread in the initiator (the passive side always runs one); ``thread``: post from the main
    thread (``""``), from a new thread (``"bare"``), or from a new thread that first calls
    ``torch.cuda.set_device`` (``"device"``), as a backend's sending thread would."""
    total = sum(sizes) if blocks is None else blocks[3]
    agent, buf, mem, dev = _nixl_side(total, device, op == "WRITE", progress_thread)
    metadata, remote_base, remote_dev, remote_mem = conn.recv()
    name = agent.add_remote_agent(metadata)
    if blocks is None:
        local = _nixl_descs(buf.data_ptr(), sizes, dev)
        remote = _nixl_descs(remote_base, sizes, remote_dev)
    else:  # (source offsets, destination offsets, bytes each, buffer bytes)
        # READ: we hold the destination
        mine, theirs = (blocks[0], blocks[1]) if op == "WRITE" else (blocks[1], blocks[0])
        local = _nixl_block_descs(buf.data_ptr(), mine, blocks[2], dev)
        remote = _nixl_block_descs(remote_base, theirs, blocks[2], remote_dev)
    if prepped:
        import numpy as np

        idx = np.arange(len(local), dtype=np.int32)
        handle = agent.make_prepped_xfer(op, agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem), idx,
                                         agent.prep_xfer_dlist(name, remote, remote_mem), idx, b"done")
    times = []
    if thread:
        import threading

        result: list = []

        def posting():
            if thread == "device" and device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device))
            result.append(_post_and_time(agent, op, handle if prepped else None, local, remote, mem, remote_mem, name,
                                         repeat, poll))

        t = threading.Thread(target=posting)
        t.start()
        t.join()
        times, error = result[0]
    else:
        times, error = _post_and_time(agent, op, handle if prepped else None, local, remote, mem, remote_mem, name,
                                      repeat, poll)
    if error:
        conn.send(("err", error))
        return
    ok = op == "WRITE" or (_landed_ok(buf, total, device, blocks) if blocks else torch.equal(
        buf, _nixl_pattern(total, device)))
    conn.send(("ok", (times, ok)))
    conn.recv()  # the parent checked its side and removed us


def _post_and_time(agent, op, handle, local, remote, mem, remote_mem, name, repeat, poll):
    """(seconds of each of ``repeat`` + 1 transfers, error or None): ``handle`` re-posted, or
    (None) one made per transfer."""
    prepped = handle is not None
    times = []
    for _ in range(repeat + 1):
        if not prepped:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, mem),
                                           agent.get_xfer_descs(remote, remote_mem), name, b"done")
        start = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            if poll == "sleep":
                time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - start)
        if state != "DONE":
            return times, f"NIXL {op} ended in state {state}"
        if not prepped:
            handle.release()
    return times, None


def raw_nixl_gbps(sizes: list[int], op: str, device: str, receiver_device: str, repeat: int,
                  prepped: bool = True, poll: str = "spin", progress_thread: bool = True, thread: str = "",
                  blocks=None) -> float:
    """GB/s of raw NIXL (UCX plugin) moving ``sizes`` bytes, one descriptor each, from a sender
    to a receiver process: WRITE posted by the sender, READ posted by the receiver; from the
    post to the initiator's DONE; the landed bytes are checked. ``blocks``: (source offsets,
    destination offsets, bytes each, buffer bytes), one descriptor per block instead."""
    total = sum(sizes) if blocks is None else blocks[3]
    initiator_device, passive_device = (device, receiver_device) if op == "WRITE" else (receiver_device, device)
    # the passive side makes no NIXL calls: without its progress thread UCX's wire-up never completes
    agent, buf, mem, dev = _nixl_side(total, passive_device, op == "READ", True)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_nixl_initiator_main,
                        args=(child_conn, op, sizes, initiator_device, repeat, prepped, poll, progress_thread, thread,
                              blocks),
                        daemon=True)
    child.start()
    try:
        conn.send((agent.get_agent_metadata(), buf.data_ptr(), dev, mem))
        if not conn.poll(300):
            raise RuntimeError(f"raw NIXL {op} initiator did not report")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        times, ok = value
        if op == "WRITE":
            ok = (_landed_ok(buf, total, passive_device, blocks) if blocks
                  else torch.equal(buf, _nixl_pattern(total, passive_device)))
        if not ok:
            raise RuntimeError(f"raw NIXL {op}: the landed bytes differ from the sent ones")
        conn.send("stop")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    moved = total if blocks is None else len(blocks[0]) * blocks[2]
    return moved / statistics.median(times[1:]) / 1e9


def copy_gbps(nbytes: int, device: str, repeat: int) -> float:
    """GB/s of ``dst.copy_(src)`` of ``nbytes`` bytes on ``device`` (best of ``repeat``)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(max(repeat, 3)):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / min(times) / 1e9


def one_transfer(sender, address: str, transfer_id: str, shape: Shape, src_ids, dst_ids, expect, wait):
    """GB/s to the sender's ACK, the sender's and the receiver's results, and the seconds from the
    first send_layer to the receiver's landing (``time.monotonic`` is one clock for the host)."""
    expect(transfer_id, dst_ids, shape.num_layers, 120.0)
    start = time.perf_counter()
    start_mono = time.monotonic()
    for layer in range(shape.num_layers):
        sender.send_layer(address, transfer_id, layer, src_ids, dst_ids)
    sent = sender.finish(transfer_id, timeout=120)
    seconds = time.perf_counter() - start
    landed = wait(transfer_id, 120.0)
    return sent.num_bytes / seconds / 1e9, sent, landed, landed.finished_at - start_mono


def timeline(points: list[tuple[str, int, int, float]]) -> list[tuple[str, float]]:
    """Median time of each trace point (``pdserve.kvtransfer.trace``) after the transfer's first point,
    over the transfers after the first (warm-up), in the order they happen: where the time goes."""
    by_key: dict[int, list[tuple[str, int, float]]] = {}
    for point, key, layer, t in points:
        by_key.setdefault(key, []).append((point, layer, t))
    offsets: dict[str, list[float]] = {}
    for rows in list(by_key.values())[1:]:
        t0 = min(t for _, _, t in rows)
        seen: dict[str, int] = {}
        for point, layer, t in sorted(rows, key=lambda r: r[2]):
            n = seen[point] = seen.get(point, 0) + 1
            name = point if n == 1 else f"{point}#{n}"  # the 2nd message's point, and so on
            offsets.setdefault(name, []).append(t - t0)
    return sorted(((name, statistics.median(v)) for name, v in offsets.items()), key=lambda kv: kv[1])


def ucx_rows(out: dict, backend_runs, shape: Shape, blocks: int, nbytes: int, device: str, receiver_device: str,
             repeat: int) -> None:
    """The UCX backend (pull and staged), raw ucxx and NCCL rows of one token count, into ``out``."""
    from pdserve import kvtransfer

    by_mode = backend_runs("ucx", (("kvx", {"pull": True}), ("staged", {"pull": False})))
    runs = by_mode["kvx"][1:]
    out["staged"] = statistics.median(r[0] for r in by_mode["staged"][1:])
    out["staged_phases"] = {name: statistics.median(r[1].phases.get(name, 0.0) for r in by_mode["staged"][1:])
                            for name in kvtransfer.SENDER_PHASES}
    out["staged_phases"].update({name: statistics.median(r[2].phases.get(name, 0.0) for r in by_mode["staged"][1:])
                                 for name in kvtransfer.RECEIVER_PHASES})
    out["kvx"] = statistics.median(r[0] for r in runs)
    out["kvx_landed_s"] = statistics.median(r[3] for r in runs)
    out["kvx_recv"] = statistics.median(r[2].num_bytes / r[2].seconds / 1e9 for r in runs)
    out["phases"] = {name: statistics.median(r[1].phases.get(name, 0.0) for r in runs)
                     for name in kvtransfer.SENDER_PHASES}
    out["phases"].update({name: statistics.median(r[2].phases.get(name, 0.0) for r in runs)
                          for name in kvtransfer.RECEIVER_PHASES})
    out["seconds"] = statistics.median(r[1].seconds for r in runs)
    layer = shape.layer_bytes(blocks * BLOCK_SIZE)
    out["raw_same"] = raw_ucxx_gbps([layer] * shape.num_layers, device, receiver_device, repeat)
    out["raw_one"] = raw_ucxx_gbps([nbytes], device, receiver_device, repeat)
    out["nccl_same"] = nccl_gbps([layer] * shape.num_layers, device, receiver_device, repeat)
    out["nccl_one"] = nccl_gbps([nbytes], device, receiver_device, repeat)


NIXL_MODES = {"direct": "kvx_nixl_direct", "write": "kvx_nixl", "read": "kvx_nixl_read"}  # --nixl-modes -> result key


def bench_tokens(shape: Shape, tokens: int, device: str, receiver_device: str, repeat: int, nixl: bool = False,
                 nixl_diag: bool = False, nixl_ops: tuple[str, ...] = ("WRITE", "READ"), nixl_only: bool = False,
                 nixl_modes: tuple[str, ...] = tuple(NIXL_MODES)) -> dict:
    from pdserve import kvtransfer

    blocks = -(-tokens // BLOCK_SIZE)
    pool_blocks = 2 * blocks  # blocks drawn at random from twice as many: ids are not contiguous
    gen = torch.Generator().manual_seed(tokens)
    src_ids = torch.randperm(pool_blocks, generator=gen)[:blocks].tolist()
    dst_ids = torch.randperm(pool_blocks, generator=gen)[:blocks].tolist()
    nbytes = shape.kv_bytes(blocks * BLOCK_SIZE)
    src = make_caches(shape, pool_blocks, device, fill=True)
    out: dict = {"bytes": float(nbytes)}
    if not nixl_only:
        out["copy"] = copy_gbps(nbytes, device, repeat)
        dst = make_caches(shape, pool_blocks, device, fill=False)
        with kvtransfer.create_receiver("fake", dst) as receiver, kvtransfer.create_sender("fake", src) as sender:
            runs = [one_transfer(sender, receiver.address(), f"fake-{i}", shape, src_ids, dst_ids, receiver.expect,
                                 receiver.wait)[0] for i in range(repeat + 1)]
            out["fake"] = statistics.median(runs[1:])
        del dst

    want = block_digest(src, src_ids)

    def backend_runs(backend: str, modes) -> dict:
        """Transfers to a receiver process of ``backend``, per mode ``(name, sender options)``;
        the received blocks are checked against the sent ones after each mode."""
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=_receiver_main, args=(child_conn, shape, pool_blocks, receiver_device, backend),
                            daemon=True)
        child.start()
        try:
            if not conn.poll(120):
                raise RuntimeError(f"{backend} receiver process did not start")
            address = conn.recv()

            def call(cmd, *args):
                conn.send((cmd, args))
                return conn.recv()

            by_mode = {}
            for mode, opts in modes:
                if trace.ENABLED:  # this mode's points only
                    trace.drain()
                    call("trace")
                call("zero")
                before = call("metrics")["messages_pulled"]
                with kvtransfer.create_sender(backend, src, **opts) as sender:
                    by_mode[mode] = [one_transfer(sender, address, f"{mode}-{i}", shape, src_ids, dst_ids,
                                                  lambda *a: call("expect", *a), lambda *a: call("wait", *a))
                                     for i in range(repeat + 1)]  # the first connects and warms up
                if call("digest", dst_ids) != want:
                    raise RuntimeError(f"{mode}: the received KV blocks differ from the sent ones")
                out[f"{mode}_pulled"] = call("metrics")["messages_pulled"] - before
                if trace.ENABLED:
                    out[f"{mode}_trace"] = timeline(trace.drain() + call("trace"))
            call("stop")
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        return by_mode

    layer = shape.layer_bytes(blocks * BLOCK_SIZE)
    if nixl_only:  # the NIXL rows alone (a short GPU call): the UCX and reference rows are nan
        out.update(dict.fromkeys(("copy", "fake", "staged", "kvx", "kvx_recv", "seconds", "kvx_landed_s", "raw_same",
                                  "raw_one"), float("nan")))
        out["nccl_same"] = out["nccl_one"] = None
    else:
        ucx_rows(out, backend_runs, shape, blocks, nbytes, device, receiver_device, repeat)
    if nixl:
        # pdserve's NIXL backend first: its sender is this process, which has made no NIXL agent yet
        modes = [(NIXL_MODES[m], {"op": m}) for m in nixl_modes if m != "read" or "READ" in nixl_ops]
        for key in NIXL_MODES.values():
            out[key] = out[f"{key}_seconds"] = out[f"{key}_landed_s"] = float("nan")
        by_op = backend_runs("nixl", modes)
        for mode, nixl_runs in by_op.items():
            nixl_runs = nixl_runs[1:]
            out[mode] = statistics.median(r[0] for r in nixl_runs)
            out[f"{mode}_seconds"] = statistics.median(r[1].seconds for r in nixl_runs)
            out[f"{mode}_landed_s"] = statistics.median(r[3] for r in nixl_runs)
        # raw NIXL: the same bytes as one descriptor per layer (K then V of its blocks), and as one
        for op in ("WRITE", "READ"):
            if op not in nixl_ops:
                out[f"nixl_{op}_same"] = out[f"nixl_{op}_one"] = out[f"nixl_{op}_kv"] = float("nan")
                out[f"nixl_{op}_blocks"] = float("nan")
                continue
            out[f"nixl_{op}_same"] = raw_nixl_gbps([layer] * shape.num_layers, op, device, receiver_device, repeat)
            out[f"nixl_{op}_one"] = raw_nixl_gbps([nbytes], op, device, receiver_device, repeat)
            # the descriptors pdserve's DIRECT WRITE posts here: a layer's K blocks, then its V blocks
            out[f"nixl_{op}_kv"] = raw_nixl_gbps([layer // 2] * (2 * shape.num_layers), op, device, receiver_device,
                                                 repeat)
            # one descriptor per block, as a transfer of these scattered blocks posts them (pdserve's DIRECT here)
            pool_bytes = shape.num_layers * 2 * pool_blocks * (shape.layer_bytes(BLOCK_SIZE) // 2)
            out[f"nixl_{op}_blocks"] = raw_nixl_gbps(
                [], op, device, receiver_device, repeat,
                blocks=(kv_block_offsets(shape, pool_blocks, src_ids), kv_block_offsets(shape, pool_blocks, dst_ids),
                        shape.layer_bytes(BLOCK_SIZE) // 2, pool_bytes))
        if nixl_diag:  # what slows a transfer: a handle per transfer, polling with sleeps, another thread
            for prepped, poll in ((False, "spin"), (True, "sleep"), (False, "sleep")):
                for op in nixl_ops:
                    out[f"nixl_{op}_same_{'prepped' if prepped else 'init'}_{poll}"] = raw_nixl_gbps(
                        [layer] * shape.num_layers, op, device, receiver_device, repeat, prepped, poll)
            for thread in ("bare", "device"):
                for op in nixl_ops:
                    out[f"nixl_{op}_same_thread_{thread}"] = raw_nixl_gbps(
                        [layer] * shape.num_layers, op, device, receiver_device, repeat, False, "spin", thread=thread)
    return out


def print_breakdown(results: list) -> None:
    """The UCX rows' per-transfer phases, their landing time, and (PDSERVE_KV_TRACE=1) the trace."""
    print("\nper-transfer breakdown, ms (median): sender stage / queue / wire / ack; receiver scatter (pulled:"
          "\nthe copy from the sender's pools) / land")
    for tokens, r in results:
        for mode, phases in (("kvx", r["phases"]), ("staged", r["staged_phases"])):
            p = {k: v * 1e3 for k, v in phases.items()}
            extra = (f"  (receiver first byte to landed: {r['kvx_recv']:.2f} GB/s; "
                     f"messages pulled: {r['kvx_pulled']:.0f})"
                     if mode == "kvx" else f"  (messages pulled: {r['staged_pulled']:.0f})")
            print(f"{tokens:>7} {mode:>6}: stage {p['stage']:.2f} queue {p['queue']:.2f} wire {p['wire']:.2f} "
                  f"ack {p['ack']:.2f} | scatter {p['scatter']:.2f} land {p['land']:.2f}{extra}")
        print(f"{tokens:>7}    kvx: first send_layer to landed at the receiver {r['kvx_landed_s'] * 1e3:.2f} ms "
              f"({r['bytes'] / r['kvx_landed_s'] / 1e9:.1f} GB/s), to the sender's ACK {r['seconds'] * 1e3:.2f} ms")
    if trace.ENABLED:
        print("\ntrace (PDSERVE_KV_TRACE=1): median ms after the transfer's first point; s. sender, r. receiver;"
              "\n#2: the transfer's second message")
        for tokens, r in results:
            for mode in ("kvx", "staged"):
                cells = " ".join(f"{name} {t * 1e3:.3f}" for name, t in r.get(f"{mode}_trace", []))
                print(f"{tokens:>7} {mode:>6}: {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--receiver-device", default=None,
                        help="device of the receiver process (default: the sender's, e.g. cuda:0); "
                             "cuda:1 for GPU to GPU")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-nixl", action="store_true", help="leave out the NIXL rows")
    parser.add_argument("--nixl-ops", default="WRITE,READ",
                        help="NIXL operations to time, comma-separated (WRITE, READ): raw, and pdserve's NIXL "
                             "backend by that operation; the others print nan")
    parser.add_argument("--nixl-modes", default=",".join(NIXL_MODES),
                        help="pdserve's NIXL backend modes to time, comma-separated: direct (WRITE into the "
                             "reserved blocks, the default), write (into staging), read")
    parser.add_argument("--nixl-only", action="store_true",
                        help="only the NIXL rows: raw NIXL and pdserve's NIXL backend (a short GPU call)")
    parser.add_argument("--nixl-diag", action="store_true",
                        help="also raw NIXL with a handle per transfer and with 1 ms polling (what slows READ)")
    args = parser.parse_args()
    if args.nixl_only and args.no_nixl:
        parser.error("--nixl-only and --no-nixl exclude each other")
    if args.repeat < 1 or any(t < 1 for t in args.tokens):
        parser.error("--repeat and --tokens must be positive")
    nixl_ops = tuple(op.strip().upper() for op in args.nixl_ops.split(",") if op.strip())
    if not nixl_ops or any(op not in ("WRITE", "READ") for op in nixl_ops):
        parser.error(f"--nixl-ops: WRITE and/or READ, comma-separated, got {args.nixl_ops!r}")
    nixl_modes = tuple(m.strip().lower() for m in args.nixl_modes.split(",") if m.strip())
    if any(m not in NIXL_MODES for m in nixl_modes):
        parser.error(f"--nixl-modes: direct, write and/or read, comma-separated, got {args.nixl_modes!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kvtransfer: --device cuda requested but CUDA is not available "
              f"(torch {torch.__version__}, cuda build: {torch.version.cuda}); nothing measured.", file=sys.stderr)
        return 2
    # NVLink SHARP/multicast stays off (it is not lent on the shared GPU hosts); a user's setting wins
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    device = "cuda:0" if args.device == "cuda" else "cpu"
    receiver_device = args.receiver_device or device
    try:
        torch.device(receiver_device)
    except RuntimeError:
        parser.error(f"--receiver-device: not a device: {receiver_device!r}")
    if receiver_device.startswith("cuda") != device.startswith("cuda"):
        parser.error("--receiver-device must be on the same kind of device as --device")
    if receiver_device.startswith("cuda") and torch.device(receiver_device).index is not None \
            and torch.device(receiver_device).index >= torch.cuda.device_count():
        parser.error(f"--receiver-device {receiver_device}: only {torch.cuda.device_count()} GPU(s) here")

    from pdserve.kvtransfer.ucx_runtime import UcxRuntime, ucx_library_path

    shape = SHAPES[args.device]
    hardware = (torch.cuda.get_device_name(0) if args.device == "cuda"
                else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    runtime = UcxRuntime.acquire()
    transports = sorted(runtime.ucxx.get_active_transports())
    print(f"KV transfer, {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} kv heads, d{shape.head_dim}, "
          f"{shape.dtype}), block {BLOCK_SIZE}, sender on {device}, receiver on {receiver_device} ({hardware})")
    print(f"UCX {'.'.join(map(str, runtime.ucxx.get_ucx_version()))} from {ucx_library_path()}; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; transports: {', '.join(transports)}")
    UcxRuntime.release()
    missing = "left out (--no-nixl)" if args.no_nixl else nixl_missing()
    if missing is None:
        from pdserve.kvtransfer.nixl import load_nixl

        api = load_nixl()
        version = "?"
        try:
            from importlib.metadata import version as dist_version

            version = dist_version(api.__name__.split(".")[0].replace("_", "-"))
        except Exception:
            pass
        print(f"NIXL {version} ({api.__name__.split('.')[0]}), UCX plugin")
    else:
        print(f"NIXL: rows left out: {missing}")
    print(f"median of {args.repeat} transfers after one warm-up; GB/s = 1e9 bytes/s\n")
    header = (f"{'tokens':>7} {'KV MB':>8} {'copy':>8} {'fake':>8} {'raw one':>8} {'raw same':>9} {'nccl one':>9} "
              f"{'nccl same':>10} {'staged':>8} {'kvx':>8} {'kvx/raw same':>13} {'kvx/nccl same':>14} {'kvx ms':>8}")
    print(header + "   (GB/s)")
    print("-" * len(header))
    results = []
    for tokens in args.tokens:
        r = bench_tokens(shape, tokens, device, receiver_device, args.repeat, nixl=missing is None,
                         nixl_diag=args.nixl_diag, nixl_ops=nixl_ops, nixl_only=args.nixl_only,
                         nixl_modes=nixl_modes)
        results.append((tokens, r))
        def na(value, width, digits=2):
            return f"{value:>{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"

        print(f"{tokens:>7} {r['bytes'] / 1e6:>8.1f} {r['copy']:>8.1f} {r['fake']:>8.2f} {r['raw_one']:>8.2f} "
              f"{r['raw_same']:>9.2f} {na(r['nccl_one'], 9)} {na(r['nccl_same'], 10)} "
              f"{r['staged']:>8.2f} {r['kvx']:>8.2f} "
              f"{r['kvx'] / r['raw_same']:>13.2f} "
              f"{na(r['kvx'] / r['nccl_same'] if r['nccl_same'] else None, 14)} {r['seconds'] * 1e3:>8.2f}",
              flush=True)
    if not args.nixl_only:
        print_breakdown(results)
    if missing is None:
        print(f"\nNIXL, same run (GB/s; same: {shape.num_layers} descriptors, one per layer; "
              f"kv: {2 * shape.num_layers}, "
              f"a layer's K and its V; blocks: one per block, K and V, of the scattered blocks moved here,\nthe "
              f"descriptors pdserve's DIRECT WRITE posts for them)")
        head = (f"{'tokens':>7} {'nixl W same':>12} {'nixl W kv':>10} {'nixl W blocks':>14} {'nixl W one':>11} "
                f"{'nixl R same':>12} {'raw same':>9} {'direct':>8} {'direct landed':>14} {'staged W':>9} {'read':>7} "
                f"{'kvx landed':>11} {'direct landed/W blocks':>23} {'/W same':>8} {'staged W/W same':>16} "
                f"{'kvx landed/W same':>18}")
        print(head)
        print("-" * len(head))
        for tokens, r in results:
            landed = r["bytes"] / r["kvx_landed_s"] / 1e9
            direct_landed = r["bytes"] / r["kvx_nixl_direct_landed_s"] / 1e9
            print(f"{tokens:>7} {r['nixl_WRITE_same']:>12.2f} {r['nixl_WRITE_kv']:>10.2f} "
                  f"{r['nixl_WRITE_blocks']:>14.2f} "
                  f"{r['nixl_WRITE_one']:>11.2f} {r['nixl_READ_same']:>12.2f} {r['raw_same']:>9.2f} "
                  f"{r['kvx_nixl_direct']:>8.2f} {direct_landed:>14.2f} {r['kvx_nixl']:>9.2f} "
                  f"{r['kvx_nixl_read']:>7.2f} "
                  f"{landed:>11.2f} {direct_landed / r['nixl_WRITE_blocks']:>23.2f} "
                  f"{direct_landed / r['nixl_WRITE_same']:>8.2f} {r['kvx_nixl'] / r['nixl_WRITE_same']:>16.2f} "
                  f"{landed / r['nixl_WRITE_same']:>18.2f}")
        for tokens, r in results:
            print(f"{tokens:>7} ms: direct to landed {r['kvx_nixl_direct_landed_s'] * 1e3:.3f}, to the sender's ACK "
                  f"{r['kvx_nixl_direct_seconds'] * 1e3:.3f}; staged WRITE to ACK {r['kvx_nixl_seconds'] * 1e3:.2f}")
        if trace.ENABLED:
            for tokens, r in results:
                cells = " ".join(f"{name} {t * 1e3:.3f}" for name, t in r.get("kvx_nixl_direct_trace", []))
                print(f"{tokens:>7} direct trace: {cells}")
        print("direct / staged W / read: pdserve's NIXL backend (--kv-backend nixl) to the sender's ACK: "
              "WRITE straight "
              "into the\nreserved blocks, WRITE into the receiver's staging (the default), READ of the sender's pools; "
              "landed: first send_layer\nto the receiver's landing (what a decode worker waits for); kvx landed: the "
              "UCX backend's pull, the same")
        if args.nixl_diag:
            print("\nraw NIXL variants, one descriptor per layer (GB/s): handle prepared once or made per transfer"
                  "\n(initialize_xfer); state polled back to back (spin) or with 1 ms sleeps; posted from a new thread"
                  "\n(init spin), bare or after torch.cuda.set_device there")
            for tokens, r in results:
                cells = [f"{op[0]} {how} {poll}: "
                         f"{r[f'nixl_{op}_same' if (how, poll) == ('prepped', 'spin') else f'nixl_{op}_same_{how}_{poll}']:.2f}"  # noqa: E501
                         for how, poll in (("prepped", "spin"), ("init", "spin"), ("prepped", "sleep"),
                                           ("init", "sleep"))
                         for op in nixl_ops]
                cells += [f"{op[0]} thread {how}: {r[f'nixl_{op}_same_thread_{how}']:.2f}"
                          for how in ("bare", "device") for op in nixl_ops]
                print(f"{tokens:>7}  " + "; ".join(cells))
    print("received blocks equal the sent ones, byte for byte, in every mode (checked)")
    print("\nkvx: first send_layer to ACK (sender), pulled by the receiver where it maps the sender's pools;"
          "\nstaged: the same, pull=False (gather, payload over UCX, scatter); "
          "raw same: raw ucxx, one message per layer, all posted at once;"
          "\nraw one: raw ucxx, one message; nccl: NCCL send/recv (torch.distributed), one message per layer / one"
          "\nmessage (n/a: both ends on one GPU); copy: device copy of the same bytes (bytes read, once).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
