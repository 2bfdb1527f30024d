"""pdserve against vLLM on the same GPU, the same client and the same prompts, in one command.

    python -m experiments.vs_vllm --shape qwen3-30b-a3b --model-dir DIR \\
        --vllm "python3 -m vllm.entrypoints.cli.main serve {model_dir} --served-model-name {name} \\
                --load-format dummy --port {port}" \\
        --out docs/results/vs-vllm/qwen3-30b-a3b-h200.md

For each server in turn (vLLM first, then `pdserve up --mode colocated`, or the `--pdserve`
command given), it starts the server fresh (`pdserve.loadgen.launcher.ServerProcess`: its own
process group, health check, always stopped), runs the same workloads with `pdserve-loadgen run`
against it, and stops it. Workloads (each run draws its own prompts: seed + the run's index, the
same seeds for both servers):

1. decode at batch B for each `--batches` B: B requests of `--decode-in`/`--decode-out` tokens
   sent at once (concurrency B): output tokens/s and TPOT;
2. served `--served-in`/`--served-out` at each of `--rates` requests/s (Poisson, `--requests`):
   TTFT and TPOT p50/p90.

`--model-dir` is a Hugging Face directory with the shape's `config.json` and a tokenizer in which
every id decodes to text (`../shared/tools/vllm-anchor.sh` writes one for the 8B shape; copy its
tokenizer files beside another `config.json`); vLLM serves it with dummy weights, pdserve serves
`random:<shape>` with the same tokenizer (`--tokenizer DIR`), so both emit every token they make.
Both run with `--ignore-eos`, so every request makes exactly its output tokens.

The table (markdown, with the ratios pdserve / vLLM) goes to `--out`, the raw summaries beside it
as JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.loadgen.launcher import ServerProcess, free_port

PDSERVE_DEFAULT = ("{python} -m pdserve.launcher.cli up --mode colocated --replicas 1 --model random:{shape} "
                   "--tokenizer {model_dir} --served-model-name {name} --port {port} --host 127.0.0.1")


@dataclass(frozen=True)
class Workload:
    label: str
    args: tuple[str, ...]


def workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for b in args.batches:
        out.append(Workload(f"decode batch {b}, {args.decode_in}/{args.decode_out}",
                            ("--num-requests", str(b), "--rate", "inf", "--concurrency", str(b),
                             "--input-len", f"fixed:{args.decode_in}", "--output-len", f"fixed:{args.decode_out}")))
    for rate in args.rates:
        out.append(Workload(f"{args.served_in}/{args.served_out} at {rate:g} req/s",
                            ("--num-requests", str(args.requests), "--rate", str(rate), "--arrival", "poisson",
                             "--input-len", f"fixed:{args.served_in}", "--output-len", f"fixed:{args.served_out}")))
    return out


def run_load(url: str, name: str, tokenizer: str, workload: Workload, seed: int, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.loadgen.cli", "run", "--url", url, "--endpoint", "completions",
           "--model", name, "--tokenizer", tokenizer, "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--no-progress", "--json", "--output", str(out_dir), *workload.args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed for {workload.label}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def serve_and_measure(label: str, command: str, health: str, url: str, name: str, tokenizer: str,
                      loads: list[Workload], seed: int, out_dir: Path, startup_s: float) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    began = time.monotonic()
    with ServerProcess(command, health_url=health, log_path=out_dir / "server.log", startup_timeout_s=startup_s):
        print(f"{label}: ready in {time.monotonic() - began:.0f} s", flush=True)
        for i, load in enumerate(loads):
            summary = run_load(url, name, tokenizer, load, seed + i, out_dir / f"run{i}")
            results.append(summary)
            print(f"{label}: {load.label}: {summary['num_ok']}/{summary['num_requests']} ok, "
                  f"{summary['output_token_throughput']:.0f} out tok/s, TTFT p50 {1e3 * summary['ttft_p50']:.1f} ms, "
                  f"TPOT p50 {1e3 * summary['tpot_p50']:.2f} ms", flush=True)
    return results


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def table(loads: list[Workload], vllm: list[dict], ours: list[dict]) -> list[str]:
    lines = ["| workload | vLLM out tok/s | pdserve out tok/s | ratio | vLLM TTFT p50 / p90 ms "
             "| pdserve TTFT p50 / p90 ms | ratio p50 / p90 | vLLM TPOT p50 / p90 ms | pdserve TPOT p50 / p90 ms "
             "| ratio p50 / p90 | errors v / p |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for load, v, p in zip(loads, vllm, ours):
        lines.append(
            f"| {load.label} | {v['output_token_throughput']:.0f} | {p['output_token_throughput']:.0f} | "
            f"{_ratio(p['output_token_throughput'], v['output_token_throughput'])} | "
            f"{_ms(v['ttft_p50'])} / {_ms(v['ttft_p90'])} | {_ms(p['ttft_p50'])} / {_ms(p['ttft_p90'])} | "
            f"{_ratio(p['ttft_p50'], v['ttft_p50'])} / {_ratio(p['ttft_p90'], v['ttft_p90'])} | "
            f"{_ms(v['tpot_p50'])} / {_ms(v['tpot_p90'])} | {_ms(p['tpot_p50'])} / {_ms(p['tpot_p90'])} | "
            f"{_ratio(p['tpot_p50'], v['tpot_p50'])} / {_ratio(p['tpot_p90'], v['tpot_p90'])} | "
            f"{v['num_errors']} / {p['num_errors']} |")
    return lines


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.vs_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="pdserve's random:<shape> (e.g. qwen3-30b-a3b, llama-3.1-8b)")
    p.add_argument("--model-dir", required=True, help="HF directory: the shape's config.json and an every-id tokenizer")
    p.add_argument("--vllm", required=True, help="vLLM's serve command; {model_dir}, {port} and {name} are filled in")
    p.add_argument("--pdserve", default=PDSERVE_DEFAULT, help="pdserve's command (default: colocated, one replica)")
    p.add_argument("--name", default="model", help="the model name both servers serve (default: model)")
    p.add_argument("--only", choices=("both", "vllm", "pdserve"), default="both",
                   help="run one server only (the other's summaries from an earlier --out are reused)")
    p.add_argument("--batches", type=_ints, default=[1, 64, 256], help="decode batch sizes (default 1,64,256)")
    p.add_argument("--decode-in", type=int, default=128)
    p.add_argument("--decode-out", type=int, default=512)
    p.add_argument("--rates", type=_floats, default=[2.0, 4.0, 6.0], help="served rates, req/s (default 2,4,6)")
    p.add_argument("--requests", type=int, default=60, help="requests a served run (default 60)")
    p.add_argument("--served-in", type=int, default=2048)
    p.add_argument("--served-out", type=int, default=256)
    p.add_argument("--seed", type=int, required=True, help="first seed; each run adds its index (new prompts)")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--out", required=True, help="markdown table to write (raw JSON and logs beside it)")
    args = p.parse_args(argv)
    if not Path(args.model_dir, "config.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no config.json there")
    if not Path(args.model_dir, "tokenizer.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no tokenizer.json there (the every-id tokenizer)")
    if any(b < 1 for b in args.batches) or any(r <= 0 for r in args.rates) or args.requests < 1:
        p.error("--batches, --rates and --requests must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    raw_dir = out.with_suffix("")
    raw_dir.mkdir(parents=True, exist_ok=True)
    loads = workloads(args)
    tokenizer = str(Path(args.model_dir, "tokenizer.json"))
    fill = {"model_dir": args.model_dir, "name": args.name, "shape": args.shape, "python": shlex.quote(sys.executable)}
    results: dict[str, list[dict]] = {}
    raw_path = raw_dir / "summaries.json"
    if args.only != "both" and raw_path.is_file():
        results = json.loads(raw_path.read_text())
    servers = [("vllm", args.vllm), ("pdserve", args.pdserve)]
    for label, template in servers:
        if args.only not in ("both", label):
            continue
        port = free_port()
        command = template.format(port=port, **fill)
        url = f"http://127.0.0.1:{port}"
        results[label] = serve_and_measure(label, command, f"{url}/health", url, args.name, tokenizer, loads,
                                           args.seed, raw_dir / label, args.startup_timeout_s)
        raw_path.write_text(json.dumps(results, indent=1))
    if not {"vllm", "pdserve"} <= results.keys():
        print(f"summaries in {raw_path}; run the other server to write the table")
        return 0
    lines = [f"# pdserve against vLLM: `random:{args.shape}`", "",
             f"`python -m experiments.vs_vllm {' '.join(shlex.quote(a) for a in (argv or sys.argv[1:]))}`", "",
             "Ratios are pdserve / vLLM: above 1 is better for throughput, below 1 for latency.", "",
             *table(loads, results["vllm"], results["pdserve"]), ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
