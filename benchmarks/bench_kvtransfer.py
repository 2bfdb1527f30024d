"""Benchmark KV transfer between two processes over UCX.

For the KV of one prompt (all layers, K and V, non-contiguous blocks of 16 tokens) the
sender process pushes every layer to a receiver process and waits for its
acknowledgement. Reported: achieved GB/s end to end (first ``send_layer`` to ACK, as
the sender sees it, and first byte to last landing as the receiver sees it), and the
ratio to a plain torch copy of the same number of bytes on the same device, measured in
the same run. The in-process fake backend (gather + copy + scatter, no network) is shown
for reference.

Shapes: ``--device cpu``: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32);
``--device cuda``: Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16), both
processes on GPU 0 (UCX then uses CUDA IPC where it can).

    python benchmarks/bench_kvtransfer.py [--device cpu|cuda] [--tokens 1024 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def kv_bytes(self, tokens: int) -> int:
        return self.num_layers * 2 * tokens * self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize


SHAPES = {
    "cpu": Shape("SmolLM2-135M", 30, 3, 64, "float32"),
    "cuda": Shape("Llama-3.1-8B", 32, 8, 128, "bfloat16"),
}


def make_caches(shape: Shape, num_blocks: int, device: str, fill: bool):
    dims = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    dtype = getattr(torch, shape.dtype)
    make = (lambda: torch.randn(dims, device=device).to(dtype)) if fill else (lambda: torch.zeros(dims, dtype=dtype, device=device))
    return [(make(), make()) for _ in range(shape.num_layers)]


def _receiver_main(conn, shape: Shape, num_blocks: int, device: str) -> None:
    """Child process: a UCX receiver driven over a Pipe."""
    import kvtransfer

    receiver = kvtransfer.create_receiver("ucx", make_caches(shape, num_blocks, device, fill=False))
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


def copy_gbps(nbytes: int, device: str, repeat: int) -> float:
    """GB/s of ``dst.copy_(src)`` of ``nbytes`` bytes on ``device`` (best of ``repeat``)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(max(repeat, 3)):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / min(times) / 1e9


def one_transfer(sender, address: str, transfer_id: str, shape: Shape, src_ids, dst_ids, expect, wait):
    expect(transfer_id, dst_ids, shape.num_layers, 120.0)
    start = time.perf_counter()
    for layer in range(shape.num_layers):
        sender.send_layer(address, transfer_id, layer, src_ids, dst_ids)
    sent = sender.finish(transfer_id, timeout=120)
    seconds = time.perf_counter() - start
    landed = wait(transfer_id, 120.0)
    return sent.num_bytes / seconds / 1e9, landed.num_bytes / landed.seconds / 1e9


def bench_tokens(shape: Shape, tokens: int, device: str, repeat: int) -> dict[str, float]:
    import kvtransfer

    blocks = -(-tokens // BLOCK_SIZE)
    pool_blocks = 2 * blocks  # every other block: the ids are not contiguous
    gen = torch.Generator().manual_seed(tokens)
    src_ids = torch.randperm(pool_blocks, generator=gen)[:blocks].tolist()
    dst_ids = torch.randperm(pool_blocks, generator=gen)[:blocks].tolist()
    nbytes = shape.kv_bytes(blocks * BLOCK_SIZE)
    src = make_caches(shape, pool_blocks, device, fill=True)
    out = {"bytes": float(nbytes), "copy": copy_gbps(nbytes, device, repeat)}

    # in-process reference: same gather / scatter, no network
    dst = make_caches(shape, pool_blocks, device, fill=False)
    with kvtransfer.create_receiver("fake", dst) as receiver, kvtransfer.create_sender("fake", src) as sender:
        runs = [one_transfer(sender, receiver.address(), f"fake-{i}", shape, src_ids, dst_ids, receiver.expect,
                             receiver.wait)[0] for i in range(repeat + 1)]
        out["fake"] = statistics.median(runs[1:])
    del dst

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, args=(child_conn, shape, pool_blocks, device), daemon=True)
    child.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("receiver process did not start")
        address = conn.recv()

        def call(cmd, *args):
            conn.send((cmd, args))
            return conn.recv()

        with kvtransfer.create_sender("ucx", src) as sender:
            runs = [one_transfer(sender, address, f"ucx-{i}", shape, src_ids, dst_ids,
                                 lambda *a: call("expect", *a), lambda *a: call("wait", *a))
                    for i in range(repeat + 1)]  # the first connects and warms up
        call("stop")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    out["ucx_send"] = statistics.median(r[0] for r in runs[1:])
    out["ucx_recv"] = statistics.median(r[1] for r in runs[1:])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.repeat < 1 or any(t < 1 for t in args.tokens):
        parser.error("--repeat and --tokens must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kvtransfer: --device cuda requested but CUDA is not available "
              f"(torch {torch.__version__}, cuda build: {torch.version.cuda}); nothing measured.", file=sys.stderr)
        return 2

    from kvtransfer.ucx_runtime import UcxRuntime, ucx_library_path

    shape = SHAPES[args.device]
    hardware = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    runtime = UcxRuntime.acquire()
    transports = sorted(runtime.ucxx.get_active_transports())
    print(f"KV transfer, {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} kv heads, d{shape.head_dim}, "
          f"{shape.dtype}), block {BLOCK_SIZE}, on {args.device} ({hardware})")
    print(f"UCX {'.'.join(map(str, runtime.ucxx.get_ucx_version()))} from {ucx_library_path()}; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; transports: {', '.join(transports)}")
    UcxRuntime.release()
    print(f"median of {args.repeat} transfers after one warm-up; GB/s = 1e9 bytes/s\n")
    header = f"{'tokens':>7} {'KV MB':>8} {'copy GB/s':>10} {'fake GB/s':>10} {'UCX send GB/s':>14} {'UCX recv GB/s':>14} {'UCX/copy':>9}"
    print(header)
    print("-" * len(header))
    for tokens in args.tokens:
        r = bench_tokens(shape, tokens, args.device, args.repeat)
        print(f"{tokens:>7} {r['bytes'] / 1e6:>8.1f} {r['copy']:>10.2f} {r['fake']:>10.2f} {r['ucx_send']:>14.2f} "
              f"{r['ucx_recv']:>14.2f} {r['ucx_send'] / r['copy']:>9.2f}", flush=True)
    print("\nUCX send: first send_layer to ACK (sender); UCX recv: first byte to last block landed (receiver);"
          "\nUCX/copy: UCX send over a plain torch copy of the same bytes on the same device.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
