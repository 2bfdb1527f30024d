"""Scrape a server's Prometheus `/metrics` and report KV transfer deltas over a run.

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
