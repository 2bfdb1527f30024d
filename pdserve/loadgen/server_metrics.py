"""Scrape a server's Prometheus `/metrics` and report KV transfer and prefix-cache deltas over a run.

The prefix-cache hit rate of a run is hits / queries between the scrapes before and after it,
from the first pair of counters in `PREFIX_CACHE_COUNTERS` the server exports: pdserve's
router (prompt tokens), vLLM v1 (prompt tokens), or pdserve's per-worker block counters. A
server with none of them gives None ("n/a"), not an error: loadgen measures any OpenAI server.

The text exposition format is parsed here (name, optional {labels}, value, optional
timestamp); samples of the same name are summed over their label sets.
"""

from __future__ import annotations

import logging
import math
import re

import httpx

log = logging.getLogger(__name__)

KV_BYTES = "pdserve:kv_transfer_bytes_total"
KV_SECONDS_SUM = "pdserve:kv_transfer_seconds_sum"
KV_SECONDS_COUNT = "pdserve:kv_transfer_seconds_count"

# (hits, queries, unit), first match wins
PREFIX_CACHE_COUNTERS = (
    ("pdserve:prefix_cache_hit_tokens_total", "pdserve:prefix_cache_query_tokens_total", "tokens"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "tokens"),
    ("pdserve:prefix_cache_hits_total", "pdserve:prefix_cache_queries_total", "blocks"),
)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")


def parse_prometheus_text(text: str) -> dict[str, float]:
    """{metric name: value summed over label sets}. Unparsable lines are skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, _labels, raw, _ts = match.groups()
        try:
            value = float(raw)  # accepts NaN, +Inf, -Inf
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


async def scrape(http: httpx.AsyncClient, url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """The parsed `/metrics` of `url`, or None when the server has none."""
    try:
        resp = await http.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        log.info("no server metrics at %s (%s)", url, type(e).__name__)
        return None
    if resp.status_code != 200:
        log.info("no server metrics at %s (HTTP %d)", url, resp.status_code)
        return None
    return parse_prometheus_text(resp.text)


def kv_transfer_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """KV bytes, seconds and transfers between two scrapes, and the achieved Gbit/s."""
    keys = {"kv_transfer_bytes": KV_BYTES, "kv_transfer_seconds": KV_SECONDS_SUM, "kv_transfer_count": KV_SECONDS_COUNT}
    out: dict[str, float | None] = {}
    for field, name in keys.items():
        if before is None or after is None or name not in after:
            out[field] = None
        else:
            out[field] = after[name] - before.get(name, 0.0)
    seconds, nbytes = out["kv_transfer_seconds"], out["kv_transfer_bytes"]
    out["kv_transfer_gbps"] = nbytes * 8 / seconds / 1e9 if nbytes is not None and seconds else None
    return out


def prefix_cache_delta(before: dict[str, float] | None,
                       after: dict[str, float] | None) -> dict[str, float | str | None]:
    """The server's prefix-cache hits, queries and hit rate between two scrapes, with the counter
    and unit they came from; all None when the server exports no known counters (or no queries
    happened in between: no rate to give)."""
    out: dict[str, float | str | None] = {"prefix_cache_hit_rate": None, "prefix_cache_hits": None,
                                          "prefix_cache_queries": None, "prefix_cache_unit": None,
                                          "prefix_cache_metric": None}
    if before is None or after is None:
        return out
    for hits_name, queries_name, unit in PREFIX_CACHE_COUNTERS:
        if hits_name in after and queries_name in after:
            hits = after[hits_name] - before.get(hits_name, 0.0)
            queries = after[queries_name] - before.get(queries_name, 0.0)
            out.update(prefix_cache_hits=hits, prefix_cache_queries=queries, prefix_cache_unit=unit,
                       prefix_cache_metric=hits_name,
                       prefix_cache_hit_rate=hits / queries if queries > 0 else None)
            return out
    return out
