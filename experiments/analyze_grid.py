"""The link-rate x policy grid's figures, from a finished `experiments/run_gpu_grid.sh` run.

    python3 -m experiments.analyze_grid gpu-grid          # a name: results/gpu-grid, else its archive
    python3 -m experiments.analyze_grid path/to/a/run     # or any results folder

Reads <exp>/summary.csv and runs/*.jsonl (pdserve-loadgen experiment; records carry the
router's per-request timing, usage.pdserve_timing) and <exp>/cluster/ (links.jsonl: the SET
rate of every pair per configuration; gpu_samples.csv; cluster.json). Writes <exp>/analysis/:

- grid.csv: per policy x link rate x request rate: TTFT/TPOT p50/p90, goodput, attainment, KV
  transfer p50/p90, the TTFT breakdown (means of place, reserve, queue, prefill, kv_tail and the
  rest), first decode step, requests per pair, GPU utilisation per worker;
- ratios.csv: network-aware's goodput over round-robin's and least-loaded's, per link rate (best
  over the request rates) and per point; per link rate, whether the transfer is a visible part
  of TTFT and whether issue 16's goodput target for that case is met (`verdict`);
- links.csv: per run and pair against the SET rate: the link-bound Gbit/s (server_timing's
  kv_link_bytes over kv_link: the bytes the paced link carried while it held them back, over its
  time on them; issue 16's 5% target is judged on it; "not recorded" in runs from before these
  fields), and the busy-interval Gbit/s (KV bytes over the union of the transfers' [ack - kv, ack]
  intervals, which includes the time the prefill's compute paced the transfer); the pair's mean
  Gbit/s over the whole run and the share of the run it was busy (network utilisation);
- grid.md (all tables) and plots/*.png (when matplotlib is there).

A name is looked up by experiments/records.py: a new run in results/<name>, else the committed
archive docs/records/<name>.tar.xz, extracted once into results/.records/<name> (the analysis is
written there). Runs anywhere the results are (no GPU, no pdserve import): copy the directory
and rerun it.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from experiments.records import resolve

POLICIES = ("round-robin", "least-loaded", "network-aware")
# TTFT = place + reserve + queue + prefill + kv_after + rest, on the router's clocks: kv_after is
# the Prefill call's time after the first token was computed (the KV still in flight, its ack,
# the reply); rest is the client's TTFT minus all of them (HTTP, tokenizing, streaming out).
BREAKDOWN = ("place", "reserve", "queue", "prefill", "kv_after")
OFF_TOLERANCE = 0.05
MIN_LINK_S = 0.01  # less link-bound time than this on a pair is too little to judge its rate


class AnalysisError(ValueError):
    """The results directory is missing something the analysis needs; the message names it."""


def _float(value) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def read_summary(exp: Path) -> list[dict]:
    path = exp / "summary.csv"
    if not path.is_file():
        raise AnalysisError(f"{path}: not found; is {exp} the output_dir of a finished experiment?")
    rows = list(csv.DictReader(open(path)))
    if not rows or "bandwidth_gbps" not in rows[0] or "policy" not in rows[0]:
        raise AnalysisError(f"{path}: needs the grid axes policy and bandwidth_gbps")
    return rows


def read_records(exp: Path, row: dict) -> list[dict]:
    path = exp / (row.get("records_file") or f"runs/{row['run_id']}.jsonl")
    if not path.is_file():
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def read_links(exp: Path) -> dict[tuple[str, float], dict[str, float]]:
    """(policy, bandwidth) -> {"p->d": SET Gbit/s}, the last setting of each configuration."""
    path = exp / "cluster" / "links.jsonl"
    out: dict[tuple[str, float], dict[str, float]] = {}
    if path.is_file():
        for line in open(path):
            if line.strip():
                entry = json.loads(line)
                out[(entry["policy"], float(entry["bandwidth_gbps"]))] = entry["links"]
    return out


def read_gpu_samples(exp: Path) -> list[dict]:
    path = exp / "cluster" / "gpu_samples.csv"
    return list(csv.DictReader(open(path))) if path.is_file() else []


def ok_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("error") is None and r.get("status") == 200 and r.get("e2e_s") is not None]


def timed(records: list[dict], placement: str | None = "disaggregated") -> list[dict]:
    """The server timings of `records` (of one placement kind, or all with None)."""
    out = []
    for r in ok_records(records):
        t = r.get("server_timing") or {}
        if t and (placement is None or t.get("placement") == placement):
            extra = {"ttft": r.get("ttft_s")}
            if all(isinstance(t.get(k), (int, float)) for k in ("prefill_rpc", "queue", "prefill")):
                extra["kv_after"] = max(0.0, t["prefill_rpc"] - t["queue"] - t["prefill"])
            out.append(t | extra)
    return out


def breakdown(records: list[dict]) -> dict[str, float | None]:
    """Means of the TTFT parts (BREAKDOWN) over the disaggregated requests, `rest`, the router's
    kv_tail (KV time after the last layer was staged), KV p50/p90, wire and wait; `first_decode`
    is after the first token."""
    ts = [t for t in timed(records) if t.get("ttft") is not None]
    out = {f"ttft_{k}_mean": _mean([t[k] for t in ts if isinstance(t.get(k), (int, float))]) for k in BREAKDOWN}
    rest = [t["ttft"] - sum(t.get(k) or 0.0 for k in BREAKDOWN) for t in ts]
    out["ttft_rest_mean"] = _mean(rest)
    out["ttft_mean_timed"] = _mean([t["ttft"] for t in ts])
    out["first_decode_mean"] = _mean([t["first_decode"] for t in ts if isinstance(t.get("first_decode"), (int, float))])
    kv = [t["kv"] for t in ts if isinstance(t.get("kv"), (int, float))]
    out["kv_p50"], out["kv_p90"] = _pct(kv, 50), _pct(kv, 90)
    out["kv_tail_mean"] = _mean([t["kv_tail"] for t in ts if isinstance(t.get("kv_tail"), (int, float))])
    out["kv_wire_mean"] = _mean([t["kv_wire"] for t in ts if isinstance(t.get("kv_wire"), (int, float))])
    out["kv_wait_mean"] = _mean([t["kv_wait"] for t in ts if isinstance(t.get("kv_wait"), (int, float))])
    return out


def pairs(records: list[dict]) -> Counter:
    counts: Counter = Counter()
    for t in timed(records, None):
        if t.get("placement") == "disaggregated":
            counts[f"{t.get('prefill_worker')}->{t.get('decode_worker')}"] += 1
        else:
            counts[f"local@{t.get('decode_worker')}"] += 1
    return counts


def reply_lag(t: dict) -> float:
    """Seconds from a transfer's acknowledgement to the router's kv_done_at stamp, beyond the KV
    the Prefill call waited for: prefill_rpc - queue - prefill - kv_tail (the reply, and on runs
    before the sender recorded completions as they happened, the wait for the driver to record
    the last sends: up to max_inflight paced messages, ~0.3 s at 1 Gbit/s)."""
    parts = [t.get(k) for k in ("prefill_rpc", "queue", "prefill", "kv_tail")]
    if not all(isinstance(v, (int, float)) for v in parts):
        return 0.0
    return max(0.0, parts[0] - parts[1] - parts[2] - parts[3])


def achieved_rates(records: list[dict]) -> dict[str, dict]:
    """pair -> bytes, busy seconds (the union of its transfers' [ack - kv, ack] intervals, ack =
    kv_done_at - reply_lag), achieved Gbit/s over that time, transfers, the mean reply lag; and
    the link-bound figure: link_bytes over link_s (server_timing kv_link_bytes, kv_link; None
    where the records do not have them), link_gbps."""
    spans: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    lags: dict[str, list[float]] = defaultdict(list)
    link: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in timed(records):
        done, kv, nbytes = t.get("kv_done_at"), t.get("kv"), t.get("kv_bytes")
        if all(isinstance(v, (int, float)) for v in (done, kv, nbytes)) and kv > 0:
            pair = f"{t['prefill_worker']}->{t['decode_worker']}"
            lag = reply_lag(t)
            spans[pair].append((done - lag - kv, done - lag, nbytes))
            lags[pair].append(lag)
            if isinstance(t.get("kv_link"), (int, float)) and isinstance(t.get("kv_link_bytes"), (int, float)):
                link[pair].append((t["kv_link_bytes"], t["kv_link"]))
    out = {}
    for pair, items in spans.items():
        busy, end = 0.0, -math.inf
        for start, stop, _ in sorted(items):
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        nbytes = sum(b for _, _, b in items)
        link_bytes = sum(b for b, _ in link[pair]) if link.get(pair) else None
        link_s = sum(s for _, s in link[pair]) if link.get(pair) else None
        out[pair] = {"bytes": nbytes, "busy_s": busy, "transfers": len(items),
                     "achieved_gbps": nbytes * 8 / busy / 1e9 if busy > 0 else None,
                     "reply_lag_mean": _mean(lags[pair]),
                     "link_recorded": bool(link.get(pair)), "link_bytes": link_bytes, "link_s": link_s,
                     "link_transfers": sum(1 for b, _ in link.get(pair, []) if b > 0),
                     "link_gbps": link_bytes * 8 / link_s / 1e9 if link_s and link_s >= MIN_LINK_S else None}
    return out


def gpu_utilisation(samples: list[dict], start: float | None, duration: float | None) -> dict[str, float | None]:
    """Mean SM % per worker (nvidia-smi pmon) and per GPU over [start, start + duration]."""
    if start is None or duration is None or not samples:
        return {}
    acc: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        t, sm = _float(s.get("time_unix")), _float(s.get("sm_pct"))
        if t is None or sm is None or not start <= t <= start + duration:
            continue
        key = f"gpu_util_{s['worker']}" if s.get("source") == "process" and s.get("worker") else (
            f"gpu_util_gpu{s['gpu']}" if s.get("source") == "gpu" else None)
        if key:
            acc[key].append(sm)
    return {k: _mean(v) for k, v in sorted(acc.items())}


def grid_rows(exp: Path) -> tuple[list[dict], list[dict]]:
    """(grid rows, link rows) of every run in summary.csv."""
    links_set = read_links(exp)
    samples = read_gpu_samples(exp)
    grid, links = [], []
    for row in read_summary(exp):
        policy, bandwidth, rate = row["policy"], _float(row["bandwidth_gbps"]), _float(row["rate"])
        records = read_records(exp, row)
        out = {"policy": policy, "bandwidth_gbps": bandwidth, "rate": rate, "run_id": row["run_id"],
               "num_requests": row.get("num_requests"), "num_ok": row.get("num_ok"), "error": row.get("error") or ""}
        for key in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput", "slo_attainment", "request_throughput"):
            out[key] = _float(row.get(key))
        out |= breakdown(records)
        out["pairs"] = " ".join(f"{k}:{v}" for k, v in sorted(pairs(records).items()))
        out |= gpu_utilisation(samples, _float(row.get("start_time_unix")), _float(row.get("duration_s")))
        grid.append(out)
        set_rates = links_set.get((policy, bandwidth), {})
        duration = _float(row.get("duration_s"))
        for pair, a in sorted(achieved_rates(records).items()):
            target = set_rates.get(pair)
            ratio = a["achieved_gbps"] / target if target and a["achieved_gbps"] else None
            link_ratio = a["link_gbps"] / target if target and a["link_gbps"] else None
            mean_gbps = a["bytes"] * 8 / duration / 1e9 if duration else None
            links.append({"policy": policy, "bandwidth_gbps": bandwidth, "rate": rate, "pair": pair,
                          "set_gbps": target, "link_recorded": a["link_recorded"], "link_gbps": a["link_gbps"],
                          "link_ratio": link_ratio,
                          "link_share": (a["link_bytes"] / a["bytes"] if a["link_bytes"] is not None and a["bytes"]
                                         else None),
                          "link_s": a["link_s"], "link_transfers": a["link_transfers"],
                          # issue 16's target, on the link-bound figure; None: not recorded / too little to judge
                          "off_by_more_than_5pct": None if link_ratio is None else abs(link_ratio - 1) > OFF_TOLERANCE,
                          "achieved_gbps": a["achieved_gbps"], "ratio": ratio,
                          "above_set_by_more_than_5pct": ratio is not None and ratio > 1 + OFF_TOLERANCE,
                          "reply_lag_mean": a["reply_lag_mean"],
                          "transfers": a["transfers"], "busy_s": a["busy_s"], "bytes": a["bytes"],
                          "run_mean_gbps": mean_gbps, "busy_share": a["busy_s"] / duration if duration else None})
    return grid, links


def ratio_rows(grid: list[dict]) -> list[dict]:
    """network-aware's goodput over each baseline's: best over the rates per link rate, and per point."""
    by = defaultdict(dict)
    for g in grid:
        by[(g["bandwidth_gbps"], g["rate"])][g["policy"]] = g["goodput"]
    out = []
    for bandwidth in sorted({b for b, _ in by}):
        best = {p: max((v[p] or 0.0 for (b, _), v in by.items() if b == bandwidth and p in v), default=None)
                for p in POLICIES}
        out.append({"bandwidth_gbps": bandwidth, "rate": "best", **_ratios(best),
                    **verdict(grid, bandwidth, best)})
        for (b, rate), goodputs in sorted(by.items()):
            if b == bandwidth:
                out.append({"bandwidth_gbps": b, "rate": rate, **_ratios(goodputs)})
    return out


VISIBLE_SHARE = 0.10  # the transfer "is a visible part of TTFT" above this share (issue 16's targets)


def verdict(grid: list[dict], bandwidth: float, best: dict) -> dict:
    """Issue 16's targets at one link rate. `kv_share`: the KV after the first token as a share of
    TTFT for round-robin at its lowest rate (the network's own weight, before queues build). Where
    it is visible (>= VISIBLE_SHARE): network-aware >= 1.5x round-robin and >= 1.2x least-loaded;
    elsewhere: network-aware >= 0.95x the best baseline."""
    rr = sorted((g for g in grid if g["policy"] == "round-robin" and g["bandwidth_gbps"] == bandwidth),
                key=lambda g: g["rate"])
    share = None
    if rr and rr[0].get("ttft_kv_after_mean") is not None and rr[0].get("ttft_mean_timed"):
        share = rr[0]["ttft_kv_after_mean"] / rr[0]["ttft_mean_timed"]
    na, rr_best, ll_best = best.get("network-aware"), best.get("round-robin"), best.get("least-loaded")
    if share is None or na is None:
        return {"kv_share": share, "network_visible": None, "target": "", "target_met": None}
    if share >= VISIBLE_SHARE:
        met = (rr_best is None or na >= 1.5 * rr_best) and (ll_best is None or na >= 1.2 * ll_best)
        return {"kv_share": share, "network_visible": True, "target": "NA >= 1.5x RR and >= 1.2x LL",
                "target_met": met}
    baselines = [g for g in (rr_best, ll_best) if g is not None]
    met = not baselines or na >= 0.95 * max(baselines)
    return {"kv_share": share, "network_visible": False, "target": "NA >= 0.95x best baseline", "target_met": met}


def _ratios(goodput: dict) -> dict:
    na = goodput.get("network-aware")
    out = {f"goodput_{p}": goodput.get(p) for p in POLICIES}
    for base, key in (("round-robin", "na_over_rr"), ("least-loaded", "na_over_ll")):
        b = goodput.get(base)
        out[key] = na / b if na is not None and b else (math.inf if na and b == 0 else None)
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)


def _fmt(v, scale: float = 1.0, digits: int = 2) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{v * scale:.{digits}f}" if isinstance(v, (int, float)) else str(v)


def _gbps(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def markdown(exp: Path, grid: list[dict], ratios: list[dict], links: list[dict]) -> str:
    env = json.loads((exp / "environment.json").read_text()) if (exp / "environment.json").is_file() else {}
    cluster_json = exp / "cluster" / "cluster.json"
    cluster = json.loads(cluster_json.read_text()) if cluster_json.is_file() else {}
    lines = [f"# Link rate x placement policy grid: `{exp.name}`", "",
             f"- GPUs: {', '.join(env.get('gpus') or []) or 'none (CPU)'}; "
             f"CPU: {env.get('cpu_model')} x {env.get('cpu_count')}",
             f"- packages: {env.get('packages')}; git {str(env.get('git_commit'))[:12]}, time {env.get('time_utc')}",
             f"- model {cluster.get('model')}; workers: " + ", ".join(
                 f"{w['id']} ({w['role']}, GPU {w.get('gpu')})" for w in cluster.get("workers", [])),
             "- links: sender-side token bucket per (P, D) pair; SET rates per configuration in cluster/links.jsonl",
             "- GPU utilisation: " + ("nvidia-smi samples (pmon SM % per worker process, utilization.gpu per GPU)"
                                     if any(k.startswith("gpu_util") for g in grid for k in g)
                                     else "missing (not sampled)"),
             "", "## TTFT, TPOT, goodput and KV transfer latency (ms, req/s)", "",
             "| link Gbit/s | policy | rate | ok | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | goodput | KV p50 "
             "| KV p90 | pairs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in sorted(grid, key=lambda g: (g["bandwidth_gbps"], POLICIES.index(g["policy"]) if g["policy"] in POLICIES
                                         else 9, g["rate"])):
        lines.append(f"| {g['bandwidth_gbps']:g} | {g['policy']} | {g['rate']:g} | {g['num_ok']}/{g['num_requests']} | "
                     f"{_fmt(g['ttft_p50'], 1e3, 0)} | {_fmt(g['ttft_p90'], 1e3, 0)} | {_fmt(g['tpot_p50'], 1e3, 1)} | "
                     f"{_fmt(g['tpot_p90'], 1e3, 1)} | {_fmt(g['goodput'])} | {_fmt(g['kv_p50'], 1e3, 0)} | "
                     f"{_fmt(g['kv_p90'], 1e3, 0)} | {g['pairs']} |")
    lines += ["", "## Goodput: network-aware over the baselines", "",
              "best: each policy's highest goodput over the request rates. KV share: the KV after the first "
              "token as a share of TTFT for round-robin at its lowest rate; the issue's target follows from it.", "",
              "| link Gbit/s | rate | RR | LL | NA | NA/RR | NA/LL | KV share | target | met |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        rate = r["rate"] if isinstance(r["rate"], str) else f"{r['rate']:g}"
        met = {True: "yes", False: "**no**", None: ""}[r.get("target_met")]
        lines.append(f"| {r['bandwidth_gbps']:g} | {rate} | {_fmt(r['goodput_round-robin'])} | "
                     f"{_fmt(r['goodput_least-loaded'])} | {_fmt(r['goodput_network-aware'])} | "
                     f"{_fmt(r['na_over_rr'])} | {_fmt(r['na_over_ll'])} | "
                     f"{_fmt(r.get('kv_share'), 100, 0) + '%' if r.get('kv_share') is not None else ''} | "
                     f"{r.get('target', '')} | {met} |")
    lines += ["", "## Where TTFT went (means over disaggregated requests, ms)", "",
              "kv_after: the Prefill call after the first token was computed (KV still in flight, its ack: the "
              "transfer's visible part); rest: HTTP, tokenizing, streaming. first decode: D's first step, after "
              "the first token. KV wire: first message posted to the last one done; KV wait: before the first "
              "was posted (pacing, connecting).", "",
              "| link Gbit/s | policy | rate | TTFT | place | reserve | queue | prefill | kv_after | rest "
              "| kv_after share | first decode | KV wire | KV wait |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in sorted(grid, key=lambda g: (g["bandwidth_gbps"], g["policy"], g["rate"])):
        share = (g["ttft_kv_after_mean"] / g["ttft_mean_timed"]
                 if g.get("ttft_kv_after_mean") is not None and g.get("ttft_mean_timed") else None)
        lines.append(f"| {g['bandwidth_gbps']:g} | {g['policy']} | {g['rate']:g} | "
                     f"{_fmt(g['ttft_mean_timed'], 1e3, 0)} | "
                     + " | ".join(_fmt(g[f'ttft_{k}_mean'], 1e3, 1) for k in (*BREAKDOWN, "rest"))
                     + f" | {_fmt(share, 100, 0)}% | {_fmt(g['first_decode_mean'], 1e3, 1)} | "
                     f"{_fmt(g['kv_wire_mean'], 1e3, 1)} | {_fmt(g['kv_wait_mean'], 1e3, 1)} |")
    lines += ["", "## Achieved vs SET link rate", ""] + link_section(links)
    pacing = exp / "cluster" / "pacing.txt"
    lines += ["", "### Pure-link check before the sweep (benchmarks/bench_pacing.py)", ""]
    if pacing.is_file():
        lines += ["One KV transfer at a time between two processes on one GPU, paced at each SET rate "
                  "(cluster/pacing.txt):", "", "```", pacing.read_text().rstrip(), "```"]
    else:
        lines.append("not recorded (cluster/pacing.txt: runs from before run_gpu_grid.sh's links step)")
    util_keys = sorted({k for g in grid for k in g if k.startswith("gpu_util")})
    lines += ["", "## GPU utilisation (mean SM %, per run)", ""]
    if util_keys:
        lines += ["gpu<i>: utilization.gpu of GPU i; the others: pmon SM % of the worker's process (a worker that ran "
                  "nothing in the run has no pmon row). -: no sample fell inside the run (nvidia-smi samples about "
                  "once a second, so a run shorter than that can have none).", ""]
        lines += ["| link Gbit/s | policy | rate | " + " | ".join(k.removeprefix("gpu_util_") for k in util_keys)
                  + " |",
                  "|---|---|---|" + "---|" * len(util_keys)]
        for g in grid:
            lines.append(f"| {g['bandwidth_gbps']:g} | {g['policy']} | {g['rate']:g} | "
                         + " | ".join(_fmt(g.get(k), 1, 0) for k in util_keys) + " |")
    else:
        lines.append("missing: no nvidia-smi samples (a CPU run, or the sampler found no GPU)")
    return "\n".join(lines) + "\n"


def link_section(links: list[dict]) -> list[str]:
    """grid.md's achieved-vs-SET text and table; issue 16's 5% target judged on the link-bound rate."""
    judged = [link for link in links if link["off_by_more_than_5pct"] is not None]
    off = [link for link in judged if link["off_by_more_than_5pct"]]
    unrecorded = [link for link in links if not link["link_recorded"]]
    short = [link for link in links if link["link_recorded"] and link["off_by_more_than_5pct"] is None]
    above = [link for link in links if link["above_set_by_more_than_5pct"]]
    lines = [
        "**link-bound** (the link's own rate, on which the 5% target is judged): the bytes the paced link "
        "carried while it was the bottleneck over its time on them (server_timing kv_link_bytes / kv_link, "
        "summed over the pair's transfers). A KV message counts when it was ready before the link had "
        "posted the previous one (it queued behind earlier bytes, so the link and not the prefill's "
        "compute held it) and it waited for the bucket after a message that did too (what the bucket let "
        "through at once, its burst, is left out); its time runs from that post to its own, on the sender's "
        "clock. **link share**: "
        "the part of the pair's KV bytes that was link-bound (the rest streamed as the layers were "
        "computed). *not recorded*: records from before the workers reported these fields; "
        f"*too little*: less than {MIN_LINK_S * 1e3:g} ms link-bound.",
        "",
        "**busy-interval**: KV bytes over the union of the pair's [ack - kv, ack] intervals (ack = the "
        "router's kv_done_at less the reply lag: prefill_rpc - queue - prefill - kv_tail; **lag** is its "
        "mean). It includes the time the prefill's compute paced a transfer that streamed layer by layer, "
        "so a fast link reads low when the prefill is slower than it; that is not a pacing error. It "
        "cannot read above the SET rate by more than the bucket's burst (1 MiB per idle period) unless the "
        "pacer lets bytes through too fast: such entries are flagged ABOVE. (Before the sender recorded "
        "its sends as they completed, the Prefill reply came up to ~0.3 s after the ack at 1 Gbit/s when "
        "a transfer queued behind; the uncorrected stamps read 1.02-1.16x the SET rate.)",
        "",
        (f"Target (link-bound within 5% of SET): {len(judged) - len(off)} of {len(judged)} judged "
         f"(run, pair) entries within, {len(off)} more than 5% off; {len(unrecorded)} not recorded"
         + (f", {len(short)} too little link-bound time" if short else "") if judged else
         f"Target (link-bound within 5% of SET): not judged: {len(unrecorded)} of {len(links)} entries have no "
         "link-bound figures (records from before the workers reported kv_link / kv_link_bytes; a rerun judges it)"
         + (f", {len(short)} too little link-bound time" if short else ""))
        + f". Busy-interval above SET by more than 5%: {len(above)} of {len(links)}.",
        "",
        "| link Gbit/s | policy | rate | pair | SET | link-bound | link ratio | link share | busy-interval "
        "| busy ratio | lag ms | transfers | busy share | mean over run | flag |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link in links:
        if not link["link_recorded"]:
            link_gbps, link_ratio, link_share = "not recorded", "-", "-"
        elif link["link_gbps"] is None:
            link_gbps, link_ratio, link_share = "too little", "-", _fmt(link["link_share"], 100, 0) + "%"
        else:
            link_gbps, link_ratio = _gbps(link["link_gbps"]), _fmt(link["link_ratio"], digits=3)
            link_share = _fmt(link["link_share"], 100, 0) + "%"
        flags = (["OFF >5%"] if link["off_by_more_than_5pct"] else []) + (
            ["ABOVE SET"] if link["above_set_by_more_than_5pct"] else [])
        lines.append(f"| {link['bandwidth_gbps']:g} | {link['policy']} | {link['rate']:g} | {link['pair']} | "
                     f"{_gbps(link['set_gbps'])} | {link_gbps} | {link_ratio} | {link_share} | "
                     f"{_gbps(link['achieved_gbps'])} | {_fmt(link['ratio'])} | "
                     f"{_fmt(link['reply_lag_mean'], 1e3, 0)} | "
                     f"{link['transfers']} | {_fmt(link['busy_share'], 100, 0)}% | {_gbps(link['run_mean_gbps'])} | "
                     f"{' '.join(flags)} |")
    return lines


def plot(grid: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    panels = [("ttft_p50", "TTFT p50 (s)"), ("ttft_p90", "TTFT p90 (s)"), ("tpot_p50", "TPOT p50 (s)"),
              ("tpot_p90", "TPOT p90 (s)"), ("goodput", "goodput (req/s)"), ("kv_p50", "KV transfer p50 (s)")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    styles = ["-", "--", ":", "-."]
    for ax, (key, title) in zip(axes.flat, panels):
        for policy in sorted({g["policy"] for g in grid}):
            rows = [g for g in grid if g["policy"] == policy]
            bandwidths = sorted({g["bandwidth_gbps"] for g in rows})
            levels = max(len([g for g in rows if g["bandwidth_gbps"] == b]) for b in bandwidths)
            for level in range(levels):
                xs, ys = [], []
                for b in bandwidths:
                    at = sorted((g for g in rows if g["bandwidth_gbps"] == b), key=lambda g: g["rate"])
                    if level < len(at) and at[level].get(key) is not None:
                        xs.append(b)
                        ys.append(at[level][key])
                color = {"round-robin": "tab:red", "least-loaded": "tab:blue", "network-aware": "tab:green"}.get(policy)
                ax.plot(xs, ys, styles[level % 4], marker="o", color=color, label=f"{policy}, load {level + 1}")
        ax.set_xscale("log")
        ax.set_xlabel("fast-pair link rate (Gbit/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("load level k = the k-th lowest request rate of that link rate (rates in grid.csv)")
    fig.tight_layout()
    paths = [out / "grid.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    rows = sorted(grid, key=lambda g: (g["bandwidth_gbps"], g["policy"], g["rate"]))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.35), 5))
    bottom = [0.0] * len(rows)
    for key in (*BREAKDOWN, "rest"):
        vals = [g.get(f"ttft_{key}_mean") or 0.0 for g in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{g['bandwidth_gbps']:g}G {g['policy'][:2].upper()} {g['rate']:g}" for g in rows],
                       rotation=90, fontsize=7)
    ax.set_ylabel("mean TTFT part (s)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "ttft_breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def analyze(exp: Path) -> Path:
    grid, links = grid_rows(exp)
    ratios = ratio_rows(grid)
    out = exp / "analysis"
    out.mkdir(exist_ok=True)
    write_csv(out / "grid.csv", grid)
    write_csv(out / "ratios.csv", ratios)
    write_csv(out / "links.csv", links)
    text = markdown(exp, grid, ratios, links)
    paths = plot(grid, out / "plots")
    text += "\n" + ("\n".join(f"![{p.stem}](plots/{p.name})" for p in paths) if paths
                    else "plots: skipped (matplotlib is not installed here; rerun this script where it is)") + "\n"
    (out / "grid.md").write_text(text)
    return out / "grid.md"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        path = analyze(resolve(argv[0]))
    except (AnalysisError, FileNotFoundError) as e:
        print(f"analyze_grid: error: {e}", file=sys.stderr)
        return 2
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
