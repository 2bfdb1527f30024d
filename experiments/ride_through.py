"""Ride through a worker restart: a real `pdserve up` (1 prefill + 1 decode worker), a steady
load from the load generator, and `kill -9` of one worker's process while it runs; Ray
restarts the worker, the router waits for it or runs the requests on the survivor.

    python -m experiments.ride_through --kill decode --out docs/results/ride_through_decode.json

Reports requests sent, completed and failed, the gap (kill until the worker is healthy again
at its new address) and the TTFT of the requests caught in it (in flight at the kill or sent
during the gap) next to the others'. Takes about 2-3 minutes on the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from experiments.faultlib import HealthTimeline, up_process, worker_pid
from pdserve.loadgen.launcher import free_port


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kill", choices=("decode", "prefill"), required=True, help="which worker gets kill -9")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (constant arrivals)")
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--kill-at", type=float, default=12.0, help="seconds into the load")
    p.add_argument("--input-len", default="fixed:128")
    p.add_argument("--output-len", default="fixed:32")
    p.add_argument("--worker-wait-s", type=float, default=60.0)
    p.add_argument("--kv-cache-gib", default="0.25")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out", required=True, help="JSON result file (records next to it, .records.jsonl)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.loadgen.datasets import DatasetConfig, LengthDist
    from pdserve.loadgen.client import ClientConfig
    from pdserve.loadgen.runner import LoadConfig, run_load

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = out.with_suffix(".up.log")
    up = up_process(["--model", args.model, "--port", str(port), "--kv-cache-gib", args.kv_cache_gib,
                     "--worker-wait-s", str(args.worker_wait_s), "--startup-timeout-s",
                     str(args.startup_timeout_s)], base, log, num_workers=2)
    up.start()
    timeline = HealthTimeline(base)
    try:
        t_start = time.monotonic()
        up.wait_healthy(args.startup_timeout_s + 30)
        print(f"cluster healthy after {time.monotonic() - t_start:.0f}s", file=sys.stderr)
        timeline.start()
        cfg = LoadConfig(
            client=ClientConfig(base_url=base, endpoint="completions", ignore_eos=True, temperature=0.0,
                                request_timeout_s=300),
            rate=args.rate, arrival="constant", num_requests=args.num_requests, seed=0,
            dataset=DatasetConfig(kind="synthetic", input=LengthDist.parse(args.input_len),
                                  output=LengthDist.parse(args.output_len)),
            max_run_time_s=args.num_requests / args.rate + 300,
        )
        warm = run_load(dataclasses.replace(cfg, num_requests=2, rate=1.0, scrape_metrics=False), progress=False)
        print(f"warm-up: {sum(r.ok for r in warm.records)}/2 ok", file=sys.stderr)

        killed: dict = {}

        def kill() -> None:
            wid, pid = worker_pid(base, args.kill)
            workers = timeline.samples[-1][1] if timeline.samples else {}
            killed.update(worker=wid, pid=pid, address=workers.get(wid, (None, None))[1], time=time.time())
            os.kill(pid, signal.SIGKILL)
            print(f"kill -9 {pid} ({wid})", file=sys.stderr)

        load_started = time.time()
        timer = threading.Timer(args.kill_at, kill)
        timer.start()
        result = run_load(cfg, progress=False)
        timer.cancel()
        # wait (bounded) for the worker to be back, to close the gap
        deadline = time.monotonic() + 120
        while killed and timeline.back_at(killed["worker"], killed["time"], killed["address"]) is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        timeline.stop()
    finally:
        shutdown_s = up.stop()

    t0 = result.summary["start_time_unix"] or load_started
    back = timeline.back_at(killed["worker"], killed["time"], killed["address"]) if killed else None
    kill_rel = killed["time"] - t0 if killed else None
    back_rel = back - t0 if back else None
    caught, others = [], []
    for r in result.records:
        if r.sent_s is None:
            continue
        end = r.sent_s + (r.e2e_s or 0.0)
        in_gap = kill_rel is not None and end >= kill_rel and (back_rel is None or r.sent_s <= back_rel)
        (caught if in_gap else others).append(r)
    failed = [r for r in result.records if not r.ok]

    def ttfts(records):
        return [round(r.ttft_s, 3) for r in records if r.ok and r.ttft_s is not None]

    def stats(values):
        if not values:
            return None
        return {"n": len(values), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}

    report = {
        "what": f"kill -9 of the {args.kill} worker of a 1P+1D `pdserve up` under load",
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), CPU only",
        "command": "python -m experiments.ride_through " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "rate": args.rate, "input_len": args.input_len, "output_len": args.output_len,
        "killed": {k: v for k, v in killed.items() if k != "time"},
        "kill_at_s": round(kill_rel, 2) if kill_rel is not None else None,
        "worker_back_at_s": round(back_rel, 2) if back_rel is not None else None,
        "gap_s": round(back_rel - kill_rel, 2) if back_rel is not None and kill_rel is not None else None,
        "sent": len(result.records), "completed": sum(r.ok for r in result.records), "failed": len(failed),
        "failures": [{"index": r.index, "status": r.status, "error": r.error} for r in failed],
        "ttft_caught_in_gap_s": ttfts(caught),
        "ttft_caught_in_gap": stats(ttfts(caught)),
        "ttft_others": stats(ttfts(others)),
        "shutdown_s": round(shutdown_s, 2),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    with open(out.with_suffix(".records.jsonl"), "w") as f:
        for r in result.records:
            f.write(json.dumps({"index": r.index, "sent_s": r.sent_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                                "status": r.status, "error": r.error,
                                "completion_tokens": r.completion_tokens}) + "\n")
    print(json.dumps({k: report[k] for k in ("sent", "completed", "failed", "gap_s", "ttft_caught_in_gap",
                                             "ttft_others")}, indent=2))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
