"""A load step against a live `pdserve up --autoscale`: rate, workers per pool and SLO attainment over time.

Starts `pdserve up --autoscale` from 1P+1D (`--mode hybrid`: two hybrid workers, mixed workers
that also move KV, whose duties the autoscaler shifts; or attaches to a running one with --url), sends
Poisson streaming /v1/completions requests at `--low` req/s, steps to `--high`, then back to
`--low`, scrapes the router's /metrics every `--scrape-s` (pdserve:pool_workers,
pdserve:slo_attainment), and measures each request on the client (TTFT, TPOT, status). Then:

- the time from the step up until the client-side attainment (requests that arrived in the
  last `--window-s`, both SLOs met, failures missing) is back at or above 0.9;
- the time from the step down until the pools are back at their starting size (hybrid: and
  every duty back to mixed);
- the changes the autoscaler made and when (from its decision counters: add, remove, shift with
  the reason code, e.g. shift_to_decode, relax_to_mixed);
- the requests that failed or never ended (the issue's target: 0 through the scale-down);

and writes the record (JSON, with the `pdserve up` log's path) to --out, the plot to --plot
(docs/autoscale.png) and, with --tar, the record, the plot and the log in one tar.gz (also when
the run fails midway: then with what there is).

    python -m experiments.autoscale_step --model random:smollm2-135m \\
        --low 0.2 --high 1.0 --phases 60,120,120 --slo-ttft 2 --slo-tpot 0.25

On one GPU: `--device cuda` with a share of it per worker; with --max-workers M, up to 2M
workers share it, so --worker-gpus must be at most 1/(2M), and --gpu-memory-fraction sets each
worker's KV cache (the fraction of the free GPU memory a worker takes when it starts):

    python -m experiments.autoscale_step --device cuda --worker-gpus 0.16 \\
        --gpu-memory-fraction 0.1 --model <model> --tar step.tar.gz
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tarfile
import tempfile
import time

import httpx

from pdserve.loadgen.launcher import LaunchError, ServerProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def up_load_arg(text: str) -> float | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or auto, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running `pdserve up --autoscale` (default: start one)")
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "hybrid"),
                   help="disaggregated: from 1 prefill + 1 decode worker; hybrid: from 2 hybrid workers (mixed "
                        "workers that move KV, whose duties the autoscaler shifts), up to 2 * --max-workers")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--low", type=float, default=0.2, help="req/s before and after the step")
    p.add_argument("--high", type=float, default=1.0, help="req/s during the step")
    p.add_argument("--phases", default="60,120,120", help="seconds at low, high, low")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=512,
                   help="the workers' context (at least --prompt-tokens + --max-tokens)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="each worker's token budget per step (default: pdserve up's for the device)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="each worker's running requests at most (default: pdserve up's for the device)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.25)
    p.add_argument("--window-s", type=float, default=20.0, help="sliding window of the client-side attainment")
    p.add_argument("--scrape-s", type=float, default=2.0)
    p.add_argument("--max-workers", type=int, default=3, help="autoscale max per pool (min 1)")
    p.add_argument("--interval-s", type=float, default=3.0)
    p.add_argument("--cooldown-s", type=float, default=10.0)
    # 4 on the 2-core VM: 1P+2D met the SLO at 1 req/s with 3.3-3.7 in flight per decode worker
    # (run 6, where 3 added a third decode worker), 1P+1D reached 4 at +19-21 s of the step
    p.add_argument("--up-load", type=up_load_arg, default=4.0, help="autoscale up_load: requests in flight per "
                   "worker that add one before the SLO misses (0: off; auto: from the workers' max_num_seqs)")
    p.add_argument("--spares", type=int, default=0, help="autoscale spares: warm spare workers per pool, which an "
                   "addition takes at once (default 0)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the workers' device")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="weights and activations (default: pdserve up's for the device)")
    p.add_argument("--worker-cpus", type=float, default=None,
                   help="CPUs per Ray worker (default: 0.25 on cpu, pdserve up's on cuda)")
    p.add_argument("--worker-gpus", type=float, default=None,
                   help="cuda: the fraction of the GPU per Ray worker, at most 1/(2 * --max-workers) "
                        "(default: that bound, rounded down to Ray's two decimals)")
    p.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="cuda: the fraction of the free GPU memory each worker's KV cache takes "
                        "(default: pdserve up's, scaled by the worker's GPU share)")
    p.add_argument("--kv-cache-gib", type=float, default=0.3,
                   help="cpu: KV cache per worker (a small cache turns load into 429s); not passed on cuda")
    p.add_argument("--settle-s", type=float, default=180.0, help="after the load, wait this long at most for "
                                                                  "the pools to be back at their starting size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "autoscale_step.json"))
    p.add_argument("--plot", default=os.path.join(REPO, "docs", "autoscale.png"))
    p.add_argument("--tar", default=None, help="also pack the record, the plot and the pdserve up log into this "
                                               "tar.gz (also after a run that fails midway)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The device flags that fit together (argparse errors otherwise); fills the device defaults."""
    if args.max_workers < 1:
        p.error("--max-workers must be >= 1")
    if args.spares < 0:
        p.error("--spares must be >= 0")
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        p.error("--prompt-tokens and --max-tokens must be >= 1")
    if args.prompt_tokens + args.max_tokens > args.max_model_len:
        p.error(f"--max-model-len {args.max_model_len} is below --prompt-tokens + --max-tokens "
                f"({args.prompt_tokens} + {args.max_tokens})")
    if args.device == "cpu":
        for flag in ("worker_gpus", "gpu_memory_fraction"):
            if getattr(args, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} applies to --device cuda")
        if args.worker_cpus is None:
            args.worker_cpus = 0.25
        return
    bound = 1.0 / (2 * args.max_workers)  # every pool at its max shares the one GPU
    if args.worker_gpus is None:
        args.worker_gpus = int(bound * 100) / 100  # Ray takes two decimals
    if not 0 < args.worker_gpus <= bound + 1e-9:
        p.error(f"--worker-gpus {args.worker_gpus:g}: up to {2 * args.max_workers} workers share the GPU "
                f"(--max-workers {args.max_workers} a pool), so it must be in (0, {bound:.4g}]")
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction <= 1:
        p.error(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction:g}")


def up_command(args: argparse.Namespace, config_path: str) -> list[str]:
    """The `pdserve up` command line (after the interpreter) for `args`: --kv-cache-gib only on
    cpu (on cuda the KV cache is --gpu-memory-fraction of the free memory), --worker-gpus 0 on
    cpu (a worker must not take a GPU share)."""
    workers = ["--prefill", "1", "--decode", "1"] if args.mode == "disaggregated" else [
        "--mode", "hybrid", "--replicas", "2"]
    cmd = ["-m", "pdserve.launcher.cli", "up", "--autoscale", "--config", config_path, "--model", args.model,
           "--device", args.device, *workers, "--port", str(args.port),
           "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
           "--max-model-len", str(args.max_model_len),
           "--cluster-name", "autoscale-step", "--namespace", "pdserve-autoscale-step"]
    if args.dtype is not None:
        cmd += ["--dtype", args.dtype]
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.worker_cpus is not None:
        cmd += ["--worker-cpus", str(args.worker_cpus)]
    if args.device == "cpu":
        cmd += ["--worker-gpus", "0", "--kv-cache-gib", str(args.kv_cache_gib)]
    else:
        cmd += ["--worker-gpus", str(args.worker_gpus)]
        if args.gpu_memory_fraction is not None:
            cmd += ["--gpu-memory-fraction", str(args.gpu_memory_fraction)]
    return cmd


def autoscale_settings(args: argparse.Namespace) -> dict:
    """The cluster file's `autoscale:` mapping for `args` (hybrid: one pool, mixed, from 2 to the
    disaggregated run's ceiling, 2 * --max-workers)."""
    if args.mode == "hybrid":
        bounds = {"min": {"mixed": 2}, "max": {"mixed": 2 * args.max_workers}}
    else:
        bounds = {"min": {"prefill": 1, "decode": 1}, "max": {"prefill": args.max_workers, "decode": args.max_workers}}
    return {**bounds, "interval": args.interval_s, "cooldown": args.cooldown_s, "window": args.window_s, "target": 0.9,
            "up_load": args.up_load, "spares": args.spares}


def start_cluster(args, logs: dict) -> tuple[ServerProcess, str]:
    """Starts `pdserve up` (loadgen's ServerProcess: its own process group; stopped with SIGTERM, then
    SIGKILL after 30 s); its log's path goes in logs["up"] at once (for --tar, whatever happens)."""
    path = os.path.join(tempfile.mkdtemp(prefix="autoscale-"), "cluster.json")  # JSON is YAML
    with open(path, "w") as f:
        json.dump({"autoscale": autoscale_settings(args)}, f)
    log_path = os.path.join(os.path.dirname(path), "up.log")
    logs["up"] = log_path
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": None}
    cmd = [sys.executable, *up_command(args, path)]
    print("starting:", " ".join(cmd[1:]), f"(log {log_path})", file=sys.stderr)
    url = f"http://127.0.0.1:{args.port}"
    up = ServerProcess(cmd, health_url=url + "/health", log_path=log_path, env=env, cwd=REPO, name="pdserve up",
                       startup_timeout_s=600, shutdown_timeout_s=30, poll_interval_s=1.0)
    try:
        up.launch()
    except LaunchError as e:
        raise SystemExit(str(e)) from None
    return up, url


def scrape(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"workers": {}, "draining": {}, "spares": {}, "duties": {}, "attainment": None, "busy": {}, "load": {},
           "decisions": {}, "rate": None}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve:pool_workers":
                key = {"serving": "workers", "draining": "draining", "spare": "spares"}.get(s.labels.get("state"))
                if key is not None:
                    out[key][s.labels["pool"]] = s.value
            elif s.name == "pdserve:autoscale_duties":
                out["duties"][s.labels["duty"]] = s.value
            elif s.name == "pdserve:slo_attainment" and s.labels.get("slo") == "both":
                out["attainment"] = s.value
            elif s.name in ("pdserve:autoscale_pool_busy", "pdserve:autoscale_pool_load"):
                out[s.name.rsplit("_", 1)[-1]][s.labels["pool"]] = s.value
            elif s.name == "pdserve:autoscale_arrival_rate":
                out["rate"] = s.value
            elif s.name == "pdserve:autoscale_decisions_total" and s.labels.get("action") != "hold":
                out["decisions"][f"{s.labels['action']} {s.labels['pool']} {s.labels['reason']}"] = s.value
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, t0: float,
                      scheduled: float) -> dict:
    """One streaming request; `scheduled` is its time in the Poisson schedule (seconds from t0): a
    `lag` over a fraction of a second means the client, not the server, set the offered load."""
    arrival = time.monotonic()
    rec = {"arrival": arrival - t0, "lag": arrival - t0 - scheduled, "ttft": None, "tpot": None, "status": "ok"}
    first = last = None
    tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                rec["status"] = f"http {r.status_code}"
                rec["end"] = time.monotonic() - t0
                return rec
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["status"] = "error: " + str(chunk["error"].get("message", ""))[:80]
                    rec["end"] = time.monotonic() - t0
                    return rec
                now = time.monotonic()
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    tokens += 1
                    first = first or now
                    last = now
            if not done:
                rec["status"] = "cut"
    except httpx.HTTPError as e:
        rec["status"] = f"{type(e).__name__}"
    if first is not None:
        rec["ttft"] = first - arrival
        if tokens > 1:
            rec["tpot"] = (last - first) / (tokens - 1)
    rec["end"] = time.monotonic() - t0
    return rec


async def run_load(args, url: str) -> tuple[list[dict], list[dict], float]:
    phases = [float(x) for x in args.phases.split(",")]
    rates = [args.low, args.high, args.low]
    rng = random.Random(args.seed)
    words = "the quick brown fox jumps over a lazy dog while".split()
    model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    t0 = time.monotonic()
    samples: list[dict] = []
    tasks: list[asyncio.Task] = []
    stop = asyncio.Event()

    # no bound on connections: a bounded pool makes a backlog of requests wait in the client, whose
    # pool then scans its waiters on every release (the one-H200 run 12 fell 50 s behind its schedule)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        async def sampler() -> None:
            while not stop.is_set():
                try:
                    text = (await client.get(url + "/metrics", timeout=5)).text
                    samples.append({"t": time.monotonic() - t0, **scrape(text)})
                except httpx.HTTPError:
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), args.scrape_s)
                except asyncio.TimeoutError:
                    pass

        sampling = asyncio.create_task(sampler())
        start = 0.0
        for duration, rate in zip(phases, rates):
            t = start
            while True:
                t += rng.expovariate(rate)
                if t >= start + duration:
                    break
                await asyncio.sleep(max(0.0, t - (time.monotonic() - t0)))
                prompt = " ".join(rng.choices(words, k=args.prompt_tokens))
                tasks.append(asyncio.create_task(one_request(client, url, model, prompt, args.max_tokens, t0, t)))
            start += duration
            await asyncio.sleep(max(0.0, start - (time.monotonic() - t0)))
        requests = await asyncio.gather(*tasks)
        # watch the pools settle after the last request (extra workers leave), up to settle_s
        settle_until = time.monotonic() + args.settle_s
        while time.monotonic() < settle_until and samples and not settled(samples[-1]):
            await asyncio.sleep(1)
        stop.set()
        await sampling
    return list(requests), samples, time.monotonic() - t0


def specialists(sample: dict) -> int:
    """Hybrid workers with a prefill or decode duty: the router's `pdserve:autoscale_duties`
    gauge when the sample has it, else from the decision counters (a record of an older run): a
    shift to a specialist duty adds one, a shift to mixed (a specialist back one step, or
    relax_to_mixed) and the removal of an idle specialist (idle_specialist) take one."""
    duties = sample.get("duties")
    if duties:
        return int(duties.get("prefill", 0) + duties.get("decode", 0))
    n = 0
    for key, count in sample["decisions"].items():
        action, pool, reason = key.split(" ", 2)
        if action == "shift":
            n += -count if pool == "mixed" else count
        elif action == "remove" and reason == "idle_specialist":
            n -= count
    return int(n)


def settled(sample: dict) -> bool:
    """Back at the starting size (two workers), none draining, no specialist duty left."""
    return sum(sample["workers"].values()) <= 2 and not sum(sample["draining"].values()) and not specialists(sample)


def changes(samples: list[dict]) -> list[dict]:
    """The autoscaler's changes (decisions other than hold) in the order the scrapes saw them:
    {t, decision: "action pool reason", n}, t the first scrape that counted it."""
    out = []
    seen: dict[str, float] = {}
    for s in samples:
        for key, count in sorted(s["decisions"].items()):
            if count > seen.get(key, 0):
                out.append({"t": round(s["t"], 1), "decision": key, "n": int(count - seen.get(key, 0))})
                seen[key] = count
    return out


def attainment_series(requests: list[dict], args, until: float, step: float = 2.0) -> list[tuple[float, float | None]]:
    """At each t: over the requests that arrived in the last window_s and whose outcome is known
    by t (the router's rule, launcher.autoscale.window): ended, or past the TTFT SLO without a
    first token by then. None when there are none."""
    def verdict(r) -> tuple[float, bool]:
        """(when it is known, met both SLOs)"""
        end = r.get("end", r["arrival"] + 1e9)
        if r["status"] != "ok" or r["ttft"] is None or r["ttft"] > args.slo_ttft:
            return min(end, r["arrival"] + args.slo_ttft), False
        return end, r["tpot"] is None or r["tpot"] <= args.slo_tpot

    judged = [(r["arrival"], *verdict(r)) for r in requests]
    out = []
    t = step
    while t <= until:
        done = [ok for arrival, known, ok in judged if t - args.window_s <= arrival and known <= t]
        out.append((t, sum(done) / len(done) if done else None))
        t += step
    return out


def summarize(requests, samples, series, args) -> dict:
    phases = [float(x) for x in args.phases.split(",")]
    up_at, down_at = phases[0], phases[0] + phases[1]
    high = [(t, a) for t, a in series if up_at < t <= down_at and a is not None]
    # from when on it stays at or above 0.9 until the step down
    recovered = next((t for i, (t, a) in enumerate(high) if all(b >= 0.9 for _, b in high[i:])), None)
    dipped = any(a is not None and a < 0.9 for t, a in series if up_at < t <= down_at)
    back = next((s["t"] for s in samples if s["t"] >= down_at and settled(s)), None)
    peak = max((sum(s["workers"].values()) for s in samples), default=0)
    failed = [r for r in requests if r["status"] != "ok"]
    first_drain = next((s["t"] for s in samples if sum(s["draining"].values())), float("inf"))
    lags = sorted(r["lag"] for r in requests if r.get("lag") is not None)
    return {
        "requests": len(requests), "failed": len(failed), "failures": sorted({r["status"] for r in failed}),
        # ended after the first drain began: what a scale-down could have cut
        "failed_through_scale_down": sum(r.get("end", 1e18) >= first_drain for r in failed),
        "first_drain_at_s": None if first_drain == float("inf") else round(first_drain, 1),
        "peak_workers": peak, "attainment_dipped_below_0.9": dipped,
        "attainment_back_above_0.9_s_after_step_up": None if recovered is None else round(recovered - up_at, 1),
        "pools_back_to_1p1d_s_after_step_down": None if back is None else round(back - down_at, 1),
        "changes": changes(samples),
        # how far the client fell behind its Poisson schedule: over a second, the offered load was
        # the client's, not --high (a warning says so)
        "sender_lag_p99_s": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))], 3) if lags else None,
        "sender_lag_max_s": round(lags[-1], 3) if lags else None,
    }


def plot(requests, samples, series, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [float(x) for x in args.phases.split(",")]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    edges = [0, phases[0], phases[0] + phases[1], sum(phases)]
    rates = [args.low, args.high, args.low]
    ax = axes[0]
    ax.step([edges[0], edges[1], edges[2], edges[3]], [rates[0], rates[1], rates[2], rates[2]], where="post",
            label="offered rate")
    arrivals = sorted(r["arrival"] for r in requests)
    ts = [t for t, _ in series]
    measured = [sum(1 for a in arrivals if t - 10 < a <= t) / 10 for t in ts]
    ax.plot(ts, measured, alpha=0.6, label="arrivals (10 s)")
    ax.set_ylabel("req/s")
    ax.legend(loc="upper right")
    ax = axes[1]
    pools = sorted({p for s in samples for p in s["workers"]})
    for pool in pools:
        ax.step([s["t"] for s in samples], [s["workers"].get(pool, 0) for s in samples], where="post", label=pool)
    ax.step([s["t"] for s in samples], [sum(s["draining"].values()) for s in samples], where="post", linestyle=":",
            label="draining")
    for c in changes(samples):
        action, pool, reason = c["decision"].split(" ", 2)
        if action == "shift":  # duty shifts: no worker starts or leaves, so a mark of their own
            ax.axvline(c["t"], color="tab:purple", linestyle="--", linewidth=0.8)
            ax.annotate(f"{reason} ({pool})", (c["t"], 0.1), rotation=90, fontsize=7, color="tab:purple",
                        xytext=(2, 0), textcoords="offset points")
    ax.set_ylabel("workers")
    ax.legend(loc="upper right")
    ax = axes[2]
    ax.plot([t for t, a in series if a is not None], [a for t, a in series if a is not None],
            label=f"client, requests of the last {args.window_s:g} s")
    ax.plot([s["t"] for s in samples if s["attainment"] is not None],
            [s["attainment"] for s in samples if s["attainment"] is not None], alpha=0.6, label="router's gauge")
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("SLO attainment")
    ax.set_xlabel("seconds")
    ax.legend(loc="lower right")
    for a in axes:
        for e in edges[1:3]:
            a.axvline(e, color="grey", linewidth=0.8)
    fig.suptitle(f"pdserve up --autoscale{' --mode hybrid' if args.mode == 'hybrid' else ''}, {args.model}, "
                 f"{args.low:g} -> {args.high:g} -> {args.low:g} req/s "
                 f"(TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot:g} s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pack(path: str, files: list[str | None]) -> None:
    """The files that exist, flat, into the tar.gz `path`."""
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            if name and os.path.exists(name):
                tar.add(name, arcname=os.path.basename(name))
    print(f"packed: {path}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = None
    url = args.url
    logs: dict[str, str] = {}
    done = False
    try:
        try:
            if url is None:
                proc, url = start_cluster(args, logs)
            requests, samples, elapsed = asyncio.run(run_load(args, url))
        finally:
            if proc is not None:
                proc.stop()
        series = attainment_series(requests, args, elapsed)
        summary = summarize(requests, samples, series, args)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "log": logs.get("up"), "summary": summary, "requests": requests,
                       "samples": samples, "attainment": series}, f)
        plot(requests, samples, series, args, args.plot)
        print(json.dumps(summary, indent=1))
        if (summary["sender_lag_max_s"] or 0) > 1.0:
            print(f"warning: the client fell up to {summary['sender_lag_max_s']:.1f} s behind its schedule: the "
                  f"offered load was lower than --high {args.high:g} req/s (a faster client, or fewer req/s)",
                  file=sys.stderr)
        print(f"record: {args.out}; plot: {args.plot}; log: {logs.get('up')}")
        done = True
    finally:
        if args.tar:  # after a failure too: the log says why
            pack(args.tar, [args.out if done else None, args.plot if done else None, logs.get("up")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
