"""The user's path on a GPU, from fresh processes: `pdserve up`, the openai client, loadgen.

Every step starts the cluster the way a user does (`python -m pdserve.launcher.cli up`, Ray, the real
UCX backend, a new process per worker) and measures it from outside, over HTTP:

1. smoke: PD (1 prefill + 1 decode; on one GPU they share it), the `openai` client gets an
   answer, `pdserve-loadgen` sends ``--smoke-requests`` requests at light load: 0 errors and
   0 KV deadline fallbacks (the router's ``pdserve:request_recoveries_total``) required;
2. light: ``--prompt-len``-token prompts one at a time-ish (``--light-rate``): TTFT p50 and the
   KV transfer time per request (the router's ``pdserve:kv_transfer_seconds`` histogram and
   per-phase histograms);
3. load: the same prompts at ``--load-rate`` (a rate the prefill worker sustains): KV transfer
   p50 against the light-load figure, and fallbacks;
4. colocated: one mixed worker on the same GPU, the light-load run again: TTFT p50.

Checks printed at the end (issue targets): loaded KV p50 <= 2x light; no fallbacks; PD TTFT
p50 <= colocated TTFT p50 + KV bytes / link rate + 5 ms, the link rate being raw ``ucxx``
moving the same bytes in one message between two processes, measured in the same run.
Exit status 1 when the smoke fails (errors or fallbacks), else 0.

    python -m experiments.gpu_serving [--model random:llama-3.2-1b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from pdserve.loadgen.launcher import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Cluster(ServerProcess):
    """A `pdserve up`, started here and ready once /v1/models answers (loadgen's ServerProcess: its
    own process group), stopped with SIGINT (then SIGKILL after 60 s)."""

    def __init__(self, args: list[str], port: int, logfile: str, timeout_s: float):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pdserve.launcher.cli", "up", "--port", str(port), *args]
        super().__init__(cmd, health_url=self.url + "/v1/models", log_path=logfile, cwd=ROOT, name="pdserve up",
                         startup_timeout_s=timeout_s, shutdown_timeout_s=60, stop_signal=signal.SIGINT,
                         poll_interval_s=1.0)
        log("start: " + " ".join(cmd[1:]))
        self.launch()
        log(f"ready in {self.startup_s:.1f}s")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()


def loadgen(url: str, n: int, rate: float, prompt_len: int, output_len: int, seed: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "pdserve.loadgen.cli", "run", "--url", url, "--num-requests", str(n),
           "--rate", str(rate), "--input-len", f"fixed:{prompt_len}", "--output-len", f"fixed:{output_len}",
           "--ignore-eos", "--seed", str(seed), "--json", "--no-progress", "--max-run-time", "300", "--output", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, labels): value}."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[(m["name"], frozenset(_LABEL.findall(m["labels"] or "")))] = float(m["value"])
    return out


def histogram(before: dict, after: dict, name: str, **labels: str) -> dict:
    """count, mean and p50/p90 (linear within buckets) of the observations between scrapes,
    over every series whose labels include ``labels`` (e.g. all links)."""
    want = frozenset(labels.items())
    cum: dict[float, float] = {}
    count = total = 0.0
    for key, value in after.items():
        series = dict(key[1])
        le = series.pop("le", None)
        if not want <= frozenset(series.items()):
            continue
        delta = value - before.get(key, 0.0)
        if key[0] == name + "_bucket" and le not in (None, "+Inf"):
            cum[float(le)] = cum.get(float(le), 0.0) + delta
        elif key[0] == name + "_count":
            count += delta
        elif key[0] == name + "_sum":
            total += delta
    buckets = sorted(cum.items())
    res = {"count": count, "mean": total / count if count else None}
    for q in (0.5, 0.9):
        res[f"p{int(q * 100)}"] = None
        if count:
            target, lo, prev = q * count, 0.0, 0.0
            for le, c in buckets:
                if c >= target:
                    frac = (target - prev) / (c - prev) if c > prev else 1.0
                    res[f"p{int(q * 100)}"] = lo + frac * (le - lo)
                    break
                lo, prev = le, c
    return res


def counter(before: dict, after: dict, name: str, **labels: str) -> float:
    """The increase of ``name`` over every series whose labels include ``labels``."""
    want = frozenset(labels.items())
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name and want <= k[1])


def openai_answer(url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=16, temperature=0)
    return reply.choices[0].message.content or ""


def measured_run(cluster: Cluster, name: str, n: int, rate: float, args, out_dir: str) -> dict:
    before = scrape(cluster.metrics())
    summary = loadgen(cluster.url, n, rate, args.prompt_len, args.output_len, 1, os.path.join(out_dir, name))
    after = scrape(cluster.metrics())
    kv = histogram(before, after, "pdserve:kv_transfer_seconds")
    phases = {p: histogram(before, after, "pdserve:kv_transfer_phase_seconds", phase=p)
              for p in ("stage", "queue", "wire", "ack")}
    first_token = {p: histogram(before, after, "pdserve:first_token_phase_seconds", phase=p)
                   for p in ("reserve", "prefill", "kv_tail", "rpc")}
    kv_bytes = counter(before, after, "pdserve:kv_transfer_bytes_total")
    fallbacks = counter(before, after, "pdserve:request_recoveries_total", kind="local_fallback")
    res = {"summary": summary, "kv": kv, "phases": phases, "first_token": first_token, "fallbacks": fallbacks,
           "kv_bytes_per_request": kv_bytes / kv["count"] if kv["count"] else None}
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}"  # noqa: E731
    log(f"{name}: {summary['num_ok']}/{summary['num_requests']} ok, rate {rate}/s, "
        f"TTFT p50 {ms(summary['ttft_p50'])} ms "
        f"p90 {ms(summary['ttft_p90'])} ms, TPOT p50 {ms(summary['tpot_p50'])} ms; KV transfers {kv['count']:.0f}: "
        f"p50 {ms(kv['p50'])} ms mean {ms(kv['mean'])} ms; fallbacks {fallbacks:.0f}")
    if kv["count"]:
        log("   phases p50 ms: " + ", ".join(f"{p} {ms(h['p50'])}" for p, h in phases.items())
            + f"; KV bytes/request {res['kv_bytes_per_request'] / 1e6:.1f} MB")
        log("   first token p50 ms: " + ", ".join(f"{p} {ms(h['p50'])} (mean {ms(h['mean'])})"
                                               for p, h in first_token.items()))
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3.2-1b")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--smoke-requests", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--light-rate", type=float, default=1.0)
    parser.add_argument("--light-requests", type=int, default=20)
    parser.add_argument("--load-rate", type=float, default=8.0)
    parser.add_argument("--load-requests", type=int, default=120)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", default="gpu_serving_out")
    parser.add_argument("--skip-colocated", action="store_true")
    args = parser.parse_args()
    for flag in ("smoke_requests", "prompt_len", "output_len", "light_requests", "load_requests"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.light_rate <= 0 or args.load_rate <= 0:
        parser.error("--light-rate and --load-rate must be > 0")
    os.makedirs(args.out, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU workers)"
    log(f"model {args.model}; {gpu}; prompts {args.prompt_len} tokens, {args.output_len} out")
    results: dict = {"model": args.model, "gpu": gpu}
    ok = True

    pd = Cluster(["--model", args.model], args.port, os.path.join(args.out, "up_pd.log"), args.startup_timeout)
    try:
        results["pd_startup_s"] = pd.startup_s
        answer = openai_answer(pd.url)
        log(f"openai client answer: {answer!r}")
        before = scrape(pd.metrics())
        smoke = loadgen(pd.url, args.smoke_requests, 2.0, 256, 32, 0, os.path.join(args.out, "smoke"))
        after = scrape(pd.metrics())
        fallbacks = counter(before, after, "pdserve:request_recoveries_total", kind="local_fallback")
        results["smoke"] = {"num_requests": smoke["num_requests"], "num_errors": smoke["num_errors"],
                            "fallbacks": fallbacks, "answer": answer}
        smoke_ok = bool(answer) and smoke["num_errors"] == 0 and fallbacks == 0
        ok &= smoke_ok
        log(f"SMOKE {'PASS' if smoke_ok else 'FAIL'}: {smoke['num_requests']} requests, {smoke['num_errors']} errors, "
            f"{fallbacks:.0f} KV deadline fallbacks")
        results["pd_light"] = measured_run(pd, "pd_light", args.light_requests, args.light_rate, args, args.out)
        results["pd_load"] = measured_run(pd, "pd_load", args.load_requests, args.load_rate, args, args.out)
    finally:
        pd.stop()

    if not args.skip_colocated:
        colo = Cluster(["--model", args.model, "--mode", "colocated", "--replicas", "1"], args.port,
                       os.path.join(args.out, "up_colocated.log"), args.startup_timeout)
        try:
            results["colocated_light"] = measured_run(colo, "colocated_light", args.light_requests, args.light_rate,
                                                      args, args.out)
        finally:
            colo.stop()

    kv_bytes = results["pd_light"]["kv_bytes_per_request"]
    if kv_bytes and torch.cuda.is_available():
        from benchmarks.bench_kvtransfer import raw_ucxx_gbps

        results["link_gbs"] = raw_ucxx_gbps([int(kv_bytes)], "cuda:0", "cuda:0", 3)
        log(f"link: raw ucxx, one {kv_bytes / 1e6:.1f} MB message between two processes: "
            f"{results['link_gbs']:.1f} GB/s")
    light, load = results["pd_light"], results["pd_load"]
    if light["kv"]["p50"] and load["kv"]["p50"]:
        ratio = load["kv"]["p50"] / light["kv"]["p50"]
        log(f"CHECK loaded KV p50 / light KV p50 = {ratio:.2f} (target <= 2); fallbacks under load "
            f"{load['fallbacks']:.0f} (target 0)")
    if "colocated_light" in results and results.get("link_gbs"):
        colo_ttft = results["colocated_light"]["summary"]["ttft_p50"]
        pd_ttft = light["summary"]["ttft_p50"]
        bound = colo_ttft + kv_bytes / (results["link_gbs"] * 1e9) + 0.005
        log(f"CHECK PD TTFT p50 {pd_ttft * 1e3:.1f} ms <= colocated {colo_ttft * 1e3:.1f} ms + KV/link "
            f"{kv_bytes / (results['link_gbs'] * 1e9) * 1e3:.2f} ms + 5 ms = {bound * 1e3:.1f} ms: "
            f"{'met' if pd_ttft <= bound else 'MISSED'}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
