"""The `pdserve plan` command: flags, the workload and the cluster from them, a table or JSON.

    pdserve plan --gpus 64 --slo-ttft 4 --slo-tpot 0.2 --cluster experiments/sim/headline-cluster.yaml \\
                 --trace experiments/plan/azure-code-synthetic.csv [--rate 20] [--json]
    pdserve plan --gpus 8 --slo-ttft 4 --slo-tpot 0.2 --profile P.json [--topology T.yaml] \\
                 --rate 2 --input-len uniform:300:700 --output-len uniform:50:150

The search is pdserve/sim/plan.py's. Errors are ValueError naming the flag or the file (the CLI prints
one line and exits 2); a profile older than the engine or from other hardware is a warning, or
an error with --strict-profile (pdserve/sim/profile_check.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from pdserve.loadgen.datasets import LengthDist


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from pdserve.sim.cli import add_profile_check_args

    p.add_argument("--gpus", type=_positive_int, required=True, help="the GPU budget (one worker a GPU)")
    p.add_argument("--slo-ttft", type=_positive_float("--slo-ttft"), required=True, help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=_positive_float("--slo-tpot"), required=True, help="TPOT SLO, seconds")
    p.add_argument("--attainment", type=_positive_float("--attainment"), default=0.9,
                   help="share of requests within both SLOs a configuration must keep (default 0.9)")
    c = p.add_argument_group("cluster (the profile, the links, the engine limits)")
    c.add_argument("--cluster", metavar="FILE", help="a pdserve-sim cluster file (pdserve/sim/config.py); its workers "
                                                    "are replaced by each candidate's")
    c.add_argument("--profile", metavar="FILE", help="`pdserve profile` JSON (overrides the cluster file's)")
    c.add_argument("--topology", metavar="FILE", help="the router's topology YAML: nodes and links (overrides "
                                                     "the cluster file's); candidates' workers take its nodes in turn")
    c.add_argument("--policy", default="least-loaded",
                   help="placement policy of disaggregated and colocated candidates (default least-loaded; "
                        "hybrid candidates use network-aware, which chooses per request)")
    add_profile_check_args(c)
    w = p.add_argument_group("workload: a trace, or loadgen's distributions")
    w.add_argument("--trace", metavar="FILE", help="Azure CSV, Mooncake JSONL or BurstGPT CSV (loadgen.arrivals)")
    w.add_argument("--trace-format", choices=["azure", "mooncake", "burstgpt"], help="default: from the file")
    w.add_argument("--trace-requests", type=_positive_int, default=20000, metavar="N",
                   help="read at most this many requests of the trace (default 20000)")
    w.add_argument("--rate", type=_positive_float("--rate"),
                   help="offered mean rate, req/s (a trace is rescaled to it; required without --trace)")
    w.add_argument("--input-len", type=_length, default=None, metavar="DIST",
                   help="prompt tokens: fixed:N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEAN:SIGMA")
    w.add_argument("--output-len", type=_length, default=None, metavar="DIST", help="output tokens (as --input-len)")
    w.add_argument("--burstiness", type=_positive_float("--burstiness"), default=1.0,
                   help="gamma arrivals' shape (1: Poisson; lower: burstier)")
    w.add_argument("--seed", type=int, default=0, help="draws of the distributions and of seeded policies")
    s = p.add_argument_group("search")
    s.add_argument("--simulate-top", type=_positive_int, default=4, metavar="K",
                   help="simulate the K P:D splits the model ranks best (plus 1:1, colocated, hybrid; default 4)")
    s.add_argument("--requests-per-gpu", type=_positive_int, default=20, metavar="N",
                   help="simulated requests a run per simulated GPU (default 20)")
    s.add_argument("--max-requests", type=_positive_int, default=2400, metavar="N",
                   help="at most this many simulated requests a run (default 2400)")
    s.add_argument("--max-splits", type=_positive_int, default=64, metavar="N",
                   help="P:D splits considered at most (large budgets step the prefill count; default 64)")
    s.add_argument("--mode", action="append", choices=["disaggregated", "colocated", "hybrid"],
                   help="only these modes (repeatable; default all three)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=_positive_int, default=5, help="configurations in the table (default 5)")
    o.add_argument("--json", action="store_true", help="the whole plan as JSON on stdout")


def build_workload(args: argparse.Namespace):
    from pdserve.sim.plan import Workload, distribution_workload
    from pdserve.sim.workload import trace_arrivals

    if args.trace:
        if args.input_len is not None or args.output_len is not None:
            raise ValueError("--input-len/--output-len: not with --trace (the trace has the lengths)")
        try:
            arrivals = trace_arrivals(args.trace, args.trace_format, rate=args.rate, max_requests=args.trace_requests)
        except FileNotFoundError:
            raise ValueError(f"--trace: {args.trace}: no such file") from None
        return Workload(tuple(arrivals), name=f"trace {args.trace}" + (f" at {args.rate:g} req/s" if args.rate else ""))
    missing = [f for f, v in (("--rate", args.rate), ("--input-len", args.input_len),
                              ("--output-len", args.output_len)) if v is None]
    if missing:
        raise ValueError(f"{missing[0]}: required without --trace (give --trace FILE, or --rate, --input-len "
                         "and --output-len)")
    return distribution_workload(args.rate, args.input_len, args.output_len, seed=args.seed,
                                 burstiness=args.burstiness)


def build_base(args: argparse.Namespace):
    from pdserve.router.placement.profiles import load_profile
    from pdserve.router.placement.topology import load_topology
    from pdserve.sim.config import ClusterConfig, WorkerConfig, load_cluster

    if not args.cluster and not args.profile:
        raise ValueError("--profile: required without --cluster (a `pdserve profile` JSON)")
    if args.cluster:
        try:
            base = load_cluster(args.cluster)
        except ValueError as e:
            raise ValueError(f"--cluster: {e}") from None
    else:
        base = None
    if args.profile:
        try:
            profile = load_profile(args.profile)
        except ValueError as e:
            raise ValueError(f"--profile: {e}") from None
        base = (replace(base, profile=profile, profile_path=args.profile, decode_profile=None, decode_profile_path="")
                if base is not None else
                ClusterConfig(profile=profile, workers=(WorkerConfig("w", "mixed"),), profile_path=args.profile))
    if args.topology:
        try:
            base = replace(base, topology=load_topology(args.topology))
        except ValueError as e:
            raise ValueError(f"--topology: {e}") from None
    return base


def format_table(plan, top: int) -> str:
    head = ["#", "config", "mode", "P", "D", "mixed", "GPUs", "rate req/s", "goodput req/s", "goodput/GPU",
            "attain", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"]
    rows = []
    for i, e in enumerate([e for e in plan.evaluations if e.simulated][:top], 1):
        c, m = e.candidate, e.at
        cells = [str(i), c.label, c.mode, str(c.prefill), str(c.decode), str(c.mixed), str(c.gpus),
                 f"{e.rate:.3f}", f"{e.goodput:.3f}", f"{e.goodput_per_gpu:.4f}"]
        cells += ([f"{m.attainment:.0%}", f"{m.ttft_p50:.2f}s", f"{m.ttft_p90:.2f}s", f"{m.tpot_p50 * 1e3:.0f}ms",
                   f"{m.tpot_p90 * 1e3:.0f}ms"] if m is not None else ["-"] * 5)
        rows.append(cells)
    widths = [max(len(r[j]) for r in [head] + rows) for j in range(len(head))]
    fmt = lambda r: "  ".join(v.rjust(w) if j >= 3 else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    best = plan.best
    c = best.candidate
    lines = [f"plan: {plan.gpus} GPUs, SLOs TTFT <= {plan.slos.ttft_s:g} s and TPOT <= {plan.slos.tpot_s * 1e3:g} ms "
             f"for {plan.slos.attainment:.0%} of requests; workload: {plan.workload} "
             f"(offered {plan.offered_rate:.3g} req/s); searched in {plan.wall_s:.1f} s",
             f"best: {c.label} ({c.mode}: {c.prefill} prefill, {c.decode} decode, {c.mixed} mixed workers), "
             f"{best.goodput_per_gpu:.4f} req/s of goodput per GPU"]
    if best.goodput_per_gpu <= 0:
        lines.append(f"no configuration keeps {plan.slos.attainment:.0%} of the requests within the SLOs at any "
                     "simulated rate: loosen the SLOs or measure faster hardware")
    else:
        need = math.ceil(plan.offered_rate / best.goodput_per_gpu) if math.isfinite(plan.offered_rate) else None
        if need is not None:
            lines.append(f"the offered {plan.offered_rate:.3g} req/s needs about {need} GPUs in this shape"
                         + (" (within the budget)" if need <= plan.gpus else f" (over the budget of {plan.gpus})"))
    lines += ["", fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    lines += ["", "why the others lose:"]
    lines += [f"  {e.candidate.label}: {e.reason}" for e in plan.evaluations[1:]]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    from pdserve.sim.plan import SLOs, PlanOptions, plan
    from pdserve.sim.profile_check import check_profiles, cluster_profiles

    slos = SLOs(args.slo_ttft, args.slo_tpot, args.attainment)
    base = build_base(args)
    for line in check_profiles(cluster_profiles(base), hardware=args.hardware or base.hardware,
                               strict=args.strict_profile):
        print(f"pdserve: warning: {line}", file=sys.stderr)
    workload = build_workload(args)
    options = PlanOptions(policy=args.policy, simulate_top=args.simulate_top, requests_per_gpu=args.requests_per_gpu,
                          max_requests=args.max_requests, max_splits=args.max_splits, seed=args.seed,
                          min_requests=min(240, args.max_requests),
                          modes=tuple(args.mode) if args.mode else PlanOptions().modes)
    from pdserve.router.placement.registry import POLICIES

    if args.policy not in POLICIES:
        raise ValueError(f"--policy: unknown policy {args.policy!r}; known: {', '.join(POLICIES)}")
    progress = None if args.json else (lambda label: print(f"simulating {label} ...", file=sys.stderr, flush=True))
    result = plan(base, workload, slos, args.gpus, options=options, progress=progress)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result, args.top))
    return 0
