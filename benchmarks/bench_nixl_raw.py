"""Raw NIXL between two processes: WRITE and READ, and the variants that could slow a transfer.

Needs only torch and NIXL (no ucxx), so it runs where just the NIXL wheel is carried
(tools/pack_nixl.sh). The same bytes as bench_kvtransfer.py's shapes: one descriptor per
layer (``same``) or one for the whole KV (``one``); WRITE posted by the sender, READ by the
receiver, both processes on ``--device``. Variants: descriptor lists prepared once and one
handle re-posted (``prepped``) or a handle made per transfer (``init``, ``initialize_xfer``);
the state polled back to back (``spin``) or with 1 ms sleeps (``sleep``); with and without
NIXL's UCX progress thread in the initiator (``--no-progress-thread``: its state checks progress
UCX; the thread busy-polls, which on a host of few cores halves throughput; the passive side
keeps its thread, without which UCX's wire-up never completes). Every run checks the
landed bytes. ``UCX_PROTO_INFO=y`` in the environment makes UCX print the protocol it picked
for each operation (e.g. a GET over cuda_ipc, or staged through host memory).

    python -m benchmarks.bench_nixl_raw [--device cuda|cpu] [--tokens 2048 8192] [--repeat 5] [--variants] \
        [--no-progress-thread]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.bench_kvtransfer import BLOCK_SIZE, SHAPES, nixl_missing, raw_nixl_gbps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--variants", action="store_true", help="also init/spin, prepped/sleep and init/sleep")
    parser.add_argument("--no-progress-thread", action="store_true",
                        help="the initiator's NIXL agent without its UCX progress thread")
    args = parser.parse_args()
    missing = nixl_missing()
    if missing is not None:
        print(f"bench_nixl_raw: {missing}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_nixl_raw: --device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    device = "cuda:0" if args.device == "cuda" else "cpu"
    shape = SHAPES[args.device]
    variants = [(True, "spin")] + ([(False, "spin"), (True, "sleep"), (False, "sleep")] if args.variants else [])
    print(f"raw NIXL, {shape.name} KV ({shape.num_layers} layers), both processes on {device}, initiator's progress "
          f"thread {'off' if args.no_progress_thread else 'on'}; median of "
          f"{args.repeat} after one warm-up; GB/s = 1e9 bytes/s")
    for tokens in args.tokens:
        tokens = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE
        layer, total = shape.layer_bytes(tokens), shape.kv_bytes(tokens)
        for prepped, poll in variants:
            cells = []
            for op in ("WRITE", "READ"):
                for name, sizes in (("same", [layer] * shape.num_layers), ("one", [total])):
                    start = time.time()
                    try:
                        gbps = raw_nixl_gbps(sizes, op, device, device, args.repeat, prepped, poll,
                                             not args.no_progress_thread)
                        value = f"{gbps:.2f}"
                    except Exception as e:  # a failed variant is reported, the others still run
                        value = f"failed ({type(e).__name__}: {e})"
                    cells.append(f"{op[0]} {name} {value}")
                    print(f"  {tokens} tokens, {op} {name}, {'prepped' if prepped else 'init'} {poll}: {value} "
                          f"({time.time() - start:.0f}s)", file=sys.stderr, flush=True)
            print(f"{tokens:>6} tok {total / 1e6:>8.1f} MB {'prepped' if prepped else 'init':>7} {poll:>5}: "
                  + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
