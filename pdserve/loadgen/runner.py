"""One load run: build the schedule, check the server, send, scrape metrics, summarize.

Lifecycle of `run_load(cfg)`:
1. Schedule: arrival offsets (or a trace) paired with RequestSpecs from the dataset.
2. GET /v1/models (a clear ServerUnreachable if nothing answers) and pick the model.
3. Scrape /metrics (optional), then send each request at its offset, at most
   `concurrency` in flight, each bounded by the request timeout; the whole run is bounded
   by `max_run_time_s` (requests still in flight then are cancelled and recorded as such).
4. Scrape /metrics again; summarize records, SLO and KV deltas.

Ctrl-C raises RunInterrupted (a KeyboardInterrupt) that carries the partial result.
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pdserve.loadgen import arrivals, datasets
from pdserve.loadgen.client import ClientConfig, StreamingClient, make_http_client, resolve_model
from pdserve.loadgen.datasets import DatasetConfig, RequestSpec
from pdserve.loadgen.metrics import SLO, summarize
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.server_metrics import kv_transfer_delta, prefix_cache_delta, scrape

log = logging.getLogger(__name__)

ARRIVALS = arrivals.ARRIVAL_KINDS + ("trace",)


@dataclass(frozen=True)
class LoadConfig:
    client: ClientConfig
    rate: float | None = None          # req/s; for a trace: rescale it to this mean rate
    arrival: str = "poisson"           # poisson | gamma | constant | trace
    burstiness: float = 1.0            # gamma shape
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    trace_path: str | None = None
    trace_format: str | None = None
    trace_speedup: float = 1.0
    concurrency: int | None = None
    max_run_time_s: float | None = None
    slo: SLO | None = None
    scrape_metrics: bool = True

    def __post_init__(self):
        if self.arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival {self.arrival!r}; expected one of {', '.join(ARRIVALS)}")
        if self.arrival == "trace":
            if not self.trace_path:
                raise ValueError("trace arrival needs a trace path")
        else:
            if self.rate is None:
                raise ValueError(f"{self.arrival} arrival needs a rate")
            if self.num_requests is None and self.duration_s is None:
                raise ValueError("give a number of requests or a duration")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_run_time_s is not None and not (self.max_run_time_s > 0):
            raise ValueError(f"max run time must be > 0, got {self.max_run_time_s!r}")


@dataclass
class RunResult:
    records: list[RequestRecord]
    summary: dict
    model: str | None = None
    interrupted: bool = False


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; `result` holds what completed (and what was cancelled)."""

    def __init__(self, result: RunResult):
        super().__init__("interrupted")
        self.result = result


def build_schedule(cfg: LoadConfig) -> list[tuple[float, RequestSpec]]:
    if cfg.arrival == "trace":
        trace = arrivals.load_trace(cfg.trace_path, cfg.trace_format, max_requests=cfg.num_requests)
        trace = trace.scaled(rate=cfg.rate) if cfg.rate else trace.scaled(speedup=cfg.trace_speedup)
        offsets = trace.offsets_s
        if cfg.duration_s is not None:
            offsets = [o for o in offsets if o < cfg.duration_s]
        specs = datasets.requests_from_trace(trace.head(len(offsets)), cfg.seed, cfg.dataset.tokenizer)
        return list(zip(offsets, specs))
    offsets = arrivals.arrival_offsets(
        cfg.arrival, cfg.rate, num_requests=cfg.num_requests, duration_s=cfg.duration_s,
        seed=cfg.seed, burstiness=cfg.burstiness,
    )
    specs = datasets.build_requests(cfg.dataset, len(offsets), cfg.seed)
    return [(float(o), s) for o, s in zip(offsets, specs)]


def _progress(total: int, enabled: bool | None):
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, unit="req", disable=not enabled, leave=False, dynamic_ncols=True)


async def _run_async(cfg: LoadConfig, schedule, records: list[RequestRecord], on_record, progress) -> dict:
    http = make_http_client(cfg.concurrency)
    state: dict = {"model": None, "duration_s": None, "kv": {}, "prefix_cache": prefix_cache_delta(None, None)}
    async with http:
        model = await resolve_model(http, cfg.client)
        state["model"] = model
        client = StreamingClient(cfg.client, http, model)
        metrics_url = cfg.client.root + "/metrics"
        before = await scrape(http, metrics_url) if cfg.scrape_metrics else None
        sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        run_tag = uuid.uuid4().hex[:8]
        bar = _progress(len(schedule), progress)

        async def one(index: int, offset: float, spec: RequestSpec) -> None:
            record = RequestRecord(index=index, request_id=f"lg-{run_tag}-{index:06d}", scheduled_s=offset)
            try:
                if sem is None:
                    await client.fill(record, spec, t0)
                else:
                    async with sem:
                        await client.fill(record, spec, t0)
            except asyncio.CancelledError:
                record.error = record.error or "cancelled"
                raise
            finally:
                records.append(record)
                bar.update(1)
                if on_record is not None:
                    on_record(record)

        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        state["start_time_unix"] = time.time()  # wall clock of t0; record times are relative to it
        deadline = t0 + cfg.max_run_time_s if cfg.max_run_time_s else math.inf
        try:
            for index, (offset, spec) in enumerate(schedule):
                if t0 + offset >= deadline:
                    break
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(index, offset, spec)))
            if tasks:
                remaining = None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
                _, pending = await asyncio.wait(tasks, timeout=remaining)
                if pending:
                    log.warning("run time bound reached: cancelling %d requests in flight", len(pending))
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state["duration_s"] = time.perf_counter() - t0
            bar.close()
        after = await scrape(http, metrics_url) if cfg.scrape_metrics and before is not None else None
        state["kv"] = kv_transfer_delta(before, after)
        state["prefix_cache"] = prefix_cache_delta(before, after)
    return state


def run_load(
    cfg: LoadConfig,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Run one load (blocking). Raises ServerUnreachable before sending anything if the
    server does not answer, and RunInterrupted on Ctrl-C."""
    schedule = build_schedule(cfg)
    records: list[RequestRecord] = []
    try:
        state = asyncio.run(_run_async(cfg, schedule, records, on_record, progress))
    except KeyboardInterrupt:
        records.sort(key=lambda r: r.index)
        summary = summarize(records, slo=cfg.slo)
        raise RunInterrupted(RunResult(records, summary, interrupted=True)) from None
    records.sort(key=lambda r: r.index)
    summary = summarize(records, duration_s=state["duration_s"], slo=cfg.slo)
    summary.update(state["kv"])
    summary.update(state["prefix_cache"])
    summary["start_time_unix"] = state.get("start_time_unix")
    return RunResult(records, summary, model=state["model"])


# --------------------------------------------------------------------------------------
# Output


def write_summary_csv(path: str | Path, rows: list[dict]) -> None:
    """One CSV row per dict; the header is the union of keys in first-seen order."""
    header: list[str] = []
    for row in rows:
        header += [k for k in row if k not in header]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def write_run_outputs(out_dir: str | Path, result: RunResult, extra: dict | None = None) -> None:
    """records.jsonl, summary.json and summary.csv under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as f:
        for record in result.records:
            f.write(record.to_json() + "\n")
    row = dict(extra or {}) | {"model": result.model, "interrupted": result.interrupted} | result.summary
    (out / "summary.json").write_text(json.dumps(row, indent=2) + "\n")
    write_summary_csv(out / "summary.csv", [row])


def format_summary(summary: dict) -> str:
    """A short human table for the terminal."""
    def ms(key):
        v = summary.get(key)
        return "-" if v is None else f"{v * 1000:.1f}"

    def num(key, fmt="{:.2f}"):
        v = summary.get(key)
        return "-" if v is None else fmt.format(v)

    lines = [
        f"requests      {summary['num_ok']}/{summary['num_requests']} ok, {summary['num_errors']} errors "
        f"in {num('duration_s')} s",
        f"throughput    {num('request_throughput')} req/s, {num('output_token_throughput', '{:.1f}')} output tok/s",
        "latency (ms)  mean / p50 / p90 / p99",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        lines.append(f"  {name:<11} {ms(name + '_mean')} / {ms(name + '_p50')} / "
                     f"{ms(name + '_p90')} / {ms(name + '_p99')}")
    if "slo_attainment" in summary:
        lines.append(
            f"SLO           TTFT <= {summary['slo_ttft_s'] * 1000:g} ms, TPOT <= {summary['slo_tpot_s'] * 1000:g} ms: "
            f"{summary['slo_attainment'] * 100:.1f}% attained, goodput {num('goodput')} req/s"
        )
    if summary.get("kv_transfer_bytes") is not None:
        lines.append(
            f"KV transfer   {summary['kv_transfer_bytes'] / 1e6:.1f} MB in {num('kv_transfer_count', '{:.0f}')} "
            f"transfers, {num('kv_transfer_gbps')} Gbit/s"
        )
    lines.append(f"prefix cache  {describe_prefix_cache(summary)}")
    return "\n".join(lines)


def describe_prefix_cache(summary: dict) -> str:
    """The server's prefix-cache hit rate over the run, or n/a: prompts that repeat an earlier
    run's (the same --seed) hit the cache and look faster than new ones."""
    rate = summary.get("prefix_cache_hit_rate")
    if rate is None:
        if summary.get("prefix_cache_metric") is not None:
            return "n/a (no prompt looked up in the server's prefix cache during the run)"
        return "n/a (the server exports no prefix-cache counters on /metrics)"
    hits, queries, unit = summary["prefix_cache_hits"], summary["prefix_cache_queries"], summary["prefix_cache_unit"]
    text = f"{rate * 100:.1f}% hit ({hits:.0f} of {queries:.0f} prompt {unit})"
    if rate >= 0.5:
        text += "; prompts repeat what the server saw before (a new --seed draws new ones)"
    return text
