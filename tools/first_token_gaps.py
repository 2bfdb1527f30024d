"""Where a served request's time to first token goes, one request at a time, on any device.

    python3 -m tools.first_token_gaps [--model random:tiny-wide-vocab] [--tokenizer smollm2] \
        [--device cpu] [--requests 24] [--input-len 64] [--output-len 8] [--root DIR ...] [--out FILE]

Starts `pdserve up --mode colocated --replicas 1` (one mixed worker) from each code tree given with
--root (default: this one; give an older checkout first to compare before and after in one run),
all at once, and sends `--requests` streaming completions one after another, each to every tree in
turn (on a shared machine every tree sees the same load) (concurrency 1: no queueing, so each
gap is the serving path's own) with `usage.pdserve_timing` asked for, and prints, per tree, the
p50 of each step of the first token (ms since the router's backend saw the request, as
pdserve.timing.RequestTiming measures them) and of the client's own clock:

- `first_token` -> `first_text`: the engine's first token to the router's first text (a token
  that decodes to no text, e.g. an id past the tokenizer's vocabulary, moves the first text to a
  later step);
- `first_text` -> client TTFT: the HTTP/SSE leg plus the router's work before its backend sees
  the request (parsing, tokenizing);
- the first request after ready against the p50 of the rest (the cold start).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.request

from pdserve.loadgen.launcher import ServerProcess, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()



def start(root: str, args: argparse.Namespace, port: int, logfile: str) -> ServerProcess:
    """`pdserve up` from the code tree `root`, once /v1/models answers (stopped with SIGINT)."""
    cmd = [sys.executable, "-m", "pdserve.launcher.cli", "up", "--port", str(port), "--host", "127.0.0.1",
           "--model", args.model, "--device", args.device, "--mode", "colocated", "--replicas", "1",
           "--worker-gpus", "1" if args.device == "cuda" else "0"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    server = ServerProcess(cmd, health_url=f"http://127.0.0.1:{port}/v1/models", log_path=logfile, cwd=root,
                           env={"PYTHONPATH": root}, name="pdserve up", startup_timeout_s=args.startup_timeout,
                           shutdown_timeout_s=60, stop_signal=signal.SIGINT, poll_interval_s=0.5)
    return server.launch()


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def one_request(url: str, model: str, prompt: str, output_len: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "x-pdserve-timing": "1"})
    t0 = time.perf_counter()
    ttft = None
    timing: dict = {}
    with urllib.request.urlopen(req, timeout=300) as r:
        headers = time.perf_counter() - t0  # the response started (its headers parsed)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and any(c.get("text") for c in chunk.get("choices") or ()):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or {}
            for entry in usage.get("pdserve_timing") or ():
                if entry.get("index", 0) == 0:
                    timing = entry
    return {"ttft": ttft, "headers": headers, **timing}


def measure_all(roots: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Starts one server per tree, then sends the requests to them in turn (request i to every
    tree before request i + 1), so that every tree sees the same load on a shared machine."""
    servers = []
    try:
        for k, root in enumerate(roots):
            port = free_port()
            server = start(root, args, port, os.path.join(args.log_dir, f"server-{k}.log"))
            url = f"http://127.0.0.1:{port}"
            servers.append((root, server, url, model_id(url)))
        rows: dict[str, list[dict]] = {root: [] for root in roots}
        for i in range(args.requests):
            # a new prompt each time: a repeated one would hit the prefix cache
            words = [WORDS[(i * 7 + j * 13 + j * j) % len(WORDS)] for j in range(args.input_len)]
            for root, _, url, model in servers:
                rows[root].append(one_request(url, model, f"{i} " + " ".join(words), args.output_len))
    finally:
        for _, server, _, _ in servers:
            server.stop()
    return {root: summarize(r) for root, r in rows.items()}


def p50(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict]) -> dict:
    rest = rows[1:]
    ms = lambda key, rs=rest: None if p50([r.get(key) for r in rs]) is None else 1e3 * p50([r.get(key) for r in rs])  # noqa: E731
    out = {key: ms(key)
           for key in ("queue", "prefill", "worker_handoff", "first_token", "first_text", "headers", "ttft")}
    out["text_gap"] = (None if out["first_text"] is None or out["first_token"] is None
                       else out["first_text"] - out["first_token"])
    out["client_gap"] = None if out["ttft"] is None or out["first_text"] is None else out["ttft"] - out["first_text"]
    out["first_request_ttft"] = None if rows[0]["ttft"] is None else 1e3 * rows[0]["ttft"]
    out["first_over_rest_ttft"] = ((out["first_request_ttft"] / out["ttft"])
                                   if out["ttft"] and out["first_request_ttft"] else None)
    out["requests"] = len(rows)
    out["first_request"] = {k: (1e3 * v if isinstance(v, float) else v) for k, v in rows[0].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:tiny-wide-vocab")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer spec ('' for the model's own)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--input-len", type=int, default=64, help="prompt words")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--root", action="append", default=None,
                   help="a code tree to serve from (repeat to compare; default: this one)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write every tree's summary here as JSON")
    args = p.parse_args(argv)
    roots = [os.path.abspath(r) for r in (args.root or [ROOT])]
    import tempfile

    args.log_dir = tempfile.mkdtemp(prefix="first-token-gaps-")
    results = measure_all(roots, args)
    keys = ("queue", "prefill", "worker_handoff", "first_token", "first_text", "headers", "ttft", "text_gap",
            "client_gap", "first_request_ttft", "first_over_rest_ttft")
    print("| tree | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for i, (root, s) in enumerate(results.items()):
        cells = ["-" if s[k] is None else f"{s[k]:.2f}" for k in keys]
        print(f"| {i} | " + " | ".join(cells) + " |")
    for i, s in enumerate(results.values()):
        print(f"tree {i} request 1 (ms): " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in s["first_request"].items()))
    print("(ms, p50 over requests 2..N; first_request_ttft: request 1; logs in " + args.log_dir + ")")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
