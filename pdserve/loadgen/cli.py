"""`pdserve-loadgen`: run | experiment | search.

Exit codes: 0 success; 1 the server failed (unreachable, not OpenAI-compatible, did not
start); 2 bad input (a flag, a spec, a trace or dataset file), one line on stderr;
130 interrupted (results so far are kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path

from pdserve import environment
from pdserve.loadgen.arrivals import ARRIVAL_KINDS, TRACE_FORMATS
from pdserve.loadgen.client import ENDPOINTS, ClientConfig
from pdserve.loadgen.datasets import DATASET_KINDS, DatasetConfig, LengthDist
from pdserve.loadgen.errors import InputFileError, LoadgenError, ServerError, ServerUnreachable
from pdserve.loadgen.launcher import LaunchError
from pdserve.loadgen.metrics import SLO, max_rate_meeting_slo
from pdserve.loadgen.runner import (LoadConfig, RunInterrupted, format_summary, run_load, write_run_outputs,
                                    write_summary_csv)

PROG = "pdserve-loadgen"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(kind=float, allow_inf: bool = False):
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "number" if kind is float else "whole number"
            raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}")
        if not (value > 0) or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"must be > 0{'' if allow_inf else ' and finite'}, got {text!r}")
        return value
    return convert


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (value >= 0) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _add_load_options(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--endpoint", choices=list(ENDPOINTS), default="chat", help="API to call (default chat)")
    s.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY)")
    s.add_argument("--timeout", type=_positive(), default=600.0, help="per-request timeout, seconds")
    s.add_argument("--no-metrics", action="store_true", help="do not scrape the server's /metrics")

    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=list(ARRIVAL_KINDS) + ["trace"], default="poisson")
    a.add_argument("--burstiness", type=_positive(), default=1.0,
                   help="gamma shape: 1 is Poisson, < 1 burstier, > 1 smoother")
    a.add_argument("--trace", help="trace file for --arrival trace (Azure CSV, Mooncake JSONL, BurstGPT CSV)")
    a.add_argument("--trace-format", choices=TRACE_FORMATS, help="trace format (default: detected)")
    a.add_argument("--trace-speedup", type=_positive(), default=1.0,
                   help="play the trace this many times faster (ignored when --rate is given)")
    a.add_argument("--num-requests", type=_positive(int), help="number of requests")
    a.add_argument("--duration", type=_positive(), help="send for this many seconds")
    a.add_argument("--seed", type=int, default=0,
                   help="seed of arrivals and prompts; a run with the seed of an earlier one sends the same "
                        "prompts, which a server's prefix cache serves fast (the summary shows its hit rate): "
                        "change it for new prompts")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASET_KINDS, default="synthetic")
    d.add_argument("--input-len", type=_length, default=LengthDist("fixed", value=128),
                   help="prompt tokens (suffix tokens for shared-prefix): fixed:N, uniform:LO:HI, "
                        "normal:MEAN:STD, lognormal:MEAN:SIGMA, optional :MAX (default 128)")
    d.add_argument("--output-len", type=_length, default=LengthDist("fixed", value=128),
                   help="output tokens (max_tokens), same forms (default 128)")
    d.add_argument("--sharegpt", help="ShareGPT JSON file for --dataset sharegpt")
    d.add_argument("--num-groups", type=_positive(int), default=8, help="shared-prefix groups")
    d.add_argument("--prefix-len", type=_positive(int), default=512, help="shared-prefix tokens")
    d.add_argument("--tokenizer", help="tokenizer.json path or HF name for exact token counts")

    c = p.add_argument_group("sending")
    c.add_argument("--concurrency", type=_positive(int), help="at most this many requests in flight")
    c.add_argument("--max-run-time", type=_positive(), help="stop the run after this many seconds")
    c.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    c.add_argument("--temperature", type=_non_negative, default=0.0)

    o = p.add_argument_group("SLO and output")
    o.add_argument("--slo-ttft", type=_positive(), help="TTFT SLO, seconds")
    o.add_argument("--slo-tpot", type=_positive(), help="TPOT SLO, seconds")
    o.add_argument("--output", help="directory for records.jsonl, summary.json and summary.csv")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Load generator for OpenAI-compatible servers.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="one load run against a server")
    _add_load_options(run)
    run.add_argument("--rate", type=_positive(float, allow_inf=True),
                     help="requests/s ('inf' sends all at once); with a trace, rescale it to this mean rate")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")

    exp = sub.add_parser("experiment", help="run an experiment spec (YAML)")
    exp.add_argument("spec", help="experiment spec, e.g. pdserve/loadgen/examples/headline.yaml")
    exp.add_argument("--output-dir", help="override the spec's output_dir")
    exp.add_argument("--no-progress", action="store_true", help="no progress bar")
    exp.add_argument("--dry-run", action="store_true", help="validate the spec and list the runs")
    exp.add_argument("--policy", action="append", metavar="NAME",
                     help="run only this value of grid.policy (repeatable): a sweep in parts, each with its "
                          "own --output-dir")

    search = sub.add_parser("search", help="highest request rate with >= target of requests meeting the SLO")
    _add_load_options(search)
    search.add_argument("--lo", type=_positive(), default=0.5, help="lowest rate to try (req/s)")
    search.add_argument("--hi", type=_positive(), default=32.0, help="highest rate to try (req/s)")
    search.add_argument("--target", type=_positive(), default=0.9, help="SLO attainment target (default 0.9)")
    search.add_argument("--max-probes", type=_positive(int), default=8, help="at most this many runs")
    return parser


def _load_config(parser, args, rate: float | None) -> LoadConfig:
    if args.arrival == "trace" and not args.trace:
        parser.error("argument --trace: required with --arrival trace")
    if args.arrival != "trace":
        if rate is None and args.command == "run":
            parser.error(f"argument --rate: required with --arrival {args.arrival}")
        if args.num_requests is None and args.duration is None:
            parser.error("argument --num-requests/--duration: give at least one")
        if args.duration is not None and rate is not None and math.isinf(rate) and args.num_requests is None:
            parser.error("argument --rate: 'inf' needs --num-requests")
    if args.dataset == "sharegpt" and not args.sharegpt:
        parser.error("argument --sharegpt: required with --dataset sharegpt")
    if (args.slo_ttft is None) != (args.slo_tpot is None):
        parser.error("argument --slo-ttft/--slo-tpot: give both")
    if args.command == "search" and args.slo_ttft is None:
        parser.error("argument --slo-ttft/--slo-tpot: required for search")
    try:
        client = ClientConfig(
            base_url=args.url, endpoint=args.endpoint, model=args.model,
            api_key=args.api_key or environment.get("OPENAI_API_KEY"), request_timeout_s=args.timeout,
            ignore_eos=args.ignore_eos, temperature=args.temperature,
        )
    except ValueError as e:
        parser.error(f"argument --url: {e}")
    dataset = DatasetConfig(
        kind=args.dataset, input=args.input_len, output=args.output_len, path=args.sharegpt,
        num_groups=args.num_groups, prefix_tokens=args.prefix_len, tokenizer=args.tokenizer,
        name=args.dataset,
    )
    slo = SLO(args.slo_ttft, args.slo_tpot) if args.slo_ttft is not None else None
    return LoadConfig(
        client=client, rate=rate, arrival=args.arrival, burstiness=args.burstiness,
        num_requests=args.num_requests, duration_s=args.duration, seed=args.seed, dataset=dataset,
        trace_path=args.trace, trace_format=args.trace_format, trace_speedup=args.trace_speedup,
        concurrency=args.concurrency, max_run_time_s=args.max_run_time, slo=slo,
        scrape_metrics=not args.no_metrics,
    )


def _progress(args) -> bool | None:
    return False if args.no_progress else None


def _cmd_run(parser, args) -> int:
    cfg = _load_config(parser, args, args.rate)
    try:
        result = run_load(cfg, progress=_progress(args))
    except RunInterrupted as e:
        result = e.result
    if args.output:
        labels = {"url": cfg.client.root, "arrival": cfg.arrival, "rate": cfg.rate, "dataset": cfg.dataset.kind}
        write_run_outputs(args.output, result, labels)
    print(json.dumps(result.summary, indent=2) if args.json else format_summary(result.summary))
    return 130 if result.interrupted else 0


def _cmd_search(parser, args) -> int:
    if args.lo >= args.hi:
        parser.error("argument --lo: must be below --hi")
    if args.target > 1:
        parser.error("argument --target: must be <= 1")
    base = _load_config(parser, args, args.lo)
    rows: list[dict] = []

    def run_at(rate: float):
        result = run_load(dataclasses.replace(base, rate=rate), progress=_progress(args))
        rows.append({"rate": rate, "model": result.model} | result.summary)
        if args.output:
            write_run_outputs(Path(args.output) / f"rate{rate:.4g}", result, {"rate": rate})
        print(f"rate {rate:8.3f} req/s: SLO attainment {result.summary['slo_attainment'] * 100:5.1f}%, "
              f"goodput {result.summary['goodput'] or 0:.2f} req/s", flush=True)
        return result.records

    try:
        found = max_rate_meeting_slo(run_at, base.slo, target=args.target, lo=args.lo, hi=args.hi,
                                     max_probes=args.max_probes)
    except RunInterrupted:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.output and rows:
            Path(args.output).mkdir(parents=True, exist_ok=True)
            write_summary_csv(Path(args.output) / "search.csv", rows)
    if found.rate is None:
        print(f"no rate in [{args.lo:g}, {args.hi:g}] meets the SLO for {args.target * 100:g}% of requests")
    else:
        edge = " (the upper bound; raise --hi)" if found.rate == args.hi else ""
        print(f"max rate meeting the SLO for {args.target * 100:g}% of requests: {found.rate:.3f} req/s{edge}")
    return 0


def _cmd_experiment(parser, args) -> int:
    from pdserve.loadgen.experiment import only_policies, run_experiment, run_ids
    from pdserve.loadgen.spec import load_spec

    spec = load_spec(args.spec)
    try:
        spec = only_policies(spec, args.policy)
    except ValueError as e:
        parser.error(f"argument --policy: {e}")
    if args.dry_run:
        print("\n".join(run_ids(spec)))
        return 0
    result = run_experiment(spec, output_dir=args.output_dir, progress=_progress(args))
    failed = sum(1 for r in result.rows if r.get("error"))
    print(f"{len(result.rows)} runs ({failed} failed); report: {result.output_dir / 'report.md'}")
    return 130 if result.interrupted else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    commands = {"run": _cmd_run, "search": _cmd_search, "experiment": _cmd_experiment}
    try:
        return commands[args.command](parser, args)
    except (ServerUnreachable, ServerError, LaunchError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except (InputFileError, LoadgenError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
