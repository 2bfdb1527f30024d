"""`pdserve plan`'s prediction against a real `pdserve up` of the configuration it chooses (CPU).

    python -m experiments.plan_vs_real [--profile P.json] [--gpus 2] \\
        [--slo-ttft 4 --slo-tpot 0.5] [--input-len fixed:128 --output-len fixed:32] [--requests 36]

1. The profile: `--profile`, else a committed CPU profile (experiments/profile-smollm2-cpu-*.json)
   measured on this CPU model with one thread by this engine's step version
   (pdserve/sim/profile_check.py), else one measured now with `pdserve profile`
   (a small grid around the workload's lengths, one torch thread, about 1-4 minutes).
2. The plan: `pdserve plan --gpus N` for loadgen's distributions (`--input-len`, `--output-len`,
   Poisson at `--plan-rate`); its best configuration and the rate it sized it at (the highest
   at which `--attainment` of the requests meet both SLOs).
3. The real run: `pdserve up` of that configuration (SmolLM2, the default model; one CPU and
   one torch thread per worker, as profiled; the plan's policy), then `pdserve-loadgen run`
   of `--requests` Poisson requests at the planned rate x `--load` (the same lengths, streaming
   completions, ignore_eos), then the cluster is stopped.
4. The prediction for exactly that run: the simulator (sim.plan.measure, what the planner
   sized with) replays the requests loadgen sent (their send times, the prompt tokens the
   server counted, their max_tokens) on the chosen configuration.

Printed: predicted vs measured goodput (rate x share within both SLOs), attainment, TTFT p50,
TPOT p50 and measured/predicted; `--out` gets the plan, the records and the table (JSON).

The CPU may be shared with other work, which the profile does not know of: the script prints
the load average, and how long the profiling process and the workers (the Ray actors of the
run) waited for a CPU while runnable (Linux schedstat: run-queue wait over run time plus wait),
so that a miss caused by contention can be told from one of the model.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from pdserve.loadgen.launcher import ServerProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", help="a `pdserve profile` JSON (default: a committed one of this CPU, else measure)")
    p.add_argument("--model", default=None, help="the model of the profile and the run (default: SmolLM2, the "
                   "default model; `random:smollm2-135m` has its shape where its weights are not installed)")
    p.add_argument("--gpus", type=int, default=2, help="the budget: workers, one CPU each (default 2)")
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.5)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--input-len", default="fixed:128")
    p.add_argument("--output-len", default="fixed:32")
    p.add_argument("--plan-rate", type=float, default=0.5, help="offered rate given to the plan (req/s)")
    p.add_argument("--load", type=float, default=1.0, help="the real run's rate over the planned rate (default 1)")
    p.add_argument("--requests", type=int, default=36)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--kv-cache-gib", type=float, default=0.3)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "plan_vs_real"))
    return p.parse_args(argv)


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def schedstat(pids) -> tuple[float, float]:
    """(seconds run on a CPU, seconds waited runnable for one) summed over the threads of `pids`."""
    run = wait = 0
    for pid in pids:
        for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            try:
                with open(task) as f:
                    r, w, _ = f.read().split()
            except (OSError, ValueError):
                continue
            run += int(r)
            wait += int(w)
    return run / 1e9, wait / 1e9


def session_workers(sid: int) -> list[int]:
    """The Ray worker actors in the process session `sid` (the `pdserve up` started with a new session)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:
                continue
            with open(stat[:-4] + "cmdline", "rb") as f:
                if b"WorkerActor" in f.read():
                    out.append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def wait_share(before: tuple[float, float], after: tuple[float, float]) -> dict:
    run, wait = after[0] - before[0], after[1] - before[1]
    return {"cpu_s": round(run, 1), "waited_s": round(wait, 1),
            "wait_share": round(wait / (run + wait), 3) if run + wait > 0 else None}


def model_flag(args) -> list[str]:
    return ["--model", args.model] if args.model else []


def pick_profile(args) -> str:
    if args.profile:
        return args.profile
    if args.model:  # the committed profiles are the default model's
        return measure_profile(args)
    from pdserve.router.placement.profiles import load_profile
    from pdserve.sim.profile_check import local_hardware, profile_problems

    here = f"{local_hardware('cpu')} (1 threads)"
    for path in sorted(glob.glob(os.path.join(REPO, "experiments", "profile-smollm2-cpu-*.json")), reverse=True):
        problems = profile_problems(load_profile(path), path=path, hardware=here)
        if not problems:  # this CPU, one thread, the current engine's step version
            print(f"profile: {path} (measured on this CPU, {here}, by this engine)", file=sys.stderr)
            return path
        print(f"profile: not {os.path.relpath(path, REPO)}: {problems[0].split(';')[0]}", file=sys.stderr)
    print(f"profile: none committed for {here}", file=sys.stderr)
    return measure_profile(args)


def measure_profile(args) -> str:
    out = os.path.join(args.out, "profile.json")
    print(f"profile: measuring one into {out}", file=sys.stderr)
    cmd = [PY, "-m", "pdserve.launcher.cli", "profile", "--device", "cpu", "--dtype", "float32", "--out", out,
           "--prefill-tokens", "16,32,64,128,256", "--decode-batches", "1,2,4,8,16,32,64",
           "--decode-contexts", "128,256",
           "--mixed", "--mixed-batches", "1,4,16", "--mixed-chunks", "32,64,128", "--mixed-context", "128",
           "--repeats", "3", "--decode-steps", "8", "-q", *model_flag(args)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = (0.0, 0.0)
    while proc.poll() is None:
        now = schedstat([proc.pid])
        last = now if now[0] > 0 else last
        time.sleep(1)
    if proc.returncode:
        raise RuntimeError(f"pdserve profile failed ({proc.returncode})")
    args.profile_contention = wait_share((0.0, 0.0), last)
    print(f"profile: measured waiting for a CPU {args.profile_contention['wait_share']:.0%} of its runnable time",
          file=sys.stderr)
    return out


def run_plan(args, profile: str) -> dict:
    cmd = [PY, "-m", "pdserve.launcher.cli", "plan", "--gpus", str(args.gpus), "--profile", profile, "--slo-ttft",
           str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot), "--attainment", str(args.attainment),
           "--rate", str(args.plan_rate), "--input-len", args.input_len, "--output-len", args.output_len, "--json"]
    print("plan:", " ".join(cmd[2:]), file=sys.stderr)
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def up_command(best: dict, policy: str, args) -> list[str]:
    cmd = [PY, "-m", "pdserve.launcher.cli", "up", "--device", "cpu", "--dtype", "float32", "--worker-cpus", "1",
           "--port", str(args.port), "--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", "1024",
           "--max-num-batched-tokens", "512", "--cluster-name", "planvr", "--namespace", "pdserve-plan-vs-real",
           *model_flag(args)]
    if best["mode"] == "disaggregated":
        cmd += ["--prefill", str(best["prefill"]), "--decode", str(best["decode"]), "--policy", policy]
    else:
        cmd += ["--mode", best["mode"], "--replicas", str(best["mixed"]),
                "--policy", "network-aware" if best["mode"] == "hybrid" else policy]
    return cmd


def start_cluster(cmd: list[str], args) -> ServerProcess:
    """`cmd` (a `pdserve up` command line) as a process group of its own; once /health answers 200."""
    from experiments import faultlib

    log_path = os.path.join(args.out, "up.log")
    print("up:", " ".join(cmd[2:]), file=sys.stderr)
    up = faultlib.up_process(cmd[4:], f"http://127.0.0.1:{args.port}", log_path, env={"OMP_NUM_THREADS": "1"},
                             startup_timeout_s=600, shutdown_timeout_s=60, poll_interval_s=2)
    return up.launch()


def stop_cluster(up: ServerProcess) -> None:
    up.stop()


def run_load(args, rate: float) -> tuple[dict, list[dict]]:
    out = os.path.join(args.out, "loadgen")
    cmd = [PY, "-m", "pdserve.loadgen.cli", "run", "--url", f"http://127.0.0.1:{args.port}",
           "--endpoint", "completions", "--arrival", "poisson", "--rate", f"{rate:.4f}",
           "--num-requests", str(args.requests), "--seed", str(args.seed), "--input-len", args.input_len,
           "--output-len", args.output_len, "--ignore-eos",
           "--temperature", "0", "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
           "--output", out, "--no-progress", "--timeout", "300"]
    print("loadgen:", " ".join(cmd[2:]), file=sys.stderr)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "records.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return summary, records


def predict(best: dict, plan: dict, profile: str, records: list[dict], args):
    """The simulator's run of the requests loadgen sent, on the chosen configuration."""
    from pdserve.router.placement.profiles import load_profile
    from pdserve.sim.config import ClusterConfig, WorkerConfig
    from pdserve.sim.plan import SLOs, Candidate, measure
    from pdserve.sim.run import Arrival

    base = ClusterConfig(profile=load_profile(profile), workers=(WorkerConfig("w", "mixed"),), profile_path=profile)
    candidate = Candidate(best["mode"], best["prefill"], best["decode"], best["mixed"])
    records = sorted(records, key=lambda r: r["scheduled_s"])
    t0 = records[0]["scheduled_s"]
    arrivals = [Arrival(r["scheduled_s"] - t0, int(r.get("prompt_tokens") or r["prompt_tokens_est"]),
                        int(r["max_tokens"]), int(r["prompt_tokens_est"])) for r in records]
    policy = "network-aware" if best["mode"] == "hybrid" else plan["policy"]
    return measure(candidate.cluster(base), policy, arrivals, SLOs(args.slo_ttft, args.slo_tpot, args.attainment),
                   seed=args.seed), arrivals


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(f"load average at the start: {loadavg()} ({os.cpu_count()} cores)", file=sys.stderr)
    profile = pick_profile(args)
    plan = run_plan(args, profile)
    best = plan["best"]
    rate = best["rate_rps"] * args.load
    if rate <= 0:
        print(f"plan: no configuration meets the SLOs at any rate with this profile ({profile}); loosen "
              "--slo-ttft/--slo-tpot or profile on a less busy machine", file=sys.stderr)
        return 1
    print(f"plan: {best['config']} ({best['mode']}), sized at {best['rate_rps']} req/s, goodput "
          f"{best['goodput_rps']} req/s; the real run at {rate:.3f} req/s", file=sys.stderr)
    proc = start_cluster(up_command(best, plan["policy"], args), args)
    try:
        workers = session_workers(proc.pid)
        before, load_before = schedstat(workers), loadavg()
        summary, records = run_load(args, rate)
        contention = {"workers": len(workers), "loadavg_before": load_before,
                      **wait_share(before, schedstat(workers))}
    finally:
        stop_cluster(proc)
    after = loadavg()
    m, arrivals = predict(best, plan, profile, records, args)
    sent_rate = (len(arrivals) - 1) / (arrivals[-1].offset_s - arrivals[0].offset_s)
    real = {"attainment": summary["slo_attainment"], "ttft_p50": summary["ttft_p50"], "tpot_p50": summary["tpot_p50"]}
    pred = {"attainment": m.attainment, "ttft_p50": m.ttft_p50, "tpot_p50": m.tpot_p50}
    real["goodput"], pred["goodput"] = sent_rate * real["attainment"], sent_rate * pred["attainment"]
    rows = []
    for key, unit in (("goodput", "req/s"), ("attainment", ""), ("ttft_p50", "s"), ("tpot_p50", "s")):
        ratio = real[key] / pred[key] if pred[key] else float("nan")
        rows.append({"metric": key, "unit": unit, "predicted": pred[key], "measured": real[key], "ratio": ratio,
                     "within_10pct": abs(ratio - 1) <= 0.10})
    result = {"profile": profile, "plan": plan, "rate_rps": sent_rate, "requests": len(records),
              "errors": summary["num_errors"], "loadavg_after": after, "rows": rows,
              "run_contention": contention, "profile_contention": getattr(args, "profile_contention", None),
              "planner_at_its_rate": {k: best.get(k) for k in ("rate_rps", "goodput_rps", "attainment", "ttft_p50_s",
                                                               "tpot_p50_s")},
              "mean_prompt_tokens": sum(a.prompt_tokens for a in arrivals) / len(arrivals)}
    with open(os.path.join(args.out, "plan_vs_real.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{best['config']} ({best['mode']}) at {sent_rate:.3f} req/s, {len(records)} requests "
          f"({summary['num_errors']} errors), mean prompt {result['mean_prompt_tokens']:.0f} tokens; "
          f"load average before/after: {contention['loadavg_before']} / {after}")
    print(f"the {contention['workers']} workers ran {contention['cpu_s']} CPU-s and waited {contention['waited_s']} s "
          f"for a CPU ({contention['wait_share']:.0%} of their runnable time)"
          + (f"; the profile waited {args.profile_contention['wait_share']:.0%}"
             if getattr(args, "profile_contention", None) else ""))
    print(f"{'metric':<12}{'predicted':>12}{'measured':>12}{'ratio':>8}  within 10%")
    for r in rows:
        print(f"{r['metric']:<12}{r['predicted']:>12.4f}{r['measured']:>12.4f}{r['ratio']:>8.2f}  "
              f"{'yes' if r['within_10pct'] else 'NO'}")
    print(f"record: {os.path.join(args.out, 'plan_vs_real.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
