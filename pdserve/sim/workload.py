"""A loadgen workload as simulator arrivals: the same offsets and lengths a real run sends.

- synthetic, shared-prefix, sharegpt datasets and poisson / gamma / constant arrivals go
  through loadgen (`arrivals.arrival_offsets`, `datasets.build_requests`) with the spec's
  seed, so a simulated run sends what the real run of that spec sends. Their prompt lengths
  are loadgen's estimates (words x 1.3 without a tokenizer); the server counts its own, so
  `replay_arrivals` (the records of a real run) is what a fidelity comparison should use.
- traces (Azure, Mooncake, BurstGPT) are read by `arrivals.load_trace` and taken as lengths
  directly (no prompt text is built, so a million-request trace loads in seconds).
"""

from __future__ import annotations

from pathlib import Path

from pdserve.loadgen import arrivals, datasets
from pdserve.loadgen.datasets import DatasetConfig
from pdserve.loadgen.records import read_jsonl
from pdserve.sim.run import Arrival


def spec_arrivals(*, arrival: str, rate: float | None, num_requests: int | None, duration_s: float | None,
                  seed: int, dataset: DatasetConfig, burstiness: float = 1.0, trace_path: str | None = None,
                  trace_format: str | None = None, trace_speedup: float = 1.0) -> list[Arrival]:
    """The arrivals `pdserve.loadgen.runner.build_schedule` would send for these settings."""
    if arrival == "trace":
        trace = trace_arrivals(trace_path, trace_format, rate=rate, speedup=trace_speedup,
                               max_requests=num_requests)
        if duration_s is not None:
            trace = [a for a in trace if a.offset_s < duration_s]
        return trace
    offsets = arrivals.arrival_offsets(arrival, rate, num_requests=num_requests, duration_s=duration_s,
                                       seed=seed, burstiness=burstiness)
    specs = datasets.build_requests(dataset, len(offsets), seed)
    return [Arrival(float(o), s.prompt_tokens_est, s.max_tokens, s.prompt_tokens_est, s.group)
            for o, s in zip(offsets, specs)]


def trace_arrivals(path: str | None, fmt: str | None = None, *, rate: float | None = None, speedup: float = 1.0,
                   max_requests: int | None = None) -> list[Arrival]:
    if not path:
        raise ValueError("trace arrival needs a trace path")
    trace = arrivals.load_trace(path, fmt, max_requests=max_requests)
    trace = trace.scaled(rate=rate) if rate else trace.scaled(speedup=speedup)
    return [Arrival(o, n_in, n_out, n_in) for o, n_in, n_out in
            zip(trace.offsets_s, trace.input_tokens, trace.output_tokens)]


def replay_arrivals(records_file: str | Path) -> list[Arrival]:
    """The requests of a real run's records: scheduled send time, the server-counted prompt
    tokens and the `max_tokens` asked (records without a server count keep the estimate)."""
    out = []
    for r in read_jsonl(records_file):
        prompt = r.prompt_tokens or r.prompt_tokens_est
        if not prompt or not r.max_tokens:
            raise ValueError(f"{records_file}: record {r.index} has no prompt token count or max_tokens to replay")
        out.append(Arrival(r.scheduled_s, int(prompt), int(r.max_tokens), r.prompt_tokens_est, r.group))
    out.sort(key=lambda a: a.offset_s)
    return out
