"""Soak under faults (not in CI): SmolLM2 1P+1D on emulated nodes, steady load for a long
time, a `kill -9` of a worker every `--kill-every-s` (alternating decode and prefill; the
script restarts it, as a supervisor would), and for `--link-fault-for-s` loss and delay on the
KV link (tc netem on the emulated link). Needs root (network namespaces).

    sudo python -m experiments.soak --out docs/results/soak            # 30 min, rate from a search
    sudo python -m experiments.soak --out /tmp/soak --duration-s 300 --rate 0.3 --kill-every-s 120

1. Start the cluster (`experiments/soak-1p1d.yaml`: workers in namespaces, router in front).
2. Unless `--rate` is given: `pdserve-loadgen search` for the highest rate whose requests meet
   the SLO (`--slo-ttft`, `--slo-tpot`) at `--target`; the soak runs at `--load-fraction` of it.
3. Run the load (Poisson arrivals) for `--duration-s`; every `--sample-s` record RSS, threads
   and open files of the router and of each worker process, and the goodput of the window.
4. At the end: wait until nothing is in flight, read each worker's KV usage from the router's
   /metrics (0 = every block free), and write summary.json, samples.csv, records.jsonl and
   soak.png (RSS and goodput over time, faults marked) into `--out`.

Figures: requests sent, completed, failed with a clear error (HTTP status and OpenAI body),
lost or hung (no answer within the timeout); RSS growth after `--warmup-s` for the router and
for each worker process that lived past its own warm-up; thread and fd counts first vs last.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from pdserve.loadgen.launcher import free_port

SPEC = Path(__file__).resolve().parent / "soak-1p1d.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--spec", default=str(SPEC), help="emulated cluster (one prefill, one decode worker)")
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--warmup-s", type=float, default=120.0, help="RSS baselines are taken after this")
    p.add_argument("--rate", type=float, default=None, help="req/s (default: --load-fraction of a search)")
    p.add_argument("--load-fraction", type=float, default=0.8)
    p.add_argument("--slo-ttft", type=float, default=3.0)
    p.add_argument("--slo-tpot", type=float, default=0.3)
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment the search asks for")
    p.add_argument("--search-lo", type=float, default=0.2)
    p.add_argument("--search-hi", type=float, default=2.0)
    p.add_argument("--search-probes", type=int, default=4)
    p.add_argument("--search-duration-s", type=float, default=60.0,
                   help="each probe sends for this long (a probe of a few requests never saturates the batch)")
    p.add_argument("--input-len", default="uniform:64:256")
    p.add_argument("--output-len", default="uniform:16:64")
    p.add_argument("--kill-every-s", type=float, default=600.0, help="0: no kills")
    p.add_argument("--link-fault-at-s", type=float, default=None, help="default: a quarter into the run")
    p.add_argument("--link-fault-for-s", type=float, default=300.0)
    p.add_argument("--loss-pct", type=float, default=1.0)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--no-link-fault", action="store_true",
                   help="skip the loss/delay phase (a kernel without tc netem cannot do it)")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--goodput-window-s", type=float, default=60.0, help="goodput is averaged over this")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--label", default="", help="free text stored in the summary")
    return p.parse_args(argv)


# ---------------------------------------------------------------- processes


def proc_stats(pid: int | None) -> dict | None:
    if pid is None:
        return None
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"pid": pid, "rss_mib": p.memory_info().rss / 2**20, "threads": p.num_threads(),
                    "fds": p.num_fds()}
    except psutil.Error:
        return None


def kv_usage(base: str) -> dict[str, float]:
    """worker -> pdserve:kv_cache_usage_ratio from the router's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'^pdserve:kv_cache_usage_ratio\{([^}]*)\} (\S+)$', text, re.M):
        worker = re.search(r'worker="([^"]*)"', m.group(1))
        out[worker.group(1) if worker else m.group(1)] = float(m.group(2))
    return out


def inflight(base: str) -> int:
    h = httpx.get(f"{base}/health", timeout=10).json()
    return sum(w.get("inflight", 0) for w in h.get("backend", {}).get("workers", {}).values())


# ---------------------------------------------------------------- the run


def search_rate(args, base: str, out: Path) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "pdserve.loadgen.cli", "search", "--url", base, "--endpoint", "completions",
           "--ignore-eos", "--arrival", "poisson", "--input-len", args.input_len, "--output-len", args.output_len,
           "--duration", str(args.search_duration_s), "--slo-ttft", str(args.slo_ttft), "--slo-tpot",
           str(args.slo_tpot), "--target", str(args.target), "--lo", str(args.search_lo), "--hi",
           str(args.search_hi), "--max-probes", str(args.search_probes), "--no-progress",
           "--output", str(out / "search")]
    print("search:", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    text = done.stdout + done.stderr
    (out / "search.txt").write_text(text)
    match = re.search(r"max rate meeting the SLO .*: ([0-9.]+) req/s", text)
    if not match:
        raise SystemExit(f"soak: the search found no rate meeting the SLO:\n{text[-2000:]}")
    return float(match.group(1)), " ".join(cmd[2:])


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.loadgen.client import ClientConfig
    from pdserve.loadgen.datasets import DatasetConfig, LengthDist
    from pdserve.loadgen.metrics import SLO
    from pdserve.loadgen.runner import LoadConfig, run_load
    from pdserve.launcher.emulation.cluster import EmulatedDeployment
    from pdserve.launcher.emulation.shaping import NO_NETEM, impair_link, netem_available, restore_link
    from pdserve.launcher.emulation.spec import load_topology

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = load_topology(args.spec)
    roles = {w.role: w.id for w in spec.workers}
    if set(roles) != {"prefill", "decode"} or len(spec.workers) != 2:
        raise SystemExit("soak: --spec must have exactly one prefill and one decode worker")
    link_nodes = tuple(w.node for w in spec.workers)
    link_fault = not args.no_link_fault
    if link_fault and not netem_available():
        raise SystemExit(f"soak: {NO_NETEM}; run with --no-link-fault to soak without the loss/delay phase")
    fault_at = args.link_fault_at_s if args.link_fault_at_s is not None else args.duration_s / 4

    events: list[dict] = []
    samples: list[dict] = []
    records = []
    t_start = time.time()
    with EmulatedDeployment(spec, out / "logs", port=free_port()) as dep:
        base = dep.url
        search_cmd = None
        rate = args.rate
        if rate is None:
            best, search_cmd = search_rate(args, base, out)
            rate = round(best * args.load_fraction, 4)
            events.append({"t": time.time() - t_start, "event": f"search: {best} req/s, soak at {rate}"})
        print(f"soak: {rate} req/s for {args.duration_s:.0f}s", file=sys.stderr, flush=True)
        cfg = LoadConfig(
            client=ClientConfig(base_url=base, endpoint="completions", ignore_eos=True, temperature=0.0,
                                request_timeout_s=args.request_timeout_s),
            rate=rate, arrival="poisson", duration_s=args.duration_s, seed=1,
            dataset=DatasetConfig(kind="synthetic", input=LengthDist.parse(args.input_len),
                                  output=LengthDist.parse(args.output_len)),
            slo=SLO(args.slo_ttft, args.slo_tpot), max_run_time_s=args.duration_s + args.request_timeout_s + 60,
        )
        result_box: dict = {}
        lock = threading.Lock()

        def on_record(r) -> None:
            with lock:
                records.append((time.time(), r))

        def load() -> None:
            result_box["result"] = run_load(cfg, on_record=on_record, progress=False)

        loader = threading.Thread(target=load, name="soak-load", daemon=True)
        load_t0 = time.time()
        loader.start()
        next_kill = args.kill_every_s if args.kill_every_s > 0 else float("inf")
        victims = ["decode", "prefill"]
        restarts: list[threading.Thread] = []
        fault_on = False
        last_sample = -1e9
        while loader.is_alive():
            now = time.time() - load_t0
            if now >= next_kill and now < args.duration_s:
                role = victims[len(restarts) % 2]
                wid = roles[role]
                pid = dep.kill_worker(wid)
                events.append({"t": now, "event": f"kill -9 {wid} ({role}, pid {pid})"})
                print(f"[{now:7.1f}s] kill -9 {wid} (pid {pid})", file=sys.stderr, flush=True)

                def restart(wid=wid) -> None:
                    dep.restart_worker(wid)
                    events.append({"t": time.time() - load_t0, "event": f"{wid} restarted"})

                t = threading.Thread(target=restart, daemon=True)
                t.start()
                restarts.append(t)
                next_kill += args.kill_every_s
            if link_fault and not fault_on and fault_at <= now < fault_at + args.link_fault_for_s:
                impair_link(dep.cluster, *link_nodes, loss_pct=args.loss_pct, delay_ms=args.delay_ms)
                fault_on = True
                events.append({"t": now, "event": f"link {args.loss_pct:g}% loss, +{args.delay_ms:g} ms"})
            if fault_on and now >= fault_at + args.link_fault_for_s:
                restore_link(dep.cluster, *link_nodes)
                fault_on = False
                events.append({"t": now, "event": "link restored"})
            if now - last_sample >= args.sample_s:
                last_sample = now
                samples.append(_sample(now, dep, records, lock, load_t0, args.goodput_window_s, cfg.slo))
            time.sleep(0.5)
        loader.join()
        if fault_on:
            restore_link(dep.cluster, *link_nodes)
        for t in restarts:
            t.join(300)
        deadline = time.monotonic() + 60
        while inflight(base) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(2)  # one more stats poll of the router
        kv_end = kv_usage(base)
        samples.append(_sample(time.time() - load_t0, dep, records, lock, load_t0, args.goodput_window_s,
                               cfg.slo))
        failed_processes = dep.failed()

    result = result_box["result"]
    summary = _summarize(args, rate, search_cmd, result, samples, events, kv_end, failed_processes, t_start)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_samples(out / "samples.csv", samples)
    with open(out / "records.jsonl", "w") as f:
        for r in result.records:
            f.write(json.dumps({"index": r.index, "sent_s": r.sent_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                                "status": r.status, "error": r.error,
                                "completion_tokens": r.completion_tokens}) + "\n")
    _plot(out / "soak.png", samples, events, summary)
    _write_readme(out / "README.md", summary)
    print(json.dumps({k: summary[k] for k in ("requests", "rss_growth_after_warmup", "kv_usage_at_end")},
                     indent=2))
    return 0


def _sample(now: float, dep, records, lock, load_t0: float, window_s: float, slo) -> dict:
    from pdserve.loadgen.metrics import tpot

    row: dict = {"t": round(now, 1)}
    procs = {"router": dep.router.pid if dep.router else None}
    procs.update({wid: proc.pid for wid, (proc, _) in dep.workers.items()})
    for name, pid in procs.items():
        st = proc_stats(pid)
        for key in ("pid", "rss_mib", "threads", "fds"):
            row[f"{name}_{key}"] = None if st is None else (round(st[key], 1) if key == "rss_mib" else st[key])
    window_s = min(window_s, max(now, 1.0))
    with lock:
        recent = [r for t, r in records if t - load_t0 > now - window_s]
    ok = [r for r in recent if r.ok]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo.ttft_s
            and (tpot(r) is None or tpot(r) <= slo.tpot_s)]
    row.update(done=len(recent), ok=len(ok), failed=len(recent) - len(ok),
               goodput_rps=round(len(good) / window_s, 3), window_s=round(window_s, 1),
               tokens_per_s=round(sum(r.completion_tokens or 0 for r in ok) / window_s, 1))
    return row


def _growth(samples: list[dict], name: str, warmup_s: float, events: list[dict]) -> list[dict]:
    """Per process incarnation (pid) of `name`: RSS, threads and fds after warm-up vs last seen.
    A restarted worker's warm-up counts from when it listened again (its "restarted" event)."""
    ready = sorted(e["t"] for e in events if e["event"] == f"{name} restarted")
    by_pid: dict[int, list[dict]] = {}
    for row in samples:
        pid = row.get(f"{name}_pid")
        if pid is not None and row.get(f"{name}_rss_mib") is not None:
            by_pid.setdefault(pid, []).append(row)
    out = []
    for pid, rows in by_pid.items():
        born = rows[0]["t"]
        later = [t for t in ready if rows[0]["t"] - 1.0 <= t <= rows[-1]["t"]]
        if later:
            born = later[0]
        after = [r for r in rows if r["t"] >= born + warmup_s]
        if len(after) < 2:
            out.append({"pid": pid, "from_s": born, "to_s": rows[-1]["t"], "note": "did not live past its warm-up"})
            continue
        first, last = after[0], after[-1]
        out.append({
            "pid": pid, "from_s": first["t"], "to_s": last["t"],
            "rss_mib": [first[f"{name}_rss_mib"], last[f"{name}_rss_mib"]],
            "rss_growth_pct": round(100 * (last[f"{name}_rss_mib"] / first[f"{name}_rss_mib"] - 1), 2),
            "threads": [first[f"{name}_threads"], last[f"{name}_threads"]],
            "fds": [first[f"{name}_fds"], last[f"{name}_fds"]],
        })
    return out


def _summarize(args, rate, search_cmd, result, samples, events, kv_end, failed_processes, t_start) -> dict:
    records = result.records
    lost = [r for r in records if not r.ok and r.status is None]
    failed_clear = [r for r in records if not r.ok and r.status is not None]
    names = ["router"] + sorted({k[:-4] for row in samples for k in row if k.endswith("_pid") and k != "router_pid"})
    return {
        "what": "soak under faults: SmolLM2 1P+1D on emulated nodes, Poisson load, kill -9 of a worker "
                "every --kill-every-s (restarted by the script), loss/delay on the KV link",
        "label": args.label,
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, shared), CPU only",
        "command": "sudo python -m experiments.soak " + " ".join(sys.argv[1:]),
        "search": search_cmd,
        "rate_rps": rate,
        "sample_s": args.sample_s,
        "goodput_window_s": args.goodput_window_s,
        "duration_s": round(result.summary.get("duration_s") or 0, 1),
        "wall_s": round(time.time() - t_start, 1),
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "link_fault": None if args.no_link_fault else {"loss_pct": args.loss_pct, "delay_ms": args.delay_ms,
                                                        "for_s": args.link_fault_for_s},
        "events": [{"t": round(e["t"], 1), "event": e["event"]} for e in events],
        "requests": {
            "sent": len(records), "completed": sum(r.ok for r in records),
            "failed_with_clear_error": len(failed_clear), "lost_or_hung": len(lost),
            "errors": sorted({f"{r.status}: {(r.error or '')[:160]}" for r in records if not r.ok}),
        },
        "loadgen_summary": {k: result.summary.get(k) for k in ("goodput", "slo_attainment", "request_throughput",
                                                              "ttft_p50", "ttft_p99", "tpot_p50",
                                                              "output_token_throughput")},
        "rss_growth_after_warmup": {name: _growth(samples, name, args.warmup_s, events) for name in names},
        "kv_usage_at_end": kv_end,
        "processes_failed": failed_processes,
    }


def _write_readme(path: Path, s: dict) -> None:
    req = s["requests"]
    lines = [
        "# Soak under faults", "",
        f"{s['label']}" if s["label"] else "",
        f"Command: `{s['command']}`; machine: {s['machine']}.",
        f"Load: Poisson at {s['rate_rps']} req/s for {s['duration_s'] / 60:.1f} min of load "
        f"({s['wall_s'] / 60:.1f} min wall with start-up and search); SLO TTFT {s['slo']['ttft_s']} s, "
        f"TPOT {s['slo']['tpot_s']} s." + (f" Rate search: `{s['search']}` (see search.txt)." if s["search"] else ""),
        "Link fault: " + ("none (--no-link-fault)" if s["link_fault"] is None else
                          f"{s['link_fault']['loss_pct']}% loss, +{s['link_fault']['delay_ms']} ms for "
                          f"{s['link_fault']['for_s']:.0f} s"), "",
        "Events (seconds into the load): " + "; ".join(f"{e['t']:.0f} {e['event']}" for e in s["events"]), "",
        "| requests | count |", "|---|---|",
        f"| sent | {req['sent']} |", f"| completed | {req['completed']} |",
        f"| failed with a clear error | {req['failed_with_clear_error']} |",
        f"| lost or hung | {req['lost_or_hung']} |", "",
        "| process (pid) | window after warm-up (s) | RSS MiB first -> last | growth | threads | fds |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in s["rss_growth_after_warmup"].items():
        for r in rows:
            if "note" in r:
                lines.append(f"| {name} ({r['pid']}) | {r['from_s']:.0f}-{r['to_s']:.0f} | {r['note']} | | | |")
            else:
                lines.append(f"| {name} ({r['pid']}) | {r['from_s']:.0f}-{r['to_s']:.0f} | "
                             f"{r['rss_mib'][0]:.0f} -> {r['rss_mib'][1]:.0f} | {r['rss_growth_pct']:+.2f}% | "
                             f"{r['threads'][0]} -> {r['threads'][1]} | {r['fds'][0]} -> {r['fds'][1]} |")
    lines += ["", "KV cache usage at the end (0 = every block free): "
              + ", ".join(f"{k} {v:g}" for k, v in s["kv_usage_at_end"].items()), "",
              f"Loadgen summary: {json.dumps(s['loadgen_summary'])}", "",
              "Files: summary.json, samples.csv (every sample), records.jsonl (every request), soak.png; the "
              "process logs stay with the run (logs/, not committed).", ""]
    path.write_text("\n".join(lines))


def _write_samples(path: Path, samples: list[dict]) -> None:
    keys: list[str] = []
    for row in samples:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(samples)


def _plot(path: Path, samples: list[dict], events: list[dict], summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    t = [r["t"] / 60 for r in samples]
    for name in ["router"] + sorted({k[:-8] for r in samples for k in r if k.endswith("_rss_mib")} - {"router"}):
        ax1.plot(t, [r.get(f"{name}_rss_mib") for r in samples], label=name)
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.plot(t, [r["goodput_rps"] for r in samples], label="goodput (req/s in SLO)")
    ax2.plot(t, [r["ok"] / r["window_s"] for r in samples], label="completed (req/s)", alpha=0.6)
    ax2.axhline(summary["rate_rps"], color="grey", lw=0.8, ls=":", label="offered rate")
    ax2.set_ylabel(f"req/s (last {summary['goodput_window_s']:g} s)")
    ax2.set_xlabel("minutes into the load")
    ax2.legend(loc="upper left", fontsize=8)
    for e in events:
        if e["event"].startswith(("kill", "link")):
            for ax in (ax1, ax2):
                ax.axvline(e["t"] / 60, color="red" if e["event"].startswith("kill") else "orange", lw=0.8, ls="--")
    req = summary["requests"]
    fig.suptitle(f"soak: {summary['rate_rps']} req/s, {summary['duration_s'] / 60:.1f} min; sent {req['sent']}, "
                 f"completed {req['completed']}, failed {req['failed_with_clear_error']}, lost {req['lost_or_hung']}"
                 f"\n(red: kill -9 of a worker; orange: KV link fault on/off)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
