"""Latency and throughput metrics over RequestRecords. Pure: no I/O, no clock.

Definitions (per request, over successful requests only):
- TTFT: send to first output chunk.
- TPOT: (E2E - TTFT) / (n - 1) for n > 1 output tokens, n from the server's `usage`
  (or counted chunks when the server sends no usage); undefined for n <= 1.
- ITL: gaps between consecutive output chunks.
- E2E: send to end of stream.

Percentiles use linear interpolation between closest ranks (numpy's default), so p50 of
[1, 2, 3, 4] is 2.5.

SLO attainment is the fraction of *all* requests (failed ones count as missing) with
TTFT <= slo.ttft_s and TPOT <= slo.tpot_s (a request with one output token has no TPOT and
is judged on TTFT alone). Goodput is the number of requests meeting the SLO per second.
`max_rate_meeting_slo` is DistServe's per-GPU-rate definition: the highest request rate at
which at least `target` (90%) of requests meet both SLOs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from pdserve.loadgen.records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"SLO {name} must be > 0 seconds, got {value!r}")


def tpot(record: RequestRecord) -> float | None:
    n = record.num_output_tokens
    if not record.ok or record.ttft_s is None or n <= 1:
        return None
    return (record.e2e_s - record.ttft_s) / (n - 1)


def itls(record: RequestRecord) -> list[float]:
    times = record.token_times_s
    return [b - a for a, b in zip(times, times[1:])]


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok or record.ttft_s is None or record.ttft_s > slo.ttft_s:
        return False
    per_token = tpot(record)
    return per_token is None or per_token <= slo.tpot_s


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    if not records:
        return 0.0
    return sum(meets_slo(r, slo) for r in records) / len(records)


def distribution(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `values` under keys like `ttft_p90`; None when empty."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values, dtype=float)
    out[f"{prefix}_mean"] = float(arr.mean()) if arr.size else None
    for p in PERCENTILES:
        out[f"{prefix}_p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


# The server's per-request timing (RequestRecord.server_timing) that summaries break TTFT into.
BREAKDOWN_KEYS = ("place", "reserve", "queue", "prefill", "kv", "kv_wire", "kv_wait", "kv_tail", "first_decode",
                  "worker_handoff", "first_token", "first_text")


def server_breakdown(records: Sequence[RequestRecord]) -> dict[str, float | int | None]:
    """`srv_<key>_p50` / `srv_<key>_mean` for BREAKDOWN_KEYS over the records the server timed,
    `srv_kv_gbps_p50`, and `srv_timed` (how many were timed) and `srv_local` (ran whole on a
    decode worker); nothing at all when no record carries a timing."""
    timed = [r.server_timing for r in records if r.server_timing]
    if not timed:
        return {}
    out: dict[str, float | int | None] = {"srv_timed": len(timed),
                                          "srv_local": sum(t.get("placement") == "local" for t in timed)}
    for key in (*BREAKDOWN_KEYS, "kv_gbps"):
        values = np.asarray([t[key] for t in timed if isinstance(t.get(key), (int, float))], dtype=float)
        out[f"srv_{key}_p50"] = float(np.percentile(values, 50)) if values.size else None
        if key != "kv_gbps":
            out[f"srv_{key}_mean"] = float(values.mean()) if values.size else None
    return out


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First send to last finish, from the records themselves."""
    sent = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.sent_s + r.e2e_s for r in records if r.sent_s is not None and r.e2e_s is not None]
    if not sent or not ends:
        return 0.0
    return max(ends) - min(sent)


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float | None = None,
    slo: SLO | None = None,
) -> dict[str, float | int | None]:
    """One flat dict of metrics; `duration_s` defaults to first send -> last finish."""
    if duration_s is None:
        duration_s = run_duration(records)
    ok = [r for r in records if r.ok]
    out: dict[str, float | int | None] = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "duration_s": duration_s,
    }
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    rate = (lambda x: x / duration_s) if duration_s and duration_s > 0 else (lambda x: None)
    out["total_prompt_tokens"] = prompt_tokens
    out["total_output_tokens"] = output_tokens
    out["request_throughput"] = rate(len(ok))
    out["input_token_throughput"] = rate(prompt_tokens)
    out["output_token_throughput"] = rate(output_tokens)
    out.update(distribution([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"))
    out.update(distribution([t for t in map(tpot, ok) if t is not None], "tpot"))
    out.update(distribution([g for r in ok for g in itls(r)], "itl"))
    out.update(distribution([r.e2e_s for r in ok], "e2e"))
    kv = [r.kv_bytes for r in ok if r.kv_bytes is not None]
    out["kv_bytes_mean"] = float(np.mean(kv)) if kv else None
    out.update(server_breakdown(ok))
    if slo is not None:
        met = sum(meets_slo(r, slo) for r in records)
        out["slo_ttft_s"] = slo.ttft_s
        out["slo_tpot_s"] = slo.tpot_s
        out["slo_attainment"] = met / len(records) if records else 0.0
        out["goodput"] = rate(met)
    return out


# --------------------------------------------------------------------------------------
# Rate search


@dataclass
class RateSearchResult:
    """`rate` is the highest probed rate meeting the target (None if even `lo` failed)."""

    rate: float | None
    target: float
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)


RunOutcome = float | Mapping | Sequence[RequestRecord]


def _attainment(outcome: RunOutcome, slo: SLO) -> float:
    if isinstance(outcome, (int, float)):
        return float(outcome)
    if isinstance(outcome, Mapping):
        return float(outcome["slo_attainment"])
    return slo_attainment(outcome, slo)


def max_rate_meeting_slo(
    run_fn: Callable[[float], RunOutcome],
    slo: SLO,
    target: float = 0.9,
    lo: float = 0.5,
    hi: float = 64.0,
    *,
    max_probes: int = 8,
    rel_tol: float = 0.05,
    on_probe: Callable[[float, float], None] | None = None,
) -> RateSearchResult:
    """Binary search for the highest rate in [lo, hi] whose SLO attainment >= target.

    `run_fn(rate)` runs a load at `rate` req/s and returns an attainment in [0, 1], a
    summary dict with `slo_attainment`, or the run's RequestRecords. Attainment is assumed
    to fall as the rate rises. At most `max_probes` calls; stops when the bracket is within
    `rel_tol` of its upper end.
    """
    if not (0 < target <= 1):
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if not (0 < lo < hi):
        raise ValueError(f"need 0 < lo < hi, got lo={lo!r} hi={hi!r}")
    if max_probes < 2:
        raise ValueError(f"max_probes must be >= 2, got {max_probes}")
    result = RateSearchResult(rate=None, target=target)

    def probe(rate: float) -> bool:
        attained = _attainment(run_fn(rate), slo)
        result.probes.append((rate, attained))
        if on_probe is not None:
            on_probe(rate, attained)
        return attained >= target

    if not probe(lo):
        return result
    if probe(hi):
        result.rate = hi
        return result
    good, bad = lo, hi
    while len(result.probes) < max_probes and (bad - good) > rel_tol * bad:
        mid = (good + bad) / 2 if bad / good < 4 else math.sqrt(good * bad)
        if probe(mid):
            good = mid
        else:
            bad = mid
    result.rate = good
    return result
