"""`pdserve up`'s defaults against hand-set flags, in one command: goodput per SLO over a rate sweep.

    python3 -m experiments.defaults_vs_flags [--model random:llama-3.1-8b] [--rates 8,12,16] \
        [--requests N[,N...]] [--input-len 2048] [--output-len 256] [--slo ttft=1,tpot=0.05 --slo ttft=1,tpot=0.01] \
        [--configs "FLAGS;FLAGS;..."] [--time-budget-s S] [--out DIR] [--tar FILE]

For each configuration, in order, a fresh `pdserve up --mode colocated --replicas 1` (the first with
its defaults: nothing but the model and the device; each other one adds its flags, by default
`--max-num-batched-tokens 16384 --max-num-seqs 512`, `... 4096 ... 128` and `... 8192 ... 128`;
`--configs` replaces that list, flag strings separated by ';'), then one `pdserve-loadgen run` per
rate of `--rates` (Poisson, `--requests` requests each, one number or one per rate, by default 10 s
of arrivals), then the server is stopped. The comparison is paired: at a given rate every
configuration gets the same seed, so the same arrival times and prompts (each configuration has a
fresh server, so nothing is in its prefix cache yet), while the rates of one server draw new
prompts (repeated prompts hit the prefix cache). With a new draw per configuration, two runs at
"14 req/s" arrived over 11.1 and 8.1 s (one H200, 2026-12-03), and their goodput compared those
arrival spans rather than the servers.

Goodput of a run for an SLO set is loadgen's (`pdserve.loadgen.metrics.summarize`): the requests that met
both the TTFT and the TPOT bound, per second of the run (first send to the end of the run), from the
run's own per-request records. The run's duration holds the last requests' tail (TTFT + 255 TPOTs,
a few seconds at 2048/256), so a short run's goodput sits below its rate even when every request
meets the SLO: compare configurations at the same rates and request counts, as this script does.
A configuration's goodput for an SLO set is its best over the rates; per SLO set the script prints
the defaults' best over the best configuration's best, and which one that was (the issue "GPU
serving at the engine's speed" asks >= 0.95). It prints one table (config x rate: TTFT and TPOT
p50/p90, goodput per SLO set, errors, the server's prefix-cache hit rate) and the scheduler sizes
each `pdserve up` printed (`engine: max_num_batched_tokens=... max_num_seqs=...`).

`--out DIR` keeps the server logs, every run's records and summary (DIR/configN/rateR/) and writes
DIR/defaults_vs_flags.json and DIR/defaults_vs_flags.md; `--tar FILE` packs DIR into FILE after
every configuration, so a run cut by an outer time limit still leaves its data. `--time-budget-s`
skips the configurations (and rates) that would start after it is spent: a configuration starts
only when the time left covers the longest one so far.

`--device cpu --model random:smollm2-135m --rates 2 --requests 4 --input-len 16 --output-len 4` with
two configurations is the smoke test the CPU tests run (random:tiny-llama has no tokenizer, which
the router needs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time

from experiments.gpu_serving import log
from experiments.served_vs_bare import Server  # gpu_serving.Cluster with the model, device and a log file
from pdserve.loadgen.metrics import SLO, summarize
from pdserve.loadgen.records import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_CONFIGS = ("--max-num-batched-tokens 16384 --max-num-seqs 512;"
                   "--max-num-batched-tokens 4096 --max-num-seqs 128;"
                   "--max-num-batched-tokens 8192 --max-num-seqs 128")
DEFAULT_SLOS = ("ttft=1,tpot=0.05", "ttft=1,tpot=0.01")


def parse_slo(text: str) -> SLO:
    """`ttft=1,tpot=0.05` (seconds) -> SLO; unknown or missing keys raise ValueError naming them."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("ttft", "tpot"):
            raise ValueError(f"--slo: expected ttft=SECONDS,tpot=SECONDS, got {part!r} in {text!r}")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} must be a number of seconds, got {value!r}") from None
    missing = [k for k in ("ttft", "tpot") if k not in values]
    if missing:
        raise ValueError(f"--slo: {' and '.join(missing)} missing in {text!r}")
    return SLO(values["ttft"], values["tpot"])


def slo_name(slo: SLO) -> str:
    return f"TTFT<={slo.ttft_s:g}s TPOT<={slo.tpot_s * 1e3:g}ms"


def positive_list(kind, flag: str):
    def convert(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{flag}: every value must be > 0, got {text!r}")
        return values
    return convert


def loadgen(url: str, args: argparse.Namespace, rate: float, requests: int, seed: int, run_dir: str) -> dict:
    """One `pdserve-loadgen run` in its own process; its records and summary land in run_dir."""
    cmd = [sys.executable, "-m", "pdserve.loadgen.cli", "run", "--url", url, "--num-requests", str(requests),
           "--rate", str(rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--seed", str(seed), "--json", "--no-progress", "--max-run-time", str(args.max_run_time),
           "--output", run_dir]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.max_run_time + 120)
    if out.returncode not in (0, 130):
        raise RuntimeError(f"loadgen exited with {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def measure(summary: dict, run_dir: str, requests: int, slos: list[SLO]) -> dict:
    """The run's figures: loadgen's summary, requests never sent (a run cut by --max-run-time) and,
    per SLO set, attainment and goodput from the run's records over the run's duration."""
    records = read_jsonl(os.path.join(run_dir, "records.jsonl"))
    not_sent = requests - len(records)
    run = {"summary": summary, "not_sent": not_sent, "errors": summary["num_errors"] + not_sent, "slo": {}}
    for slo in slos:
        s = summarize(records, duration_s=summary["duration_s"], slo=slo)
        run["slo"][slo_name(slo)] = {"goodput": s["goodput"] or 0.0, "attainment": s["slo_attainment"]}
    return run


def best(config: dict, name: str) -> tuple[float, float | None] | None:
    """(best goodput over the rates, its rate) for an SLO set, or None when no run finished."""
    runs = [r for r in config["runs"] if "slo" in r]
    if not runs:
        return None
    top = max(runs, key=lambda r: r["slo"][name]["goodput"])
    return top["slo"][name]["goodput"], top["rate"]


def compare(results: dict, slos: list[SLO]) -> dict:
    """Per SLO set: every configuration's best, the best configuration and the defaults' ratio to it
    (None when the defaults have no finished run or no configuration met the SLO at all)."""
    out = {}
    for slo in slos:
        name = slo_name(slo)
        bests = {c["label"]: best(c, name) for c in results["configs"]}
        finished = {label: b for label, b in bests.items() if b is not None}
        entry = {"best_per_config": {label: {"goodput": b[0], "rate": b[1]} for label, b in finished.items()},
                 "best_config": None, "best_goodput": None, "defaults_goodput": None, "defaults_over_best": None}
        if finished:
            label, (goodput, _) = max(finished.items(), key=lambda kv: kv[1][0])
            entry.update(best_config=label, best_goodput=goodput)
            defaults = finished.get(results["configs"][0]["label"])
            if defaults is not None:
                entry["defaults_goodput"] = defaults[0]
                if goodput > 0:
                    entry["defaults_over_best"] = defaults[0] / goodput
        out[name] = entry
    return out


def table(results: dict, slos: list[SLO]) -> list[str]:
    ms = lambda v, digits=0: "-" if v is None else f"{v * 1e3:.{digits}f}"  # noqa: E731
    names = [slo_name(s) for s in slos]
    lines = ["| config | rate req/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | "
             + " | ".join(f"goodput {n}" for n in names) + " | errors | prefix-cache hits |",
             "|---" * (8 + len(names)) + "|"]
    for c in results["configs"]:
        if "skipped" in c or "error" in c:
            lines.append(f"| {c['label']} | {c.get('skipped') or c.get('error')} |" + " |" * (6 + len(names)))
            continue
        for r in c["runs"]:
            if "slo" not in r:
                lines.append(f"| {c['label']} | {r['rate']:g}: {r.get('skipped') or r.get('error')} |"
                             + " |" * (6 + len(names)))
                continue
            s = r["summary"]
            hit = s.get("prefix_cache_hit_rate")
            hit_text = f"{hit * 100:.0f}%" if isinstance(hit, (int, float)) else "n/a"
            goodputs = " | ".join(f"{r['slo'][n]['goodput']:.2f}" for n in names)
            lines.append(f"| {c['label']} | {r['rate']:g} | {ms(s['ttft_p50'])} | {ms(s['ttft_p90'])} | "
                         f"{ms(s['tpot_p50'], 1)} | {ms(s['tpot_p90'], 1)} | {goodputs} | {r['errors']} | {hit_text} |")
    return lines


def verdicts(results: dict) -> list[str]:
    lines = []
    for name, e in results["comparison"].items():
        if e["best_config"] is None:
            lines.append(f"{name}: no configuration finished a run")
        elif e["defaults_goodput"] is None:
            lines.append(f"{name}: the defaults finished no run; best {e['best_config']} "
                         f"({e['best_goodput']:.2f} req/s)")
        elif e["defaults_over_best"] is None:
            lines.append(f"{name}: no configuration met this SLO at any rate (goodput 0 everywhere)")
        else:
            lines.append(f"{name}: defaults {e['defaults_goodput']:.2f} req/s over best {e['best_goodput']:.2f} "
                         f"({e['best_config']}) = {e['defaults_over_best']:.3f} (target >= 0.95)")
    return lines


def chosen_lines(results: dict) -> list[str]:
    return [f"{c['label']}: " + "; ".join(line.split("engine:", 1)[1].strip() for line in c.get("chosen", []))
            for c in results["configs"] if c.get("chosen")]


def write(results: dict, slos: list[SLO], out_dir: str) -> None:
    with open(os.path.join(out_dir, "defaults_vs_flags.json"), "w") as f:
        json.dump(results, f, indent=2)
    md = ["# Defaults vs flags", "", f"`{results['command']}`", "", f"device: {results['device_name']}", "",
          "Scheduler sizes each server chose:", ""]
    md += [f"- {line}" for line in chosen_lines(results)] + [""] + table(results, slos) + [""]
    md += [f"- {line}" for line in verdicts(results)]
    with open(os.path.join(out_dir, "defaults_vs_flags.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def pack(out_dir: str, path: str) -> None:
    """DIR into FILE (xz for .xz, gzip for .gz/.tgz, else plain tar), replaced whole; FILE itself is
    left out when it lies inside DIR."""
    mode = "w:xz" if path.endswith(".xz") else "w:gz" if path.endswith((".gz", ".tgz")) else "w"
    tmp = path + ".part"
    top = os.path.abspath(out_dir)
    skip = {os.path.abspath(path), os.path.abspath(tmp)}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if os.path.join(os.path.dirname(top), info.name) in skip else info

    with tarfile.open(tmp, mode) as tar:
        tar.add(top, arcname=os.path.basename(top), filter=keep)
    os.replace(tmp, path)


def device_name(device: str) -> str:
    """The GPU's name from nvidia-smi (no CUDA context in this process: the server needs the memory)."""
    if device != "cuda":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cuda (unknown)"
    except (OSError, subprocess.TimeoutExpired):
        return "cuda (unknown)"


def run_config(index: int, label: str, flags: list[str], args, slos, requests, out_dir: str, t_start: float) -> dict:
    config: dict = {"label": label, "flags": flags, "runs": []}
    gpu_args = ["--worker-gpus", "1"] if args.device == "cuda" else ["--worker-gpus", "0"]
    try:
        server = Server(args, ["--mode", "colocated", "--replicas", "1", *gpu_args, *flags], f"config{index}", out_dir)
    except RuntimeError as e:
        log(f"{label}: {e}")
        config["error"] = f"server did not start: {e}"
        return config
    try:
        config["chosen"] = server.chosen()
        config["startup_s"] = server.startup_s
        for i, (rate, n) in enumerate(zip(args.rates, requests)):
            if args.time_budget_s is not None and time.monotonic() - t_start >= args.time_budget_s:
                config["runs"].append({"rate": rate, "skipped": "time budget spent"})
                continue
            run_dir = os.path.join(out_dir, f"config{index}", f"rate{rate:g}")
            seed = args.seed + i  # the same arrivals and prompts for every configuration at this rate
            try:
                run = measure(loadgen(server.url, args, rate, n, seed, run_dir), run_dir, n, slos)
            except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                log(f"{label} @ {rate:g} req/s: loadgen failed: {e}")
                config["runs"].append({"rate": rate, "requests": n, "seed": seed, "error": str(e)[-500:]})
                continue
            run.update(rate=rate, requests=n, seed=seed)
            config["runs"].append(run)
            s = run["summary"]
            goodputs = ", ".join(f"{k} {v['goodput']:.2f}" for k, v in run["slo"].items())
            log(f"{label} @ {rate:g} req/s: {s['num_ok']}/{n} ok, TTFT p50 {s['ttft_p50'] or 0:.3f} s, TPOT p50 "
                f"{s['tpot_p50'] or 0:.4f} s, goodput {goodputs}")
    finally:
        server.stop()
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.1-8b", help="model (default %(default)s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="device (default %(default)s)")
    p.add_argument("--rates", type=positive_list(float, "--rates"), default=[8.0, 12.0, 16.0],
                   help="Poisson arrival rates of the sweep, req/s, comma-separated (default 8,12,16)")
    p.add_argument("--requests", type=positive_list(int, "--requests"), default=None,
                   help="requests per run: one number, or one per rate (default: 10 s of arrivals, rate x 10)")
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens (default %(default)s)")
    p.add_argument("--slo", action="append", default=None, metavar="ttft=S,tpot=S",
                   help="an SLO set in seconds, repeatable (default: ttft=1,tpot=0.05 and ttft=1,tpot=0.01)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="the configurations after the defaults: `pdserve up` flag strings separated by ';' "
                        "(replaces the default list; '' for the defaults alone; default %(default)r)")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                   help="first seed; the run at the i-th rate takes seed + i, the same for every "
                        "configuration (default: the clock)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for a server (default %(default)s)")
    p.add_argument("--max-run-time", type=float, default=120.0, help="seconds per loadgen run (default %(default)s)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip the configurations and rates that would start after this many seconds (default: none)")
    p.add_argument("--out", default=None, help="logs, records, JSON and markdown here (default: a temporary folder)")
    p.add_argument("--tar", default=None, metavar="FILE", help="pack --out into FILE after every configuration")
    args = p.parse_args(argv)
    try:
        slos = [parse_slo(text) for text in (args.slo or DEFAULT_SLOS)]
    except ValueError as e:
        p.error(str(e))
    if args.requests is None:
        requests = [math.ceil(rate * 10) for rate in args.rates]
    elif len(args.requests) in (1, len(args.rates)):
        requests = args.requests * len(args.rates) if len(args.requests) == 1 else args.requests
    else:
        p.error(f"--requests: give one number or one per rate ({len(args.rates)}), got {len(args.requests)}")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        p.error("--time-budget-s must be > 0")
    configs = [("defaults", [])] + [(" ".join(shlex.split(s)), shlex.split(s)) for s in args.configs.split(";")
                                    if s.strip()]
    out_dir = args.out or tempfile.mkdtemp(prefix="defaults-vs-flags-")
    os.makedirs(out_dir, exist_ok=True)
    results: dict = {"command": "python3 -m experiments.defaults_vs_flags " + shlex.join(argv if argv is not None
                                                                                          else sys.argv[1:]),
                     "args": vars(args), "device_name": device_name(args.device),
                     "slos": [{"name": slo_name(s), "ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for s in slos],
                     "configs": []}
    t_start = time.monotonic()
    longest = 0.0
    for index, (label, flags) in enumerate(configs):
        elapsed = time.monotonic() - t_start
        if args.time_budget_s is not None and elapsed + longest > args.time_budget_s:
            log(f"{label}: skipped ({elapsed:.0f} s spent, the longest configuration took {longest:.0f} s, "
                f"budget {args.time_budget_s:.0f} s)")
            results["configs"].append({"label": label, "flags": flags, "runs": [], "skipped": "time budget"})
            continue
        t_config = time.monotonic()
        results["configs"].append(run_config(index, label, flags, args, slos, requests, out_dir, t_start))
        longest = max(longest, time.monotonic() - t_config)
        results["comparison"] = compare(results, slos)
        write(results, slos, out_dir)
        if args.tar:
            pack(out_dir, args.tar)
    results["comparison"] = compare(results, slos)
    write(results, slos, out_dir)
    if args.tar:
        pack(out_dir, args.tar)

    print()
    for line in chosen_lines(results):
        print("server chose: " + line)
    print("\n".join(table(results, slos)))
    print()
    print("\n".join(verdicts(results)))
    log(f"wrote {os.path.join(out_dir, 'defaults_vs_flags.json')} and defaults_vs_flags.md"
        + (f"; packed into {args.tar}" if args.tar else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
