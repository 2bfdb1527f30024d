"""The `pdserve` command line. Errors are one line on stderr naming the bad flag or file."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdserve import environment
from pdserve.launcher.token_args import add_cluster_token_arg, cluster_token
from pdserve.launcher.workers import add_worker_args
from pdserve.engine_args import ENGINE_DEFAULTS, add_engine_args, engine_config, engine_kwargs, float_arg, int_arg
from pdserve.engine_args import add_tensor_parallel_arg, positive_int_arg

__all__ = ["ENGINE_DEFAULTS", "add_engine_args", "build_parser", "engine_config", "engine_kwargs", "main"]


API_KEY_ENV = "PDSERVE_API_KEY"


class CliError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """Errors are one line naming the flag, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"pdserve: error: {message}\n")


def _json_resources(flag: str):
    def parse(text: str) -> dict:
        import json

        from pdserve.launcher.cluster.config import check_resources

        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"node_a\": 1}}' ({e.msg})") from None
        try:
            return check_resources(flag, value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None
    return parse


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop or ()))
    except ValueError as e:
        flag = str(e).split(" ", 1)[0].replace("_", "-")
        raise CliError(f"--{flag}: {e}") from None
    llm = LLM(**engine_kwargs(args))
    start = time.perf_counter()
    try:
        if args.raw or llm.tokenizer is None or not llm.tokenizer.has_chat_template:
            out = llm.generate([args.prompt], params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    finally:
        llm.close()
    elapsed = time.perf_counter() - start
    print(out.text)
    if args.verbose:
        print(f"[{len(out.token_ids)} tokens in {elapsed:.2f}s, finish_reason={out.finish_reason}, "
              f"token ids={out.token_ids}]", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.launcher.cluster.config import load_up_config
    from pdserve.launcher.cluster.up import run_up

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "log_level", "config")}
    if "api_key" not in flags and environment.get(API_KEY_ENV):
        flags["api_key"] = environment.get(API_KEY_ENV)
    config = load_up_config(flags, args.config)
    return run_up(config, log_level=args.log_level)


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.launcher.cluster.standalone import run_worker
    from pdserve.launcher.workers import spec_from_args, worker_config

    spec = spec_from_args(args)  # ValueError naming the flag
    return run_worker(worker_config(spec, engine_config(args, args.role)))


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.launcher.cluster.serving import RouterSettings
    from pdserve.launcher.cluster.standalone import run_router

    if not 1 <= args.port <= 65535:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    if not args.kv_deadline_s > 0:
        raise CliError(f"--kv-deadline-s must be > 0, got {args.kv_deadline_s}")
    if not args.worker_wait_s >= 0:
        raise CliError(f"--worker-wait-s must be >= 0, got {args.worker_wait_s}")
    if args.max_model_len is not None and args.max_model_len <= 0:
        raise CliError(f"--max-model-len must be > 0, got {args.max_model_len}")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise CliError(f"--max-tokens-default must be >= 1, got {args.max_tokens_default}")
    if args.max_queued_requests < 1:
        raise CliError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
    if not 0 < args.queue_timeout_s < float("inf"):
        raise CliError(f"--queue-timeout-s must be > 0, got {args.queue_timeout_s}")
    settings = RouterSettings(model=args.model, tokenizer=args.tokenizer, served_model_name=args.served_model_name,
                              max_model_len=args.max_model_len, policy=args.policy, mode=args.mode,
                              host=args.host, port=args.port, api_key=args.api_key,
                              kv_deadline_s=args.kv_deadline_s, kv_wire_precision=args.kv_wire_precision,
                              log_level=args.log_level.lower(),
                              topology=args.topology, profile=args.profile, slo_ttft=args.slo_ttft,
                              slo_tpot=args.slo_tpot, admission_control=args.admission_control,
                              calibrate=not args.no_calibration, local_prefill=not args.no_local_prefill,
                              worker_wait_s=args.worker_wait_s,
                              max_tokens_default=args.max_tokens_default, usage_timing=args.usage_timing,
                              cluster_token=cluster_token(args),
                              max_queued_requests=args.max_queued_requests, queue_timeout_s=args.queue_timeout_s)
    return run_router(args.worker, settings)


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
        if any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
        return values
    return parse


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.launcher.profile import profile_engine
    from pdserve.router.placement.profiles import save_profile

    if args.repeats < 1:
        raise CliError(f"--repeats must be >= 1, got {args.repeats}")
    if args.decode_steps < 1:
        raise CliError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    mixed_flags = [f"--{k.replace('_', '-')}" for k in ("mixed_batches", "mixed_chunks", "mixed_context")
                   if getattr(args, k) is not None]
    if args.mixed_context is not None and args.mixed_context < 1:
        raise CliError(f"--mixed-context must be >= 1, got {args.mixed_context}")
    if mixed_flags and not args.mixed:
        raise CliError(f"{mixed_flags[0]} needs --mixed")
    grids = {k: getattr(args, k) for k in ("prefill_tokens", "decode_batches", "decode_contexts", "mixed_batches",
                                           "mixed_chunks", "mixed_context")
             if getattr(args, k) is not None}
    profile = profile_engine(engine_config(args), repeats=args.repeats, decode_steps=args.decode_steps,
                             progress=not args.quiet, mixed=args.mixed, **grids)
    try:
        save_profile(profile, args.out)
    except OSError as e:
        raise CliError(f"--out: cannot write {args.out}: {e.strerror or e}") from None
    print(f"{args.out}: {profile.model} on {profile.hardware} ({profile.dtype}): "
          f"{len(profile.prefill_tokens)} prefill lengths, "
          f"{len(profile.decode_batch_sizes)}x{len(profile.decode_contexts)} decode points"
          + (f", {len(profile.mixed_batch_sizes)}x{len(profile.mixed_chunk_tokens)} mixed points at context "
             f"{profile.mixed_context}" if profile.has_mixed else ""))
    return 0


def _add_up_args(u: argparse.ArgumentParser) -> None:
    """`pdserve up` flags. Their defaults live in UpConfig (flags not given stay unset, so that
    --config can fill them in)."""
    S = argparse.SUPPRESS
    u.add_argument("--config", metavar="FILE", default=None,
                   help="YAML file with the same settings as the flags (flags win)")
    add_engine_args(u, suppress_defaults=True)
    g = u.add_argument_group("pools")
    g.add_argument("--mode", default=S, help="disaggregated (default: --prefill and --decode workers), colocated "
                                             "(--replicas mixed workers) or hybrid (--replicas mixed workers that "
                                             "also send and receive KV: the policy chooses per request)")
    g.add_argument("--prefill", type=int_arg("--prefill"), default=S, help="prefill workers (default 1)")
    g.add_argument("--decode", type=int_arg("--decode"), default=S, help="decode workers (default 1)")
    g.add_argument("--replicas", type=int_arg("--replicas"), default=S,
                   help="colocated/hybrid: mixed workers (default --prefill + --decode)")
    g.add_argument("--worker-cpus", type=float_arg("--worker-cpus"), default=S, help="CPUs per worker (default 1)")
    g.add_argument("--worker-gpus", type=float_arg("--worker-gpus"), default=S,
                   help="GPUs per worker (default 1 when the Ray cluster has GPUs, else 0)")
    g.add_argument("--resources", type=_json_resources("--resources"), default=S, metavar="JSON",
                   help='custom Ray resources for every worker, e.g. \'{"gpu_node": 1}\'')
    g.add_argument("--prefill-resources", type=_json_resources("--prefill-resources"), default=S, metavar="JSON",
                   help='custom Ray resources for prefill workers, e.g. \'{"node_a": 1}\'')
    g.add_argument("--decode-resources", type=_json_resources("--decode-resources"), default=S, metavar="JSON",
                   help="custom Ray resources for decode workers")
    g.add_argument("--placement-strategy", default=S, help="placement group strategy per pool: PACK (default), "
                                                          "SPREAD, STRICT_PACK, STRICT_SPREAD")
    g.add_argument("--kv-backend", default=S,
                   help="KV transfer backend: ucx (default), or nixl (needs pdserve[nixl] on every node)")
    g.add_argument("-tp", "--tensor-parallel-size", type=positive_int_arg("--tensor-parallel-size"), default=S,
                   metavar="N", help="ranks per worker, every pool (default 1): one worker to the router, N GPUs "
                                     "(or N CPU processes) on one node")
    g.add_argument("--prefill-tp", type=positive_int_arg("--prefill-tp"), default=S, metavar="N",
                   help="ranks per prefill worker (default --tensor-parallel-size)")
    g.add_argument("--decode-tp", type=positive_int_arg("--decode-tp"), default=S, metavar="N",
                   help="ranks per decode worker (default --tensor-parallel-size)")
    r = u.add_argument_group("ray")
    r.add_argument("--address", default=S, help="Ray cluster to join (auto, ray://host:10001); "
                                                "default: start a local Ray")
    r.add_argument("--namespace", default=S, help="Ray namespace of the actors (default pdserve)")
    r.add_argument("--cluster-name", default=S, help="actor names are pdserve:<cluster-name>:<role>:<i>")
    r.add_argument("--ray-object-store-mb", type=int_arg("--ray-object-store-mb"), default=S,
                   help="object store size of a Ray we start (default 256)")
    r.add_argument("--startup-timeout-s", type=float_arg("--startup-timeout-s"), default=S,
                   help="give up when the workers are not all ready after this many seconds (default 600)")
    h = u.add_argument_group("router")
    _add_router_args(h, suppress=True)
    a = u.add_argument_group("autoscaling")
    a.add_argument("--autoscale", action="store_true", default=S,
                   help="resize the pools from the SLO attainment (needs --slo-ttft/--slo-tpot); bounds, cooldown, "
                        "interval and target from the --config file's autoscale: mapping (docs/planner.md)")


def _add_router_args(p, *, suppress: bool = False) -> None:
    def d(value):
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--policy", default=d("round-robin"),
                   help="placement policy (round-robin, least-loaded, ...; default round-robin)")
    p.add_argument("--host", default=d("127.0.0.1"), help="HTTP bind host (default 127.0.0.1)")
    p.add_argument("--port", type=int_arg("--port"), default=d(8000), help="HTTP port (default 8000)")
    p.add_argument("--api-key", default=d(environment.get(API_KEY_ENV)),
                   help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", default=d(None), help="model id of the API (default: --model)")
    p.add_argument("--kv-deadline-s", type=float_arg("--kv-deadline-s"), default=d(10.0),
                   help="a KV transfer past this falls back to prefill on the decode worker")
    p.add_argument("--kv-wire-precision", choices=("auto", "full", "fp8"), default=d("auto"),
                   help="the KV's precision between prefill and decode workers: auto (network-aware picks FP8 "
                        "per request where the link is the bound, full elsewhere; other policies: full), "
                        "full, or fp8 (e4m3, dequantized on landing) for every request (default auto)")
    p.add_argument("--worker-wait-s", type=float_arg("--worker-wait-s"), default=d(30.0),
                   help="a request that no worker can serve (e.g. the only one restarts) waits this long for "
                        "one, then gets 503 with Retry-After (default 30; 0: at once)")
    p.add_argument("--max-tokens-default", type=int_arg("--max-tokens-default"), default=d(None), metavar="N",
                   help="max_tokens of a request that gives none, on both endpoints (the room left in the context "
                        "still bounds it). Default: OpenAI's, 16 for /v1/completions and for chat the rest of the "
                        "context, which on a CPU can take minutes")
    p.add_argument("--max-queued-requests", type=int_arg("--max-queued-requests"), default=d(1024),
                   help="requests waiting for their first token (e.g. for KV blocks in a burst) beyond "
                        "this get 429 with Retry-After (default 1024)")
    p.add_argument("--queue-timeout-s", type=float_arg("--queue-timeout-s"), default=d(600.0),
                   help="a request without its first token after this long gets 503 with Retry-After "
                        "(default 600)")
    p.add_argument("--usage-timing", action="store_true", default=d(False),
                   help="add usage.pdserve_timing (where each request's time went) to every response; without "
                        "it only requests that ask for it get it (header x-pdserve-timing: 1 or "
                        "\"pdserve_timing\": true in the body)")
    p.add_argument("--topology", default=d(None), metavar="FILE",
                   help="YAML of nodes, workers and links (Gbit/s, latency) for placement")
    p.add_argument("--profile", default=d(None), metavar="FILE",
                   help="`pdserve profile` JSON (needed by --policy network-aware)")
    p.add_argument("--slo-ttft", type=float_arg("--slo-ttft"), default=d(None), help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float_arg("--slo-tpot"), default=d(None), help="TPOT SLO, seconds")
    p.add_argument("--admission-control", action="store_true", default=d(False),
                   help="429 when no placement can meet the SLOs (network-aware)")
    p.add_argument("--no-calibration", action="store_true", default=d(False),
                   help="network-aware: keep the --profile model as measured (default: correct it from "
                        "each finished request's served prefill, TTFT and TPOT)")
    p.add_argument("--no-local-prefill", action="store_true", default=d(False),
                   help="network-aware: always prefill on a prefill worker when a pair is feasible (default: a "
                        "decode worker may prefill a prompt itself when that is much faster than the transfer)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Prefill/decode disaggregated LLM serving")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level, any case (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline from one prompt")
    add_engine_args(g)
    add_tensor_parallel_arg(g)
    g.add_argument("--prompt", required=True, help="the user message (the raw text with --raw)")
    g.add_argument("--max-tokens", type=int_arg("--max-tokens"), default=64,
                   help="tokens to generate at most (default %(default)s)")
    g.add_argument("--temperature", type=float_arg("--temperature"), default=0.0,
                   help="sampling temperature; 0 is greedy (default %(default)s)")
    g.add_argument("--top-p", type=float_arg("--top-p"), default=1.0,
                   help="nucleus sampling mass (default %(default)s)")
    g.add_argument("--top-k", type=int_arg("--top-k"), default=-1,
                   help="sample among the k most likely tokens; -1 disables (default %(default)s)")
    g.add_argument("--seed", type=int_arg("--seed"), default=None, help="sampler seed (default: random)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="also print the token count, time and token ids")
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="start workers on Ray and serve the router (foreground)")
    _add_up_args(u)
    u.set_defaults(func=cmd_up)

    w = sub.add_parser("worker", help="one worker without Ray (foreground; prints its address)")
    add_engine_args(w)
    add_worker_args(w)
    w.set_defaults(func=cmd_worker)

    r = sub.add_parser("router", help="the router over a fixed list of workers, without Ray (foreground)")
    r.add_argument("--worker", action="append", required=True, metavar="ROLE[#ID][@NODE]=HOST:PORT",
                   help="a worker (repeatable), e.g. prefill=10.0.0.1:50051")
    r.add_argument("--model", default=ENGINE_DEFAULTS["model"], help="model spec, for the tokenizer")
    r.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer to use instead of the model's (as the workers' --tokenizer)")
    add_cluster_token_arg(r)
    r.add_argument("--max-model-len", type=int_arg("--max-model-len"), default=None,
                   help="longest sequence the router accepts, as the workers' --max-model-len "
                        "(default: the model's context length)")
    r.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated",
                   help="disaggregated: prefill and decode workers; colocated: mixed workers (default %(default)s)")
    _add_router_args(r)
    r.set_defaults(func=cmd_router)

    pr = sub.add_parser("profile", help="measure prefill and decode step times on this hardware (JSON for "
                                        "--policy network-aware --profile)")
    add_engine_args(pr)
    pr.add_argument("--out", required=True, metavar="FILE", help="where to write the profile JSON")
    pr.add_argument("--prefill-tokens", type=_int_list("--prefill-tokens"), default=None,
                    metavar="N,N,...", help="prompt lengths to time (default 16..4096 by powers of 2; "
                                            "those over the context are left out)")
    pr.add_argument("--decode-batches", type=_int_list("--decode-batches"), default=None,
                    metavar="N,N,...", help="decode batch sizes to time (default 1..64 by powers of 2)")
    pr.add_argument("--decode-contexts", type=_int_list("--decode-contexts"), default=None,
                    metavar="N,N,...", help="decode context lengths to time (default 128,512,2048)")
    pr.add_argument("--mixed", action="store_true",
                    help="also time mixed steps (a decode batch plus a prefill chunk, as a serving worker runs "
                         "them) into the profile's mixed table")
    pr.add_argument("--mixed-batches", type=_int_list("--mixed-batches"), default=None, metavar="N,N,...",
                    help="--mixed: decode batch sizes (default 1,4,16,32,64; over max-num-seqs - 1 measured there)")
    pr.add_argument("--mixed-chunks", type=_int_list("--mixed-chunks"), default=None, metavar="N,N,...",
                    help="--mixed: prefill chunk sizes in tokens (default 64,128,256,512; up to "
                         "--max-num-batched-tokens)")
    pr.add_argument("--mixed-context", type=int_arg("--mixed-context"), default=None,
                    help="--mixed: the decodes' context in tokens (default 1024)")
    pr.add_argument("--repeats", type=int_arg("--repeats"), default=3, help="prefill runs per length (median)")
    pr.add_argument("--decode-steps", type=int_arg("--decode-steps"), default=8,
                    help="timed steps per decode point (and per mixed point)")
    pr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="the numbers of prefill, decode and mixed workers with the most goodput per "
                                     "GPU for a workload, SLOs and a GPU budget (searched with the simulator)")
    from pdserve.sim.plan_cli import add_plan_args

    add_plan_args(pl)
    pl.set_defaults(func=cmd_plan)
    return parser


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.loadgen.errors import LoadgenError
    from pdserve.sim.plan_cli import run_plan

    try:
        return run_plan(args)
    except LoadgenError as e:  # a trace file's error names the file, line and field
        raise CliError(f"--trace: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CliError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
