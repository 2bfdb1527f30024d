"""Measure the KV transfer rate between two processes (e.g. in two emulated nodes).

Both sides use the kvtransfer API with SmolLM2-135M-shaped caches (30 layers, 3 KV heads,
head_dim 64, float32, blocks of 16 tokens: 46,080 bytes of KV per token)::

    python -m pdserve.launcher.emulation.kvprobe recv --host 10.200.0.2 --mb 100 --transfers 3
        prints {"address": "ucx://10.200.0.2:PORT"}, then one JSON line per transfer
        landed, as the receiver saw it
    python -m pdserve.launcher.emulation.kvprobe send --address ucx://10.200.0.2:PORT --mb 100 --transfers 3
        [--pacing "default=1"]
        one warm-up transfer (connects; not reported), then ``--transfers`` transfers of
        every layer of ``--mb`` MB, one after another; one JSON line each: bytes, seconds
        (first send_layer to the receiver's ACK), gbps

The receiver expects all transfers up front (into the same blocks; they arrive one after
another), so the sender never races it. Both sides exit after the last transfer.

``--plan JSON`` (both sides, instead of ``--mb``): a list of ``[mb, pacing or null]`` entries
measured one after another by this one pair of processes (what benchmarks/bench_pacing.py runs:
starting two processes costs seconds, more than a slow rate's transfers). Per entry the sender
opens a sender with that pacing, sends a one-block transfer (it connects) and a warm-up of at
least ``WARMUP_BYTES`` (it drains the bucket's burst, so that the measured transfers \
start on an empty bucket and read the
rate, not the rate plus a burst), then ``--transfers`` transfers of ``mb`` MB; every JSON line
carries its entry's index ``entry``, the sender's also ``link_gbps`` (the link-bound rate:
TransferResult.link_bytes over phase "link"; null when nothing was link-bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4
WARMUP_ID = "warmup"
WARMUP_BYTES = 2 << 20  # a plan entry's warm-up: more than the default 1 MiB burst


def num_blocks_for(mb: float) -> int:
    return max(1, round(mb * 1e6 / (BYTES_PER_TOKEN * BLOCK_SIZE)))


def make_caches(num_blocks: int, device: str = "cpu", fill: bool = False):
    import torch

    dims = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    make = (lambda: torch.randn(dims, device=device)) if fill else (lambda: torch.zeros(dims, device=device))
    return [(make(), make()) for _ in range(NUM_LAYERS)]


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def run_receiver(host: str, mb: float, transfers: int, device: str, timeout_s: float) -> int:
    from pdserve import kvtransfer

    blocks = num_blocks_for(mb)
    with kvtransfer.create_receiver("ucx", make_caches(blocks, device), host=host) as receiver:
        ids = [WARMUP_ID] + [f"t{i}" for i in range(transfers)]
        receiver.expect(WARMUP_ID, [0], NUM_LAYERS, timeout_s)
        for tid in ids[1:]:
            receiver.expect(tid, list(range(blocks)), NUM_LAYERS, timeout_s)
        _emit({"address": receiver.address(), "bytes_per_transfer": blocks * BLOCK_SIZE * BYTES_PER_TOKEN})
        for tid in ids:
            result = receiver.wait(tid, timeout_s)
            if tid != WARMUP_ID:
                _emit({"side": "recv", "id": tid, "bytes": result.num_bytes, "seconds": result.seconds,
                       "gbps": result.gbps})
        time.sleep(0.2)  # let the last ACK leave before the endpoint closes
    return 0


def _sender_options(pacing: str | None, max_inflight: int) -> dict:
    opts: dict = {"max_inflight": max_inflight}
    if pacing:
        from pdserve.kvtransfer.pacing_spec import build_pacer

        opts["pacer"] = build_pacer(pacing)
    return opts


def _transfer(sender, address, tid: str, blocks: list[int], timeout_s: float):
    """Every layer of `blocks` to the same blocks at `address`; (TransferResult, wall seconds)."""
    start = time.perf_counter()
    for layer in range(NUM_LAYERS):
        sender.send_layer(address, tid, layer, blocks, blocks)
    result = sender.finish(tid, timeout_s)
    return result, time.perf_counter() - start


def run_sender(address: str, mb: float, transfers: int, device: str, pacing: str | None, timeout_s: float,
               max_inflight: int = 4) -> int:
    from pdserve import kvtransfer

    blocks = num_blocks_for(mb)
    ids = list(range(blocks))
    with kvtransfer.create_sender("ucx", make_caches(blocks, device, fill=True),
                                  **_sender_options(pacing, max_inflight)) as sender:
        _transfer(sender, address, WARMUP_ID, [0], timeout_s)
        for i in range(transfers):
            tid = f"t{i}"
            result, wall = _transfer(sender, address, tid, ids, timeout_s)
            _emit({"side": "send", "id": tid, "bytes": result.num_bytes, "seconds": wall,
                   "gbps": result.num_bytes * 8 / wall / 1e9})
        if pacing:
            _emit({"pacing_delay_seconds": sender.metrics().get("pacing_delay_seconds", 0.0)})
    return 0


def parse_plan(text: str) -> list[tuple[float, str | None]]:
    """``[[mb, pacing or null], ...]`` -> [(mb, pacing)]; ValueError names what is wrong."""
    try:
        plan = json.loads(text)
        out = [(float(mb), None if pacing is None else str(pacing)) for mb, pacing in plan]
    except (ValueError, TypeError) as e:
        raise ValueError(f"--plan must be a JSON list of [mb, pacing or null], got {text!r}: {e}") from None
    if not out or any(not mb > 0 for mb, _ in out):
        raise ValueError(f"--plan needs at least one entry, each with mb > 0: {text!r}")
    return out


def _warmup_blocks(blocks: int) -> int:
    return min(blocks, -(-WARMUP_BYTES // (BYTES_PER_TOKEN * BLOCK_SIZE)))


def run_plan_receiver(host: str, plan: list, transfers: int, device: str, timeout_s: float) -> int:
    from pdserve import kvtransfer

    sizes = [num_blocks_for(mb) for mb, _ in plan]
    with kvtransfer.create_receiver("ucx", make_caches(max(sizes), device), host=host) as receiver:
        order = []
        for i, blocks in enumerate(sizes):
            receiver.expect(f"w{i}c", [0], NUM_LAYERS, timeout_s)
            receiver.expect(f"w{i}", list(range(_warmup_blocks(blocks))), NUM_LAYERS, timeout_s)
            order += [(i, f"w{i}c"), (i, f"w{i}")]
            for j in range(transfers):
                receiver.expect(f"e{i}t{j}", list(range(blocks)), NUM_LAYERS, timeout_s)
                order.append((i, f"e{i}t{j}"))
        _emit({"address": receiver.address(), "bytes_per_transfer": [b * BLOCK_SIZE * BYTES_PER_TOKEN for b in sizes]})
        for i, tid in order:
            result = receiver.wait(tid, timeout_s)
            if not tid.startswith("w"):
                _emit({"side": "recv", "entry": i, "id": tid, "bytes": result.num_bytes, "seconds": result.seconds,
                       "gbps": result.gbps})
        time.sleep(0.2)  # let the last ACK leave before the endpoint closes
    return 0


def run_plan_sender(address: str, plan: list, transfers: int, device: str, timeout_s: float,
                    max_inflight: int = 4) -> int:
    from pdserve import kvtransfer

    sizes = [num_blocks_for(mb) for mb, _ in plan]
    caches = make_caches(max(sizes), device, fill=True)
    for i, ((_, pacing), blocks) in enumerate(zip(plan, sizes)):
        ids, warm = list(range(blocks)), list(range(_warmup_blocks(blocks)))
        with kvtransfer.create_sender("ucx", caches, **_sender_options(pacing, max_inflight)) as sender:
            # connect first: layers queued while connecting count as ready all along, and the
            # bucket would bank the connect time (up to a burst) instead of being drained
            for tid, blocks_ in ((f"w{i}c", [0]), (f"w{i}", warm)):
                _transfer(sender, address, tid, blocks_, timeout_s)
            for j in range(transfers):
                tid = f"e{i}t{j}"
                result, wall = _transfer(sender, address, tid, ids, timeout_s)
                link_s = result.phases.get("link", 0.0)
                _emit({"side": "send", "entry": i, "id": tid, "bytes": result.num_bytes, "seconds": wall,
                       "gbps": result.num_bytes * 8 / wall / 1e9,
                       "link_gbps": result.link_bytes * 8 / link_s / 1e9 if link_s > 0 else None})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launcher.emulation.kvprobe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="side", required=True)
    for name in ("recv", "send"):
        p = sub.add_parser(name)
        p.add_argument("--mb", type=float, default=100.0, help="MB of KV per transfer (default 100)")
        p.add_argument("--plan", default=None, help="JSON [[mb, pacing or null], ...]: several measurements "
                       "in these two processes (see the module doc); replaces --mb and --pacing")
        p.add_argument("--transfers", type=int, default=3)
        p.add_argument("--device", default="cpu")
        p.add_argument("--timeout-s", type=float, default=120.0)
        if name == "recv":
            p.add_argument("--host", required=True, help="address to advertise (this namespace's)")
        else:
            p.add_argument("--address", required=True, help="the receiver's ucx://host:port")
            p.add_argument("--pacing", default=None, help="pacer spec (kvtransfer.pacing_spec)")
            p.add_argument("--max-inflight", type=int, default=4, help="UCX sender messages in flight")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.transfers < 1:
        parser.error("--mb must be > 0 and --transfers >= 1")
    if args.plan is not None:
        try:
            plan = parse_plan(args.plan)
        except ValueError as e:
            parser.error(str(e))
        if args.side == "recv":
            return run_plan_receiver(args.host, plan, args.transfers, args.device, args.timeout_s)
        return run_plan_sender(args.address, plan, args.transfers, args.device, args.timeout_s, args.max_inflight)
    if args.side == "recv":
        return run_receiver(args.host, args.mb, args.transfers, args.device, args.timeout_s)
    return run_sender(args.address, args.mb, args.transfers, args.device, args.pacing, args.timeout_s,
                      args.max_inflight)


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------------------
# driver (runs in the parent: starts both sides, collects their JSON lines)


def probe_command(side: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.launcher.emulation.kvprobe", side, *args]


def _lines(proc):
    """Yield JSON objects from ``proc``'s stdout (non-JSON lines are logged by the caller)."""
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            yield json.loads(line)


def _probe(spawn, recv_host: str, common: list[str], send_extra: list[str], expected: int,
           timeout_s: float) -> tuple[dict, list[dict], list[dict]]:
    """Start the receiver, then the sender at its address; (the receiver's first line, the
    sender's and the receiver's transfer lines). RuntimeError with the output when a side
    fails or reports other than `expected` transfers; both processes are gone on return."""
    recv = spawn("recv", probe_command("recv", "--host", recv_host, *common))
    send = None
    try:
        recv_lines = _lines(recv)
        first = next(recv_lines, None)
        if first is None or "address" not in first:
            raise RuntimeError(f"KV probe receiver did not start: {_drain(recv)}")
        send = spawn("send", probe_command("send", "--address", first["address"], *common, *send_extra))
        sent = [obj for obj in _lines(send) if obj.get("side") == "send"]
        landed = [obj for obj in recv_lines if obj.get("side") == "recv"]
        for proc, name, got in ((send, "sender", sent), (recv, "receiver", landed)):
            if proc.wait(timeout_s) != 0 or len(got) != expected:
                raise RuntimeError(f"KV probe {name} failed (exit {proc.returncode}): {_drain(proc)}")
        return first, sent, landed
    finally:
        for proc in (send, recv):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def measure(spawn, recv_host: str, mb: float, transfers: int = 3, pacing: str | None = None,
            device: str = "cpu", timeout_s: float = 120.0, max_inflight: int = 4) -> dict:
    """Run one probe: ``spawn(side, argv)`` starts a process for ``side`` ("recv", "send")
    with stdout piped as text (e.g. ``lambda side, argv: cluster.run_in(node, argv, ...)``).
    Returns {"send_gbps": [...], "recv_gbps": [...], "bytes": n}; raises RuntimeError with
    the processes' output when a side fails."""
    common = ["--mb", str(mb), "--transfers", str(transfers), "--device", device, "--timeout-s", str(timeout_s)]
    extra = ["--max-inflight", str(max_inflight)] + (["--pacing", pacing] if pacing else [])
    first, sent, landed = _probe(spawn, recv_host, common, extra, transfers, timeout_s)
    return {"bytes": first["bytes_per_transfer"], "send_gbps": [s["gbps"] for s in sent],
            "recv_gbps": [r["gbps"] for r in landed]}


def measure_plan(spawn, recv_host: str, plan: list[tuple[float, str | None]], transfers: int = 3,
                 device: str = "cpu", timeout_s: float = 120.0, max_inflight: int = 4) -> list[dict]:
    """``measure`` for every ``(mb, pacing or None)`` of ``plan`` in one pair of processes (see the
    module doc); one result per entry, as ``measure`` returns it, plus ``link_gbps`` (sender's
    link-bound rate per transfer, None where nothing was link-bound)."""
    common = ["--plan", json.dumps([[mb, pacing] for mb, pacing in plan]), "--transfers", str(transfers),
              "--device", device, "--timeout-s", str(timeout_s)]
    first, sent, landed = _probe(spawn, recv_host, common, ["--max-inflight", str(max_inflight)],
                                 transfers * len(plan), timeout_s)
    return [{"bytes": first["bytes_per_transfer"][i],
             "send_gbps": [s["gbps"] for s in sent if s["entry"] == i],
             "link_gbps": [s["link_gbps"] for s in sent if s["entry"] == i],
             "recv_gbps": [r["gbps"] for r in landed if r["entry"] == i]} for i in range(len(plan))]


def _drain(proc) -> str:
    err = proc.stderr.read() if proc.stderr else ""
    return (err or "").strip()[-2000:]


# ---------------------------------------------------------------------------------------
# reporting (benchmarks/bench_links.py, benchmarks/bench_pacing.py)


def transfer_mb(gbps: float | None, seconds: float, low: float = 50.0, high: float = 1000.0) -> float:
    """MB per transfer so that one takes about ``seconds`` at ``gbps`` (clamped)."""
    if gbps is None:
        return high
    return min(high, max(low, gbps * 1e9 / 8 * seconds / 1e6))


def summarize(set_gbps: float | None, method: str, result: dict, ceiling: float | None = None) -> dict:
    """One table row: median achieved rate (sender side: first send_layer to ACK)."""
    import statistics

    achieved = statistics.median(result["send_gbps"])
    link = [g for g in result.get("link_gbps", []) if g is not None]
    row = {"set_gbps": set_gbps, "method": method, "achieved_gbps": achieved,
           "recv_gbps": statistics.median(result["recv_gbps"]), "mb": result["bytes"] / 1e6,
           "ratio": achieved / set_gbps if set_gbps else None, "note": "",
           "link_gbps": statistics.median(link) if link else None}
    if set_gbps is not None and ceiling is not None and set_gbps > 0.9 * ceiling:
        row["note"] = f"above this host's ceiling ({ceiling:.2f} Gbit/s): not held"
    return row


def format_table(rows: list[dict]) -> str:
    """The rows as text; a ``link Gbit/s`` column (the sender's link-bound rate) when any row has one."""
    link = any(r.get("link_gbps") is not None for r in rows)
    header = f"{'set Gbit/s':>10}  {'method':<18} {'achieved Gbit/s':>15} {'ratio':>6}  {'recv Gbit/s':>11} " + (
        f"{'link Gbit/s':>11} {'link ratio':>10} " if link else "") + f"{'MB':>7}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        set_text = "unshaped" if r["set_gbps"] is None else f"{r['set_gbps']:g}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        extra = ""
        if link:
            g = r.get("link_gbps")
            link_ratio = "-" if g is None or not r["set_gbps"] else f"{g / r['set_gbps']:.3f}"
            extra = f"{'-' if g is None else f'{g:.4g}':>11} {link_ratio:>10} "
        lines.append(f"{set_text:>10}  {r['method']:<18} {r['achieved_gbps']:>15.4g} {ratio:>6}  "
                     f"{r['recv_gbps']:>11.4g} {extra}{r['mb']:>7.1f}  {r['note']}")
    return "\n".join(lines)
