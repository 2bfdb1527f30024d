"""Emulated KV links: the rate a KV transfer over UCX actually achieves across a link
held at 1-100 Gbit/s, by tc shaping (HTB over veth, between two network namespaces) and
by pacing (the sender's token bucket, same namespaces, link unshaped).

Sender in namespace A, receiver in namespace B (``pdserve.launcher.emulation.kvprobe``, kvtransfer
API, SmolLM2-135M-shaped caches, UCX over TCP on the veth). First the unshaped ceiling of
this host, then each set rate; a set rate above ~90% of the ceiling is reported as not
held (the row shows what the host carried instead). Achieved = KV bytes / (first
send_layer .. receiver's ACK), median of ``--transfers`` after a warm-up. Needs root.

    sudo python -m benchmarks.bench_links [--rates 1 5 10 25 100] [--methods tc pacing]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

METHODS = {"tc": "tc-htb over veth", "pacing": "pacing"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 5, 10, 25, 100])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=["tc", "pacing"])
    parser.add_argument("--transfers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="target duration of one transfer")
    args = parser.parse_args()
    if args.transfers < 1 or args.seconds <= 0 or any(r <= 0 for r in args.rates):
        parser.error("--transfers, --seconds and --rates must be positive")

    from pdserve.launcher.emulation import EmulatedCluster, LinkSpec, netns_permitted
    from pdserve.launcher.emulation.kvprobe import format_table, measure, summarize, transfer_mb
    from pdserve.launcher.emulation.netns import UCX_ENV

    if not netns_permitted():
        print("bench_links: cannot create network namespaces (needs root and iproute2); nothing measured.",
              file=sys.stderr)
        return 2

    def run(link: LinkSpec, mb: float, pacing: str | None = None) -> dict:
        with EmulatedCluster(["a", "b"], {("a", "b"): link}) as cluster:
            def spawn(side, argv):
                return cluster.run_in("b" if side == "recv" else "a", argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
            return measure(spawn, cluster.ip("b"), mb, args.transfers, pacing=pacing)

    print(f"KV transfer across emulated links, SmolLM2-135M-shaped KV (fp32), namespace A -> B on "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, kernel {platform.release()}; "
          f"{' '.join(f'{k}={v}' for k, v in UCX_ENV.items())}; median of {args.transfers} transfers")
    ceiling_row = summarize(None, "none (veth ceiling)", run(LinkSpec(), transfer_mb(None, 0, high=600)))
    ceiling = ceiling_row["achieved_gbps"]
    print(f"  unshaped ceiling: {ceiling:.2f} Gbit/s", file=sys.stderr, flush=True)
    rows = [ceiling_row]
    for rate in args.rates:
        mb = transfer_mb(min(rate, ceiling), args.seconds, high=1000)
        for method in args.methods:
            if method == "tc":
                result = run(LinkSpec(rate), mb)
            else:
                result = run(LinkSpec(), mb, pacing=f"default={rate:g}")
            rows.append(summarize(rate, METHODS[method], result, ceiling))
            print(f"  {rate:g} Gbit/s {method}: {rows[-1]['achieved_gbps']:.3f}", file=sys.stderr, flush=True)
    print()
    print(format_table(rows))
    print("\nachieved: sender side, first send_layer to ACK (conservative); recv: receiver side, first layer "
          "landed to last (reads high by ~1/30); ratio = achieved / set.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
