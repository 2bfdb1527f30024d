"""A local PD cluster with a paced KV link per (prefill, decode) pair, whose link rates and
placement policy change between experiment runs without reloading any model.

Where `pdserve.launcher.emulation` shapes links between network namespaces (KV over TCP), this keeps
every worker on the host network so that UCX picks its fastest transport (CUDA IPC between
GPUs, shared memory on a CPU), which `tc` cannot shape. Each prefill worker paces its own KV
sends per destination with a token bucket whose rates it re-reads from a file
(kvtransfer.pacing_spec, `file:PATH`), so a link's rate is real and switches at once.

    python -m pdserve.launcher.paced workers --state DIR --model M --prefill 2 --decode 2 [--gpus 0,1] [-- worker flags]
    python -m pdserve.launcher.paced router --state DIR --policy P --bandwidth GBPS --port N \
        [--slow p1:d1 --slow-factor 0.1]

1. `workers` starts the workers as standalone processes (`pdserve worker`, built by
   launcher.workers; prefill ones with `--kv-pacing file:DIR/pacing-<id>.txt`); pair i (prefill i,
   decode i) runs on GPU `gpus[i % len(gpus)]`, so with fewer GPUs than workers they share one.
   Every worker sees all of `gpus` in the same order (CUDA_VISIBLE_DEVICES) and computes on its
   own with `--device cuda:<i>`, so that UCX's cuda_ipc can map a peer GPU's memory for KV
   between pairs on different GPUs (the order that `pdserve up` on Ray uses too, and the one the
   GPU grid of docs/experiments.md ran on two GPUs). It saves the router's tokenizer,
   waits until every worker listens, writes DIR/cluster.json, samples GPU utilisation into
   DIR/gpu_samples.csv (launcher.gpu_sampler) and serves until SIGTERM or SIGINT, then stops the
   workers (which also get SIGTERM if the launcher dies).
2. `router` (one per experiment configuration: the loadgen launch command) sets every pair's
   link to `--bandwidth` Gbit/s (the `--slow` pairs to bandwidth x `--slow-factor`): it rewrites
   the prefill workers' pacing files, writes the router topology with the same SET rates,
   appends them to DIR/links.jsonl, then becomes `pdserve router` (exec) with `--policy`. The
   profile and SLO flags go to the network-aware policy only (the baselines reject them).

The workers and the router share a cluster token (DIR/token, mode 0600).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pdserve import environment
from pdserve.kvtransfer.pacing_spec import link_address, parse_pacing
from pdserve.launcher.workers import WorkerSpec, worker_argv, worker_env
from pdserve.loadgen.launcher import free_port

CLUSTER_FILE = "cluster.json"
LINKS_FILE = "links.jsonl"
GPU_SAMPLES_FILE = "gpu_samples.csv"
PROFILED_POLICIES = ("network-aware",)  # the policies that take --profile and --slo-*


class PacedError(RuntimeError):
    """A paced cluster that cannot start or be configured; the message says why."""


# ---- link rates ---------------------------------------------------------------------------

def parse_pairs(texts: list[str], cluster: dict) -> set[tuple[str, str]]:
    """`["p1:d1", ...]` -> {(prefill id, decode id)}; PacedError names a bad entry."""
    roles = {w["id"]: w["role"] for w in cluster["workers"]}
    pairs = set()
    for text in texts:
        p, sep, d = text.partition(":")
        if not sep or roles.get(p) != "prefill" or roles.get(d) != "decode":
            known = ", ".join(f"{w['id']} ({w['role']})" for w in cluster["workers"])
            raise PacedError(f"--slow {text!r}: expected PREFILL_ID:DECODE_ID of this cluster's workers: {known}")
        pairs.add((p, d))
    return pairs


def link_rates(cluster: dict, bandwidth: float, slow: set[tuple[str, str]], slow_factor: float) -> dict[str, float]:
    """`"p->d"` -> SET Gbit/s of every (prefill, decode) pair."""
    if not (bandwidth > 0 and bandwidth != float("inf")):
        raise PacedError(f"--bandwidth must be > 0 Gbit/s, got {bandwidth!r}")
    if not 0 < slow_factor <= 1:
        raise PacedError(f"--slow-factor must be in (0, 1], got {slow_factor!r}")
    rates = {}
    for p in (w for w in cluster["workers"] if w["role"] == "prefill"):
        for d in (w for w in cluster["workers"] if w["role"] == "decode"):
            rates[f"{p['id']}->{d['id']}"] = bandwidth * (slow_factor if (p["id"], d["id"]) in slow else 1.0)
    return rates


def pacing_text(cluster: dict, prefill_id: str, rates: dict[str, float], burst: str | None = None) -> str:
    """The pacing spec of one prefill worker: one entry per decode worker's KV address, without
    its incarnation (``#id``: the pacer matches an address's base too, and a spec takes HOST:PORT)."""
    kv = {w["id"]: link_address(w["kv"]) for w in cluster["workers"] if w["role"] == "decode"}
    entries = [f"{kv[d]}={rates[f'{prefill_id}->{d}']:g}" for d in sorted(kv)]
    return ",".join(entries + ([f"burst={burst}"] if burst else []))


def topology_document(cluster: dict, rates: dict[str, float]) -> dict:
    """pdserve/router/placement/topology.py's YAML: a node per worker, a directional link per pair at its SET rate."""
    links = []
    for key, gbps in rates.items():
        src, dst = key.split("->")
        links.append({"from": src, "to": dst, "gbps": gbps})
    return {"workers": {w["id"]: w["id"] for w in cluster["workers"]}, "links": links}


def apply_links(state: Path, cluster: dict, rates: dict[str, float], label: dict, burst: str | None = None) -> Path:
    """Rewrites every prefill worker's pacing file and the topology; returns the topology path."""
    for w in cluster["workers"]:
        if w["role"] == "prefill":
            path = state / w["pacing_file"]
            tmp = path.with_suffix(".tmp")
            text = pacing_text(cluster, w["id"], rates, burst)
            parse_pacing(text)  # a bad --burst fails here, not in the worker
            tmp.write_text(f"# {json.dumps(label)}\n{text}\n")
            os.replace(tmp, path)  # the worker never reads half a file
    topology = state / "topology.yaml"
    topology.write_text(yaml.safe_dump(topology_document(cluster, rates), sort_keys=False))
    with open(state / LINKS_FILE, "a") as f:
        f.write(json.dumps(label | {"time_unix": time.time(), "links": rates}) + "\n")
    return topology


def load_cluster(state: Path) -> dict:
    path = state / CLUSTER_FILE
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise PacedError(f"{path}: cannot read ({e.strerror or e}); start `python -m pdserve.launcher.paced workers "
                         f"--state {state}` first") from None


def check_alive(cluster: dict, state: Path) -> None:
    """PacedError naming the workers whose process is gone, so that a router is not started (and
    waited for) over a dead cluster."""
    dead = []
    for w in cluster["workers"]:
        try:
            os.kill(int(w["pid"]), 0)
        except ProcessLookupError:
            dead.append(w["id"])
        except (PermissionError, KeyError, TypeError, ValueError):
            pass  # another user's process, or no pid recorded: the router's health check decides
    if dead:
        raise PacedError(f"worker(s) {', '.join(dead)} not running; their logs are in {state}")


def router_argv(cluster: dict, args: argparse.Namespace, topology: Path) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.launcher.cli", "--log-level", args.log_level, "router",
            "--model", cluster["model"], "--policy", args.policy, "--host", args.host, "--port", str(args.port),
            "--topology", str(topology), "--kv-deadline-s", f"{args.kv_deadline_s:g}",
            "--kv-wire-precision", args.kv_wire_precision]
    if cluster.get("tokenizer"):  # saved once by `workers`: loads in a fraction of a second, not seconds
        argv += ["--tokenizer", str(Path(args.state) / cluster["tokenizer"])]
    for w in cluster["workers"]:
        argv += ["--worker", f"{w['role']}#{w['id']}@{w['id']}={w['grpc']}"]
    if args.policy in PROFILED_POLICIES:
        if args.profile is None:
            raise PacedError(f"--profile: {args.policy} needs a `pdserve profile` JSON")
        argv += ["--profile", args.profile]
        argv += ["--slo-ttft", f"{args.slo_ttft:g}"] if args.slo_ttft is not None else []
        argv += ["--slo-tpot", f"{args.slo_tpot:g}"] if args.slo_tpot is not None else []
        argv += ["--no-local-prefill"] if args.no_local_prefill else []
    return argv


def run_router(args: argparse.Namespace) -> int:
    from pdserve.proto.auth import TOKEN_ENV

    state = Path(args.state)
    cluster = load_cluster(state)
    check_alive(cluster, state)
    rates = link_rates(cluster, args.bandwidth, parse_pairs(args.slow, cluster), args.slow_factor)
    try:
        topology = apply_links(state, cluster, rates, {"policy": args.policy, "bandwidth_gbps": args.bandwidth},
                               args.burst)
    except ValueError as e:
        raise PacedError(f"--burst {args.burst}: {e}") from None
    argv = router_argv(cluster, args, topology)
    env = environment.child_env({TOKEN_ENV: (state / cluster["token_file"]).read_text().strip()})
    print(f"pdserve.launcher.paced: links {rates}; {args.policy} router on {args.host}:{args.port}",
          file=sys.stderr, flush=True)
    os.execve(sys.executable, argv, env)  # the router is this process: the harness stops it
    return 0  # not reached


# ---- workers ------------------------------------------------------------------------------

def plan_workers(prefill: int, decode: int, gpus: list[str]) -> list[dict]:
    """Worker ids, roles, GPUs, CUDA_VISIBLE_DEVICES (all of `gpus`, the same for every worker)
    and the torch device: pair i (p<i>, d<i>) on gpus[i % len(gpus)] (None: no GPU)."""
    if prefill < 1 or decode < 1:
        raise PacedError(f"need at least one prefill and one decode worker, got --prefill {prefill} --decode {decode}")
    plan = []
    for role, n, prefix in (("prefill", prefill, "p"), ("decode", decode, "d")):
        for i in range(n):
            gpu = gpus[i % len(gpus)] if gpus else None
            visible = ",".join(gpus) if gpu is not None else None
            device = f"cuda:{i % len(gpus)}" if gpu is not None else None
            plan.append({"id": f"{prefix}{i}", "role": role, "gpu": gpu, "visible_devices": visible,
                         "device": device})
    return plan


def worker_spec(w: dict, model: str, port: int, state: Path, extra: list[str], token: str | None = None) -> WorkerSpec:
    """A planned worker (`plan_workers`) on 127.0.0.1:`port`; a prefill worker paces its KV sends
    from its pacing file. `extra`: further worker flags (they win over the plan's --device)."""
    pacing = f"file:{state / w['pacing_file']}" if w["role"] == "prefill" else None
    return WorkerSpec(role=w["role"], worker_id=w["id"], host="127.0.0.1", port=port, model=model,
                      device=w.get("device"), kv_pacing=pacing, engine_args=tuple(extra),
                      visible_devices=w.get("visible_devices"), cluster_token=token)


def save_tokenizer(model: str, directory: Path) -> str | None:
    """The router's tokenizer of `model`, saved as a Hugging Face directory (routers started per
    configuration then skip the GGUF conversion); None, with a note, when it cannot be saved."""
    from pdserve.launcher.cluster.serving import load_router_model

    try:
        load_router_model(model).tokenizer.hf_tokenizer.save_pretrained(str(directory))
    except Exception as e:  # noqa: BLE001 - the router then loads the model's own, only slower
        print(f"pdserve.launcher.paced: routers will load {model}'s tokenizer themselves ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
        return None
    return directory.name


def _die_with_parent() -> None:
    """In the worker (preexec_fn): SIGTERM when the launcher dies, however it dies (Linux), so that
    no worker outlives it holding a GPU."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _listening(log: Path) -> tuple[str, str] | None:
    """(grpc address, kv address) from a worker's `listening on` line."""
    for line in log.read_text(errors="replace").splitlines():
        if " listening on " in line:
            parts = line.split(" listening on ", 1)[1].split()
            kv = next((p[3:] for p in parts[1:] if p.startswith("kv=")), "")
            return parts[0], kv
    return None


def run_workers(args: argparse.Namespace, extra: list[str]) -> int:
    from pdserve.launcher.gpu_sampler import GpuSampler
    from pdserve.proto.auth import new_token

    state = Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    gpus = [g for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    plan = plan_workers(args.prefill, args.decode, gpus)
    token = new_token()
    token_path = state / "token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    for stale in (CLUSTER_FILE, LINKS_FILE):
        (state / stale).unlink(missing_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    stopping = {"now": False}

    def stop(signum, frame):
        stopping["now"] = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sampler = None
    try:
        for w in plan:
            w["port"] = free_port()
            if w["role"] == "prefill":
                w["pacing_file"] = f"pacing-{w['id']}.txt"
                (state / w["pacing_file"]).write_text(f"default={args.initial_gbps:g}\n")
            spec = worker_spec(w, args.model, w["port"], state, extra, token)
            with open(state / f"{w['id']}.log", "wb") as log:
                procs[w["id"]] = subprocess.Popen(worker_argv(spec), env=dict(os.environ) | worker_env(spec),
                                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                  preexec_fn=_die_with_parent)
        tokenizer = save_tokenizer(args.model, state / "tokenizer")  # while the workers load
        deadline = time.monotonic() + args.startup_timeout_s
        pending = {w["id"] for w in plan}
        while pending:
            if stopping["now"]:
                return 130
            for w in plan:
                if w["id"] not in pending:
                    continue
                found = _listening(state / f"{w['id']}.log")
                if found:
                    w["grpc"], w["kv"] = found
                    pending.discard(w["id"])
                elif procs[w["id"]].poll() is not None:
                    raise PacedError(f"worker {w['id']} exited with {procs[w['id']].returncode} while starting; "
                                     f"log {state / (w['id'] + '.log')}")
            if pending and time.monotonic() > deadline:
                raise PacedError(f"workers {sorted(pending)} not up after {args.startup_timeout_s:g}s; logs in {state}")
            time.sleep(0.5)
        for w in plan:
            w["pid"] = procs[w["id"]].pid
            if w["role"] == "decode" and not w["kv"].startswith(("ucx://", "nixl://")):
                raise PacedError(f"decode worker {w['id']} has no UCX or NIXL KV address ({w['kv']!r}); "
                                 "pacing needs one")
        sampler = GpuSampler(state / GPU_SAMPLES_FILE, {w["pid"]: w["id"] for w in plan}, args.sample_interval_s)
        sampler.start()
        cluster = {"model": args.model, "token_file": "token", "tokenizer": tokenizer, "workers": plan,
                   "started_unix": time.time(),
                   "gpu_samples": GPU_SAMPLES_FILE if sampler.available else None}
        (state / (CLUSTER_FILE + ".tmp")).write_text(json.dumps(cluster, indent=2))
        os.replace(state / (CLUSTER_FILE + ".tmp"), state / CLUSTER_FILE)
        print(f"pdserve.launcher.paced: {len(plan)} workers up: "
              + ", ".join(f"{w['id']}@{w['grpc']} gpu {w['gpu']}" for w in plan), file=sys.stderr, flush=True)
        while not stopping["now"]:
            dead = [wid for wid, p in procs.items() if p.poll() is not None]
            if dead:
                raise PacedError(f"worker(s) {dead} exited; logs in {state}")
            time.sleep(0.5)
        return 0
    finally:
        if sampler is not None:
            sampler.stop()
        _stop_all(procs)


def _stop_all(procs: dict[str, subprocess.Popen], grace_s: float = 20.0) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- command line -------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launcher.paced", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("workers", help="start the workers and serve until SIGTERM (flags after -- go to each worker)")
    w.add_argument("--state", required=True, metavar="DIR", help="where cluster.json, logs and pacing files go")
    w.add_argument("--model", required=True)
    w.add_argument("--prefill", type=int, default=2)
    w.add_argument("--decode", type=int, default=2)
    w.add_argument("--gpus", default="", help="GPU indices, comma-separated; pair i on gpus[i %% n] (empty: none)")
    w.add_argument("--initial-gbps", type=float, default=100.0, help="link rate until a router sets it")
    w.add_argument("--startup-timeout-s", type=float, default=600.0)
    w.add_argument("--sample-interval-s", type=float, default=1.0, help="GPU utilisation sampling period")
    r = sub.add_parser("router", help="set the link rates, then run the router (exec)")
    r.add_argument("--state", required=True, metavar="DIR")
    r.add_argument("--policy", required=True)
    r.add_argument("--bandwidth", type=float, required=True, help="Gbit/s of every pair but the --slow ones")
    r.add_argument("--slow", action="append", default=[], metavar="P:D", help="a slow pair (repeatable)")
    r.add_argument("--slow-factor", type=float, default=0.1, help="slow pairs get bandwidth x this")
    r.add_argument("--burst", default=None, metavar="BYTES",
                   help="token bucket depth of every link, e.g. 64KiB (default 1MiB); keep it well under one "
                        "request's KV, or the first part of each transfer is not paced")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--profile", default=None, help="`pdserve profile` JSON (network-aware only)")
    r.add_argument("--slo-ttft", type=float, default=None)
    r.add_argument("--slo-tpot", type=float, default=None)
    r.add_argument("--kv-deadline-s", type=float, default=10.0)
    r.add_argument("--no-local-prefill", action="store_true",
                   help="network-aware: a feasible pair always wins over prefill on the decode worker")
    r.add_argument("--kv-wire-precision", choices=("auto", "full", "fp8"), default="auto",
                   help="the KV's precision on the wire: auto (the policy's, per request), full or fp8")
    r.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args = parser.parse_args(argv[:split])
    try:
        if args.command == "workers":
            return run_workers(args, argv[split + 1:])
        if split != len(argv):
            parser.error("router takes no flags after --")
        return run_router(args)
    except PacedError as e:
        print(f"pdserve.launcher.paced: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
