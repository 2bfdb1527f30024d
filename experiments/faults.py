"""The fault matrix: each fault below against a live cluster (CPU, SmolLM2) under a bounded load,
from fresh processes, and one table row per fault.

    python -m experiments.faults --quick                       # about 8 minutes here: three rows, short
    python -m experiments.faults --out docs/results/faults     # every row, full length
    python -m experiments.faults --only sigstop-decode,kv-loss

One GPU (every worker on GPU 0: standalone workers share it, `pdserve up` gives each Ray worker
--worker-gpus of it), a random-weight shape, and network-aware's profile measured there first:

    pdserve profile --model random:llama-3.2-1b --device cuda --dtype bfloat16 --out prof.json
    python -m experiments.faults --model random:llama-3.2-1b --device cuda --dtype bfloat16 \\
        --worker-gpus 0.25 --gpu-memory-fraction 0.1 --profile prof.json --out faults-gpu --tar faults-gpu.tar.gz

Results: one folder (--out): rows.json (settings, machine, every row), table.md (the table and
notes as docs/faults.md shows them) and per row a folder of its processes' logs, row.json and
records.jsonl (every request); --tar packs it into one file after every row.

Rows (the issue's numbers): 1 `kill-prefill` / `kill-decode` (kill -9 mid-load; Ray restarts
the worker); 2 `restart-same-address` (a decode worker killed and started again on the same gRPC
and KV ports, while the prefill worker holds its old UCX endpoint); 3 `sigstop-decode` (SIGSTOP
for `--stop-s`, then SIGCONT); 4 `slow-link` (two prefill and one decode workers behind the
network-aware policy; prefill-0's link to decode-0 alone drops to 10 Mbit/s mid-run through
prefill-0's pacing file: where requests go before the fault, until the first missed deadline,
and after it); 5 `kv-loss` (messages dropped, duplicated, reordered and
corrupted in the transfer layer, PDSERVE_KV_FAULTS); 6 `mismatched-peers` (a decode worker of
another block size beside a matching pair: never paired; then alone: 503); 7 `router-restart`
(SIGTERM to the router under load, started again); 8 `gcs-kill` (kill -9 of Ray's GCS: bounded
shutdown, no orphan). Rows 1, 3 and 8 run on `pdserve up` (Ray); 2, 4, 5, 6 and 7 on standalone
`pdserve worker` processes behind `pdserve router` (fixed ports, a pacing file, the fault
variable in the workers' environment, workers of different flags, a router of its own).

Columns: requests sent; completed; failed, by what the client saw (HTTP status; `200, stream cut`: a
stream that began and ended in an error; `conn`: connection refused, nothing listening); lost (a
connection that dropped mid-request without an answer); hung (no answer within
`--request-timeout-s`); KV blocks in use at the end on every worker (router /metrics
`pdserve:kv_cache_usage_ratio` after the load drained: 0 is every block free); service back (fault
to the end of the first request sent after the fault that completed); healthy again (fault to
every worker healthy in the router's /health).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from experiments.faultlib import REPO, HealthTimeline, all_healthy, cluster_env, worker_pid
from pdserve.loadgen.launcher import ServerProcess, answers_200, free_port

ROWS = ("kill-prefill", "kill-decode", "restart-same-address", "sigstop-decode", "slow-link", "kv-loss",
        "mismatched-peers", "router-restart", "gcs-kill")
QUICK_ROWS = ("restart-same-address", "kv-loss", "mismatched-peers")
MODEL_NAME = ["smollm2"]  # the served model name (--model), set by main
SLOW_LINK_PROFILE = "experiments/profile-smollm2-cpu-1thread.json"  # network-aware's measured model of this VM
KV_FAULTS = "drop=0.02,duplicate=0.05,reorder=0.05,corrupt=0.05,seed=1"
KV_FAULTS_NIXL = "drop=0.02,corrupt=0.05,seed=1"  # the NIXL backend refuses duplicate and reorder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"rows {','.join(QUICK_ROWS)} (unless --only), 8 requests of 256 tokens, a 10 s SIGSTOP")
    p.add_argument("--only", default="", help=f"comma-separated rows (default all: {','.join(ROWS)})")
    p.add_argument("--model", default="smollm2",
                   help="model spec of every worker and the router (default smollm2, the CPU rows); a random "
                        "shape for a GPU run: random:llama-3.2-1b (random:smollm2-135m, random:llama-3.1-8b, "
                        "random:qwen2.5-7b; pdserve/loaders/random_weights.py)")
    p.add_argument("--device", default="cpu",
                   help="every worker's --device (default cpu); cuda: every worker on this machine's GPU 0 "
                        "(standalone `pdserve worker` rows), or a fraction of it per worker (`pdserve up` rows, "
                        "--worker-gpus)")
    p.add_argument("--dtype", default=None, help="every worker's --dtype (default: the engine's for the device)")
    p.add_argument("--kv-backend", default=None, choices=("ucx", "nixl"),
                   help="every worker's --kv-backend (default: the workers' own, ucx); nixl: kv-loss injects "
                        f"only drop and corrupt ({KV_FAULTS_NIXL}: a NIXL staging slot is written once)")
    p.add_argument("--worker-gpus", type=float, default=None,
                   help="`pdserve up` rows: GPUs per Ray worker (default 0.25 with --device cuda, so that "
                        "the workers share one GPU; not passed on cpu)")
    p.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="every worker's --gpu-memory-fraction (CUDA: its KV cache is this fraction of the GPU "
                        "memory free when it starts; --kv-cache-gib is CPU only); default 0.1 with --device "
                        "cuda, so that the up to four workers sharing GPU 0 all fit, unused on cpu")
    p.add_argument("--profile", default=SLOW_LINK_PROFILE,
                   help="slow-link: network-aware's profile, measured on this hardware for --model "
                        f"(`pdserve profile`; default {SLOW_LINK_PROFILE}, SmolLM2 on this CPU VM)")
    p.add_argument("--slow-link-rate", type=float, default=0.5,
                   help="slow-link's requests/s (default 0.5: a prefill worker mostly idle at each arrival, "
                        "so network-aware disaggregates on healthy links); its fault fires after as many "
                        "requests as the other rows'")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (constant arrivals)")
    p.add_argument("--num-requests", type=int, default=None, help="per row (default 20; --quick 8)")
    p.add_argument("--fault-at", type=float, default=None, help="seconds into the load (default 8; --quick 4)")
    p.add_argument("--stop-s", type=float, default=None, help="SIGSTOP length (default 30; --quick 10)")
    p.add_argument("--input-len", default=None, help="default fixed:512; --quick fixed:256")
    p.add_argument("--output-len", default="fixed:16")
    p.add_argument("--kv-deadline-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--kv-cache-gib", default="0.25")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="",
                   help="one results folder: rows.json, table.md, a folder of logs per row (default: a temp dir)")
    p.add_argument("--tar", default="", metavar="FILE",
                   help="also pack the results folder into FILE (.tar.gz), rewritten after every row (so "
                        "a run cut short still leaves the rows it finished)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no further row once this many seconds have passed (the rows not run are "
                        "listed in rows.json); default: no limit")
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or (8 if args.quick else 20)
    args.input_len = args.input_len or ("fixed:256" if args.quick else "fixed:512")
    args.fault_at = args.fault_at if args.fault_at is not None else (4.0 if args.quick else 8.0)
    args.stop_s = args.stop_s if args.stop_s is not None else (10.0 if args.quick else 30.0)
    if args.device.startswith("cuda"):
        args.worker_gpus = 0.25 if args.worker_gpus is None else args.worker_gpus
        args.gpu_memory_fraction = 0.1 if args.gpu_memory_fraction is None else args.gpu_memory_fraction
    args.rows = [r.strip() for r in args.only.split(",") if r.strip()] or list(QUICK_ROWS if args.quick else ROWS)
    for row in args.rows:
        if row not in ROWS:
            p.error(f"--only: unknown row {row!r}; rows: {', '.join(ROWS)}")
    return args


# ---------------------------------------------------------------- clusters


class Cluster:
    """Processes we started (loadgen's ServerProcess: each in its own session, always stopped), the
    router's base URL, how to stop them."""

    def __init__(self, base: str, logdir: Path):
        self.base = base
        self.logdir = logdir
        self.procs: dict[str, ServerProcess] = {}
        self.argv: dict[str, list[str]] = {}

    def start(self, name: str, argv: list[str], env_extra: dict | None = None,
              num_workers: int | None = None) -> ServerProcess:
        """`argv` as process `name`, its output added to NAME.log (a restart's after the last one's);
        with `num_workers` it is the router: ready once /health has that many healthy workers."""
        proc = ServerProcess(argv, health_url=None if num_workers is None else f"{self.base}/health",
                             ready=answers_200 if num_workers is None else all_healthy(num_workers),
                             log_path=self.logdir / f"{name}.log",
                             env=cluster_env(**(env_extra or {})), cwd=REPO, append_log=True, name=name,
                             poll_interval_s=0.3 if num_workers is None else 0.5)
        proc.start()
        self.procs[name], self.argv[name] = proc, argv
        return proc

    def wait_line(self, name: str, pattern: str, timeout_s: float) -> str:
        return self.procs[name].wait_for_line(pattern, timeout_s)

    def stop(self) -> float:
        """Stops every process group we started; seconds it took (the longest)."""
        took = 0.0
        for proc in self.procs.values():
            took = max(took, proc.stop())
        return took


def up_cluster(args, logdir: Path, env_extra: dict | None = None) -> Cluster:
    port = free_port()
    cluster = Cluster(f"http://127.0.0.1:{port}", logdir)
    argv = [sys.executable, "-m", "pdserve.launcher.cli", "up", "--model", args.model, "--port", str(port),
            "--kv-cache-gib", args.kv_cache_gib, "--kv-deadline-s", str(args.kv_deadline_s),
            "--worker-wait-s", "60", "--startup-timeout-s", str(args.startup_timeout_s),
            *device_flags(args), *(["--worker-gpus", f"{args.worker_gpus:g}"] if args.worker_gpus is not None else [])]
    try:
        cluster.start("up", argv, env_extra, num_workers=2).wait_healthy(args.startup_timeout_s + 30)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def worker_argv(args, role: str, port: int, kv_port: int = 0, extra: tuple[str, ...] = (),
                kv_pacing: str | None = None) -> list[str]:
    from pdserve.launcher.workers import WorkerSpec, worker_argv as spec_argv

    return spec_argv(WorkerSpec(role=role, worker_id=f"{role}-{port}", port=port, kv_port=kv_port, model=args.model,
                                kv_pacing=kv_pacing,
                                engine_args=("--kv-cache-gib", args.kv_cache_gib, *device_flags(args), *extra)))


def device_flags(args) -> list[str]:
    """The device flags every worker gets (`pdserve worker` and `pdserve up` alike)."""
    flags = ["--device", args.device]
    if getattr(args, "kv_backend", None):
        flags += ["--kv-backend", args.kv_backend]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if args.gpu_memory_fraction is not None:
        flags += ["--gpu-memory-fraction", f"{args.gpu_memory_fraction:g}"]
    return flags


def standalone_cluster(args, logdir: Path, workers: list[tuple[str, list[str]]], env_extra: dict | None = None,
                       router_extra: tuple[str, ...] = ()) -> Cluster:
    """`workers`: (name, argv) of each worker; their gRPC ports are read from the argv;
    `router_extra`: more flags for `pdserve router`."""
    port = free_port()
    cluster = Cluster(f"http://127.0.0.1:{port}", logdir)
    entries = []
    try:
        for name, argv in workers:
            cluster.start(name, argv, env_extra)
        for name, argv in workers:
            cluster.wait_line(name, r"listening on \S+", args.startup_timeout_s)
            role = argv[argv.index("--role") + 1]
            entries += ["--worker", f"{role}#{name}=127.0.0.1:{argv[argv.index('--port') + 1]}"]
        router = cluster.start("router", router_argv(args, port, entries) + list(router_extra),
                               num_workers=len(workers))
        router.wait_healthy(120)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def router_argv(args, port: int, entries: list[str]) -> list[str]:
    return [sys.executable, "-m", "pdserve.launcher.cli", "router", *entries, "--model", args.model,
            "--port", str(port), "--kv-deadline-s", str(args.kv_deadline_s), "--worker-wait-s", "60"]


# ---------------------------------------------------------------- load and readings


def run_with_fault(args, base: str, fault, warm: bool = True):
    """Runs the load; `fault()` at --fault-at seconds (its return value kept). Returns
    (records, load start unix time, fault unix time, fault's value)."""
    from pdserve.loadgen.client import ClientConfig
    from pdserve.loadgen.datasets import DatasetConfig, LengthDist
    from pdserve.loadgen.runner import LoadConfig, run_load

    cfg = LoadConfig(
        client=ClientConfig(base_url=base, endpoint="completions", ignore_eos=True, temperature=0.0,
                            request_timeout_s=args.request_timeout_s),
        rate=args.rate, arrival="constant", num_requests=args.num_requests, seed=0,
        dataset=DatasetConfig(kind="synthetic", input=LengthDist.parse(args.input_len),
                              output=LengthDist.parse(args.output_len)),
        max_run_time_s=args.num_requests / args.rate + args.request_timeout_s + 60, scrape_metrics=False,
    )
    if warm:
        run_load(dataclasses.replace(cfg, num_requests=2, rate=2.0), progress=False)
    box: dict = {}

    def fire() -> None:
        box["at"] = time.time()
        try:
            box["value"] = fault()
        except Exception as e:  # reported in the row
            box["value"] = {"fault_error": f"{type(e).__name__}: {e}"}

    timer = threading.Timer(args.fault_at, fire)
    t0 = time.time()
    timer.start()
    result = run_load(cfg, progress=False)
    timer.join()
    start = result.summary.get("start_time_unix") or t0
    if getattr(args, "row_dir", None) is not None:  # every request's record beside the row's logs
        from pdserve.loadgen.records import write_jsonl

        write_jsonl(args.row_dir / "records.jsonl", result.records)
    return result.records, start, box.get("at"), box.get("value")


def classify(records) -> dict:
    failed: Counter = Counter()
    lost = hung = completed = 0
    for r in records:
        if r.ok:
            completed += 1
        elif r.error and r.error.startswith("timeout after"):
            hung += 1
        elif r.status is None and r.error and re.search(r"refused|ConnectError|connect", r.error, re.I):
            failed["conn"] += 1
        elif r.status is None:
            lost += 1
        elif r.status == 200:  # the stream began, then broke off with an error event or a dropped connection
            failed["200, stream cut"] += 1
        else:
            failed[str(r.status)] += 1
    return {"sent": len(records), "completed": completed, "failed": dict(failed), "lost": lost, "hung": hung}


def service_back(records, start: float, fault_at: float | None) -> float | None:
    if fault_at is None:
        return None
    ends = [start + r.sent_s + r.e2e_s for r in records
            if r.ok and r.sent_s is not None and start + r.sent_s >= fault_at]
    return round(min(ends) - fault_at, 1) if ends else None


def kv_in_use(base: str, timeout_s: float = 30.0) -> dict[str, float] | str:
    """worker -> KV usage ratio from the router's /metrics once it reads 0 everywhere (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    usage: dict[str, float] = {}
    while True:
        try:
            text = httpx.get(f"{base}/metrics", timeout=5).text
            usage = {}
            for m in re.finditer(r'^pdserve:kv_cache_usage_ratio\{([^}]*)\} (\S+)$', text, re.M):
                worker = re.search(r'worker="([^"]*)"', m.group(1))
                usage[worker.group(1) if worker else m.group(1)] = round(float(m.group(2)), 4)
        except httpx.HTTPError as e:
            usage = {"error": f"{type(e).__name__}"}
        if (usage and all(v == 0 for v in usage.values())) or time.monotonic() > deadline:
            return usage
        time.sleep(1.0)


def healthy_again(timeline: HealthTimeline, fault_at: float | None) -> float | None:
    """Fault to every worker seen before it healthy again (a restarted one at any address)."""
    if fault_at is None:
        return None
    before = [w for t, w in timeline.samples if t < fault_at]
    expected = set(before[-1]) if before else set()
    down = False
    for t, workers in timeline.samples:
        if t < fault_at:
            continue
        ok = bool(workers) and expected <= set(workers) and all(h for h, _ in workers.values())
        if not ok:
            down = True
        elif down:
            return round(t - fault_at, 1)
    return 0.0 if not down and timeline.samples else None


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# ---------------------------------------------------------------- rows


def row_kill(args, logdir: Path, role: str) -> dict:
    cluster = up_cluster(args, logdir)
    timeline = HealthTimeline(cluster.base)
    timeline.start()
    try:
        def fault():
            wid, pid = worker_pid(cluster.base, role)
            os.kill(pid, signal.SIGKILL)
            return {"killed": wid}

        records, start, at, info = run_with_fault(args, cluster.base, fault)
        time.sleep(2)
        kv = kv_in_use(cluster.base)
    finally:
        timeline.stop()
        cluster.stop()
    return classify(records) | {"kv_in_use": kv, "service_back_s": service_back(records, start, at),
                                "healthy_again_s": healthy_again(timeline, at), "note": info}


def row_sigstop(args, logdir: Path) -> dict:
    cluster = up_cluster(args, logdir)
    timeline = HealthTimeline(cluster.base)
    timeline.start()
    try:
        def fault():
            wid, pid = worker_pid(cluster.base, "decode")
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(args.stop_s, os.kill, (pid, signal.SIGCONT)).start()
            return {"stopped": wid, "for_s": args.stop_s}

        records, start, at, info = run_with_fault(args, cluster.base, fault)
        time.sleep(max(0.0, at + args.stop_s + 2 - time.time()) if at else 0)
        kv = kv_in_use(cluster.base, timeout_s=40)
    finally:
        timeline.stop()
        cluster.stop()
    return classify(records) | {"kv_in_use": kv, "service_back_s": service_back(records, start, at),
                                "healthy_again_s": healthy_again(timeline, at), "note": info}


def row_kv_loss(args, logdir: Path) -> dict:
    workers = [("prefill-0", worker_argv(args, "prefill", free_port())),
               ("decode-0", worker_argv(args, "decode", free_port()))]
    faults = KV_FAULTS_NIXL if getattr(args, "kv_backend", None) == "nixl" else KV_FAULTS
    cluster = standalone_cluster(args, logdir, workers, {"PDSERVE_KV_FAULTS": faults})
    try:
        records, start, at, _ = run_with_fault(args, cluster.base, lambda: None)
        kv = kv_in_use(cluster.base)
        recoveries = recovery_counts(cluster.base)
    finally:
        cluster.stop()
    return classify(records) | {"kv_in_use": kv, "service_back_s": 0.0, "healthy_again_s": None,
                                "note": {"PDSERVE_KV_FAULTS": faults, "router_recoveries": recoveries}}


def recovery_counts(base: str) -> dict[str, float]:
    try:
        text = httpx.get(f"{base}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for m in re.finditer(r'^pdserve:request_recoveries_total\{([^}]*)\} (\S+)$', text, re.M):
        kind = re.search(r'kind="([^"]*)"', m.group(1))
        if float(m.group(2)):
            out[kind.group(1) if kind else m.group(1)] = float(m.group(2))
    return out


def row_gcs_kill(args, logdir: Path) -> dict:
    cluster = up_cluster(args, logdir)
    up = cluster.procs["up"]
    before = {p.pid: p for p in descendants(up.pid)}
    try:
        def fault():
            gcs = [p for p in descendants(up.pid) if "gcs_server" in (p.name() or "")]
            if not gcs:
                raise RuntimeError("no gcs_server below `pdserve up`")
            gcs[0].kill()
            return {"killed": f"gcs_server pid {gcs[0].pid}"}

        records, start, at, info = run_with_fault(args, cluster.base, fault)
        try:
            up.wait(60)
            exited = round(time.time() - at, 1) if at else None
        except subprocess.TimeoutExpired:
            exited = None
        time.sleep(3)
        orphans = [f"{p.pid} {p.name()}" for p in before.values() if p.is_running() and p.status() != "zombie"]
    finally:
        cluster.stop()
    note = dict(info or {}, up_exited_after_s=exited, orphans=orphans)
    return classify(records) | {"kv_in_use": "cluster shut down", "service_back_s": None,
                                "healthy_again_s": None, "note": note}


def row_restart_same_address(args, logdir: Path) -> dict:
    p_port, d_port, kv_port = free_port(), free_port(), free_port()
    workers = [("prefill-0", worker_argv(args, "prefill", p_port)),
               ("decode-0", worker_argv(args, "decode", d_port, kv_port))]
    cluster = standalone_cluster(args, logdir, workers)
    timeline = HealthTimeline(cluster.base)
    timeline.start()
    try:
        def fault():
            old = cluster.procs["decode-0"]
            os.killpg(old.pid, signal.SIGKILL)
            old.wait(10)
            time.sleep(0.5)
            cluster.start("decode-0", cluster.argv["decode-0"])  # the same --port and --kv-port
            line = cluster.wait_line("decode-0", r"listening on \S+ kv=\S+", args.startup_timeout_s)
            return {"restarted": "decode-0", "kv": line.rsplit("kv=", 1)[1]}

        records, start, at, info = run_with_fault(args, cluster.base, fault)
        cluster.procs["router"].wait_healthy(120)
        first_after = probe_disaggregated(cluster.base)
        kv = kv_in_use(cluster.base)
    finally:
        timeline.stop()
        cluster.stop()
    return classify(records) | {"kv_in_use": kv, "service_back_s": service_back(records, start, at),
                                "healthy_again_s": healthy_again(timeline, at),
                                "note": dict(info or {}, probe_after_restart=first_after)}


def probe_disaggregated(base: str) -> str:
    """One request after the load; where it ran, from the router's timing (usage.pdserve_timing)."""
    try:
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": MODEL_NAME[0], "prompt": "The first transfer after a restart " * 20, "max_tokens": 4,
            "temperature": 0, "pdserve_timing": True})
        body = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return f"error {type(e).__name__}"
    timing = ((body.get("usage") or {}).get("pdserve_timing") or [{}])[0]
    return f"HTTP {r.status_code} placement={timing.get('placement')} decode={timing.get('decode_worker')}"


LEARNED_GBPS = 0.1  # below this, the router's estimate of a link is a missed deadline's bound (module docstring)


def row_slow_link(args, logdir: Path) -> dict:
    """Two prefill and one decode workers behind network-aware: prefill-0's link to decode-0
    alone drops to 10 Mbit/s at the fault (prefill-0's pacing file; prefill-1 is not paced).
    The load runs at --slow-link-rate, so that a prefill worker is mostly idle when a request
    arrives and the policy prefers disaggregation on healthy links (at 1 req/s on this CPU a
    prefill worker always has a queue, and a local run on the decode worker, which the policy
    prices without one, wins); the fault fires after as many requests as the other rows'. The
    policy runs without calibration (see the docs). The note counts first placements per pair in
    three phases (before the fault; from it until the router's estimate of the slow link fell to
    a missed deadline's bound, i.e. the first missed deadline; after that) and the estimates."""
    rate = args.slow_link_rate
    row_args = argparse.Namespace(**{**vars(args), "rate": rate, "fault_at": args.fault_at * args.rate / rate})
    pacing = logdir / "pacing.txt"
    p0_port, p1_port, d0_port = free_port(), free_port(), free_port()
    pacing.write_text("default=100\n")  # Gbit/s: fast
    workers = [("prefill-0", worker_argv(args, "prefill", p0_port, kv_pacing=f"file:{pacing}")),
               ("prefill-1", worker_argv(args, "prefill", p1_port)),
               ("decode-0", worker_argv(args, "decode", d0_port))]
    router_extra = ("--policy", "network-aware", "--profile", str(REPO / args.profile),
                    "--kv-wire-precision", "full", "--no-calibration")
    slow = ("prefill-0", "decode-0")
    cluster = standalone_cluster(args, logdir, workers, router_extra=router_extra)
    watch = MetricsWatch(cluster.base, f"{slow[0]}->{slow[1]}")
    watch.start()
    try:
        def fault():
            pacing.write_text("default=0.01\n")  # prefill-0's every destination: 10 Mbit/s
            return {"link": "prefill-0 -> decode-0: 100 Gbit/s -> 10 Mbit/s (prefill-1 -> decode-0 unpaced)"}

        records, start, at, info = run_with_fault(row_args, cluster.base, fault)
        kv = kv_in_use(cluster.base)
        recoveries = recovery_counts(cluster.base)
        estimates = link_estimates(cluster.base)
    finally:
        watch.stop()
        cluster.stop()
    learned = watch.first_below(LEARNED_GBPS, after=at)
    note = dict(info or {}, policy="network-aware, no calibration", rate=rate,
                fault_after_s=round(row_args.fault_at, 1), router_recoveries=recoveries,
                first_recovery_after_fault_s=_since(watch.first_recovery(after=at), at),
                slow_link_learned_after_fault_s=_since(learned, at),
                placements=placements_by_phase(records, start, [("before", at), ("fault..first miss", learned),
                                                                 ("after first miss", None)], slow),
                slow_link_estimate_gbps=watch.changes(), link_estimate_gbps_at_end=estimates)
    return classify(records) | {"kv_in_use": kv, "service_back_s": service_back(records, start, at),
                                "healthy_again_s": None, "note": note}


def _since(t: float | None, t0: float | None) -> float | None:
    return round(t - t0, 1) if t is not None and t0 is not None else None


class MetricsWatch:
    """Polls the router's /metrics: the estimate of one link (Gbit/s) and the recoveries total, with
    their unix times, to time the first missed deadline as the router saw it."""

    def __init__(self, base: str, link: str, interval_s: float = 0.5):
        self.base, self.link, self.interval_s = base, link, interval_s
        self.samples: list[tuple[float, float | None, float]] = []  # (unix, estimate, recoveries)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            estimate = link_estimates(self.base).get(self.link)
            self.samples.append((time.time(), estimate, sum(recovery_counts(self.base).values())))
            self._stop.wait(self.interval_s)

    def first_below(self, gbps: float, after: float | None) -> float | None:
        return next((t for t, e, _ in self.samples if e is not None and e < gbps and (after is None or t >= after)),
                    None)

    def first_recovery(self, after: float | None) -> float | None:
        base = next((r for t, _, r in reversed(self.samples) if after is not None and t < after), 0.0)
        return next((t for t, _, r in self.samples if r > base and (after is None or t >= after)), None)

    def changes(self) -> list[tuple[float, float]]:
        """(seconds from the first sample, estimate) at each change of the estimate."""
        out: list[tuple[float, float]] = []
        for t, e, _ in self.samples:
            if e is not None and (not out or out[-1][1] != e):
                out.append((round(t - self.samples[0][0], 1), e))
        return out


def placements_by_phase(records, start: float, phases: list[tuple[str, float | None]], slow: tuple[str, str]) -> dict:
    """Where the requests sent in each phase were first placed, from each response's
    usage.pdserve_timing: "P->D" (disaggregated), "local D", and the share on the `slow` pair.
    `phases`: (name, unix time it ends; None: no end), in order; a phase whose end is unknown
    takes every later request (the later phases are then empty). A request that ends local on D
    after more than one attempt was first placed on a pair to D and fell back: when D is the slow
    pair's, it counts for that pair (with a single other prefill worker this can misattribute one
    that fell back from the other pair; `router_recoveries` bounds how many fell back)."""
    out: dict = {name: Counter() for name, _ in phases}
    for r in records:
        if r.sent_s is None:
            continue
        sent = start + r.sent_s
        name = next((n for n, end in phases if end is None or sent < end), phases[-1][0])
        t = r.server_timing or {}
        p, d, placement = t.get("prefill_worker"), t.get("decode_worker"), t.get("placement")
        if placement == "disaggregated":
            key = f"{p}->{d}"
        elif placement == "local" and (t.get("attempts") or 1) > 1 and d == slow[1]:
            key = f"{slow[0]}->{d} (fell back)"
        elif placement == "local":
            key = f"local {d}"
        else:
            key = "unknown"
        out[name][key] += 1
    result = {}
    for name, counts in out.items():
        total = sum(counts.values())
        on_slow = sum(n for k, n in counts.items() if k.startswith(f"{slow[0]}->{slow[1]}"))
        result[name] = dict(counts, slow_pair_share=round(on_slow / total, 2) if total else None)
    return result


def link_estimates(base: str) -> dict[str, float]:
    """The router's estimate of each link (Gbit/s), from /metrics `pdserve:link_estimated_gbps`."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for m in re.finditer(r'^pdserve:link_estimated_gbps\{([^}]*)\} (\S+)$', text, re.M):
        link = re.search(r'link="([^"]*)"', m.group(1))
        out[link.group(1) if link else m.group(1)] = round(float(m.group(2)), 4)
    return out


def row_mismatched(args, logdir: Path) -> dict:
    p_port, d_port, d2_port = free_port(), free_port(), free_port()
    workers = [("prefill-0", worker_argv(args, "prefill", p_port)),
               ("decode-0", worker_argv(args, "decode", d_port)),
               ("decode-bs32", worker_argv(args, "decode", d2_port, extra=("--block-size", "32")))]
    cluster = standalone_cluster(args, logdir, workers)
    try:
        records, start, at, _ = run_with_fault(args, cluster.base, lambda: None)
        kv = kv_in_use(cluster.base)
        placed = decisions_by_decode(cluster.base)
    finally:
        cluster.stop()
    # the odd one alone with the prefill worker: no pair exists
    alone = standalone_cluster(args, logdir, [w for w in workers if w[0] != "decode-0"])
    try:
        r = httpx.post(f"{alone.base}/v1/completions", timeout=120,
                       json={"model": MODEL_NAME[0], "prompt": "hello " * 50, "max_tokens": 4})
        alone_answer = f"HTTP {r.status_code}: {r.json().get('error', {}).get('message', '')[:160]}"
    finally:
        alone.stop()
    return classify(records) | {"kv_in_use": kv, "service_back_s": None, "healthy_again_s": None,
                                "note": {"decode workers used": placed, "prefill + decode-bs32 alone": alone_answer}}


def decisions_by_decode(base: str) -> dict[str, float]:
    """Requests each worker served, from the router's /health (the in-flight counters are gone by
    then), falling back to the workers' KV bytes received."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for m in re.finditer(r'^pdserve:worker_kv_transfer_bytes(?:_total)?\{([^}]*)\} (\S+)$', text, re.M):
        worker = re.search(r'worker="([^"]*)"', m.group(1))
        out[worker.group(1) if worker else m.group(1)] = float(m.group(2))
    return out


def row_router_restart(args, logdir: Path) -> dict:
    p_port, d_port = free_port(), free_port()
    workers = [("prefill-0", worker_argv(args, "prefill", p_port)), ("decode-0", worker_argv(args, "decode", d_port))]
    cluster = standalone_cluster(args, logdir, workers)
    try:
        def fault():
            router = cluster.procs["router"]
            t0 = time.time()
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(30)
            stopped = time.time() - t0
            cluster.start("router", cluster.argv["router"], num_workers=len(workers)).wait_healthy(120)
            return {"router_stopped_in_s": round(stopped, 1), "router_back_after_s": round(time.time() - t0, 1)}

        records, start, at, info = run_with_fault(args, cluster.base, fault)
        kv = kv_in_use(cluster.base)
    finally:
        cluster.stop()
    return classify(records) | {"kv_in_use": kv, "service_back_s": service_back(records, start, at),
                                "healthy_again_s": None, "note": info}


def run_row(name: str, args, logdir: Path) -> dict:
    fn = {
        "kill-prefill": lambda: row_kill(args, logdir, "prefill"),
        "kill-decode": lambda: row_kill(args, logdir, "decode"),
        "restart-same-address": lambda: row_restart_same_address(args, logdir),
        "sigstop-decode": lambda: row_sigstop(args, logdir),
        "slow-link": lambda: row_slow_link(args, logdir),
        "kv-loss": lambda: row_kv_loss(args, logdir),
        "mismatched-peers": lambda: row_mismatched(args, logdir),
        "router-restart": lambda: row_router_restart(args, logdir),
        "gcs-kill": lambda: row_gcs_kill(args, logdir),
    }[name]
    t0 = time.monotonic()
    args.row_dir = logdir
    try:
        row = fn()
    except Exception as e:
        row = {"error": f"{type(e).__name__}: {e}"}
    return {"fault": name, **row, "row_s": round(time.monotonic() - t0)}


def table(rows: list[dict]) -> str:
    head = ("| fault | sent | completed | failed (client saw) | lost | hung | KV in use at the end | "
            "service back (s) | healthy again (s) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['fault']} | row failed: {r['error']} |" + " |" * 7)
            continue
        failed = ", ".join(f"{n}x {s}" for s, n in sorted(r["failed"].items())) or "0"
        kv = r["kv_in_use"]
        kv = ", ".join(f"{w}: {v:g}" for w, v in kv.items()) if isinstance(kv, dict) else kv
        lines.append(f"| {r['fault']} | {r['sent']} | {r['completed']} | {failed} | {r['lost']} | {r['hung']} | "
                     f"{kv} | {r['service_back_s'] if r['service_back_s'] is not None else '-'} | "
                     f"{r['healthy_again_s'] if r['healthy_again_s'] is not None else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    MODEL_NAME[0] = args.model
    out = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-faults-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows: list[dict] = []
    not_run: list[str] = []
    report = {
        "command": "python -m experiments.faults " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(args.device),
        "settings": {k: getattr(args, k) for k in ("model", "device", "dtype", "worker_gpus", "gpu_memory_fraction",
                                                     "kv_cache_gib", "rate",
                                                     "slow_link_rate", "num_requests", "fault_at", "stop_s",
                                                     "input_len", "output_len", "kv_deadline_s")},
        "rows": rows, "not_run": not_run,
    }
    for name in args.rows:
        if args.time_budget_s is not None and time.monotonic() - t0 > args.time_budget_s:
            not_run.append(name)
            continue
        logdir = out / name
        logdir.mkdir(exist_ok=True)
        print(f"== {name}", file=sys.stderr, flush=True)
        row = run_row(name, args, logdir)
        print(json.dumps(row), file=sys.stderr, flush=True)
        (logdir / "row.json").write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
        write_results(out, report, args.tar)
    write_results(out, report, args.tar)
    print(render(report))
    print(f"(rows, logs: {out}{', ' + args.tar if args.tar else ''})", file=sys.stderr)
    bad = [r for r in rows if "error" in r or r.get("lost") or r.get("hung")]
    return 1 if bad else 0


def machine(device: str) -> str:
    where = f"{platform.machine()} ({os.cpu_count()} CPUs)"
    if not device.startswith("cuda"):
        return f"{where}, CPU only"
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.SubprocessError):
        gpus = "nvidia-smi unavailable"
    return f"{where}, {device}: {gpus}"


def render(report: dict) -> str:
    """The table and each row's note, as docs/faults.md shows them."""
    lines = [table(report["rows"]), ""]
    lines += [f"- `{r['fault']}`: {json.dumps(r['note'])}" for r in report["rows"] if r.get("note")]
    if report["not_run"]:
        lines.append(f"- not run (--time-budget-s): {', '.join(report['not_run'])}")
    return "\n".join(lines)


def write_results(out: Path, report: dict, tar: str) -> None:
    """rows.json and table.md in `out`; with `tar`, the whole folder packed into that file (written
    beside it and renamed, so the file is always a whole archive)."""
    (out / "rows.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "table.md").write_text(f"{report['command']}\n{report['machine']}\n\n{render(report)}\n")
    if tar:
        import tarfile

        tmp = Path(f"{tar}.part")
        with tarfile.open(tmp, "w:gz") as f:
            f.add(out, arcname=out.name)
        tmp.replace(tar)


if __name__ == "__main__":
    sys.exit(main())
