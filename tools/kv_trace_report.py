"""Where a served transfer's time goes: the KV trace points that served workers dumped.

    PDSERVE_KV_TRACE=1 PDSERVE_KV_TRACE_DIR=DIR pdserve up ...     # or any launcher of workers
    python -m tools.kv_trace_report DIR                      # one line per transfer
    python -m tools.kv_trace_report DIR --transfer 3         # that transfer, message by message

Every worker's ``DIR/kv-trace-<pid>.jsonl`` is read and the points are grouped by transfer key
(senders and receivers of one host share ``time.monotonic``). Times are milliseconds from the
transfer's first ``s.flush`` (its first layer handed to the sender). Per transfer: the last
message's ``s.ready`` (its layers computed and gathered), ``s.post`` (handed to the link),
``s.sent``, ``r.copied`` (in the receiver's pools) and ``s.ack``; ``tail`` is ``s.ack`` after the
last ``s.ready`` (what the transfer adds once the compute is done); ``land`` the slowest
message's ``r.control`` -> ``r.copied``. A stall shows as a run of messages whose ``s.ready``
or ``s.sent`` jump together.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

SUMMARY = ("s.ready", "s.post", "s.sent", "r.copied", "s.ack")
PER_MESSAGE = ("s.flush", "s.ready", "s.post", "s.sent", "r.control", "r.lander", "r.copied")


def load(directory: str) -> dict[int, list[tuple[float, str, int]]]:
    """{transfer key: [(t, point, layer)], by time} from every dump in ``directory``."""
    paths = sorted(glob.glob(os.path.join(directory, "kv-trace-*.jsonl")))
    if not paths:
        raise SystemExit(f"{directory}: no kv-trace-*.jsonl (set PDSERVE_KV_TRACE=1 and PDSERVE_KV_TRACE_DIR)")
    points: dict[int, list] = collections.defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    point, key, layer, t = json.loads(line)
                except (ValueError, TypeError) as e:
                    raise SystemExit(f"{path}:{n}: not a trace point ({e})") from None
                points[key].append((float(t), str(point), int(layer)))
    for v in points.values():
        v.sort()
    return points


def transfers(points: dict[int, list]) -> list[dict]:
    """One row per transfer that completed (has ``s.flush`` and ``s.ack``), oldest first."""
    rows = []
    for key, pts in points.items():
        by: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        for t, point, layer in pts:
            by[point].append((t, layer))
        if not by["s.flush"] or not by["s.ack"]:
            continue
        t0 = by["s.flush"][0][0]
        row = {"key": key, "t0": t0, "messages": len(by["s.flush"])}
        if not by["s.ready"]:  # CPU pools: the gather is done when the message is flushed
            by["s.ready"] = by["s.flush"]
        for point in SUMMARY:
            row[point] = (by[point][-1][0] - t0) * 1e3 if by[point] else float("nan")
        row["tail"] = row["s.ack"] - row["s.ready"]
        control, copied = by["r.control"], by["r.copied"]
        row["land"] = max(((b[0] - a[0]) * 1e3 for a, b in zip(control, copied)), default=float("nan"))
        row["by"] = by
        rows.append(row)
    rows.sort(key=lambda r: r["t0"])
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    head = f"{'#':>3} {'msgs':>4} " + " ".join(f"{p:>8}" for p in SUMMARY) + f" {'tail':>7} {'land':>7}"
    out = [head + "   (ms from the first s.flush)"]
    for i, r in enumerate(rows):
        out.append(f"{i:3d} {r['messages']:4d} " + " ".join(f"{r[p]:8.1f}" for p in SUMMARY)
                   + f" {r['tail']:7.1f} {r['land']:7.1f}")
    return out


def message_lines(row: dict) -> list[str]:
    """The transfer's messages in send order, each point's n-th mark on the n-th line."""
    by, t0 = row["by"], row["t0"]
    out = [f"{'layer':>5} " + " ".join(f"{p:>9}" for p in PER_MESSAGE)]
    for i in range(max(len(by[p]) for p in PER_MESSAGE)):
        layer = by["s.flush"][i][1] if i < len(by["s.flush"]) else ""
        cells = [f"{(by[p][i][0] - t0) * 1e3:9.1f}" if i < len(by[p]) else " " * 9 for p in PER_MESSAGE]
        out.append(f"{layer:>5} " + " ".join(cells))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="PDSERVE_KV_TRACE_DIR of the run")
    ap.add_argument("--transfer", type=int, default=None, help="print this transfer (its # above) message by message")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.directory):
        ap.error(f"directory: {args.directory} is not a directory")
    rows = transfers(load(args.directory))
    if not rows:
        print("no completed transfer in the trace", file=sys.stderr)
        return 1
    if args.transfer is not None:
        if not 0 <= args.transfer < len(rows):
            ap.error(f"--transfer: {args.transfer} is not one of the {len(rows)} transfers (0-{len(rows) - 1})")
        print("\n".join(message_lines(rows[args.transfer])))
        return 0
    print("\n".join(summary_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
