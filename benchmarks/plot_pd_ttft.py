"""Plots a `bench_pd_ttft.py --json` result: TTFT p50 against link rate, PD vs colocated.

    python -m benchmarks.plot_pd_ttft RESULT.json OUT.png
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(sys.argv[1]) as f:
        data = json.load(f)
    rows = data["rows"]
    pd = [r for r in rows if r["mode"] == "disaggregated"]
    colo = next(r for r in rows if r["mode"] == "colocated")
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([r["gbps"] for r in pd], [r["ttft_p50"] * 1e3 for r in pd], "o-", label="PD (1P+1D), KV paced")
    ax.axhline(colo["ttft_p50"] * 1e3, color="gray", linestyle="--", label="colocated")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV link rate set (Gbit/s)")
    ax.set_ylabel("TTFT p50 (ms)")
    args = data["args"]
    ax.set_title(f"{args['model']}, {args['prompt_len']}-token prompts", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
