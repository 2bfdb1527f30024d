"""The server's /metrics over a run: the prefix-cache hit rate (and n/a without counters)."""

from __future__ import annotations

import json

import pytest

from pdserve.loadgen.client import ClientConfig
from pdserve.loadgen.datasets import DatasetConfig, LengthDist
from pdserve.loadgen.runner import LoadConfig, format_summary, run_load, write_run_outputs
from pdserve.loadgen.server_metrics import parse_prometheus_text, prefix_cache_delta


def load(url: str, seed: int) -> LoadConfig:
    return LoadConfig(client=ClientConfig(base_url=url, endpoint="completions", request_timeout_s=10),
                      rate=50.0, arrival="constant", num_requests=4, seed=seed,
                      dataset=DatasetConfig(input=LengthDist("fixed", value=13), output=LengthDist("fixed", value=2)))


def test_a_repeated_run_shows_its_prefix_cache_hits(fake_server, tmp_path):
    """The same seed twice sends the same prompts: the first run misses, the second hits all;
    a new seed misses again. Each run counts only its own window of the counters."""
    url = fake_server(prefix_cache=True)
    first = run_load(load(url, seed=1), progress=False).summary
    assert first["prefix_cache_hit_rate"] == 0.0 and first["prefix_cache_hits"] == 0.0
    assert first["prefix_cache_queries"] == 4 * 10 and first["prefix_cache_unit"] == "tokens"  # 10 words a prompt
    assert "0.0% hit (0 of 40 prompt tokens)" in format_summary(first)
    again = run_load(load(url, seed=1), progress=False)
    s = again.summary
    assert (s["prefix_cache_hit_rate"], s["prefix_cache_hits"], s["prefix_cache_queries"]) == (1.0, 40.0, 40.0)
    assert s["prefix_cache_metric"] == "pdserve:prefix_cache_hit_tokens_total"
    text = format_summary(s)
    assert "prefix cache  100.0% hit (40 of 40 prompt tokens); prompts repeat" in text and "new --seed" in text
    assert run_load(load(url, seed=2), progress=False).summary["prefix_cache_hit_rate"] == 0.0
    write_run_outputs(tmp_path, again)
    assert json.loads((tmp_path / "summary.json").read_text())["prefix_cache_hit_rate"] == 1.0
    header, row = (tmp_path / "summary.csv").read_text().splitlines()
    assert dict(zip(header.split(","), row.split(",")))["prefix_cache_hit_rate"] == "1.0"


def test_a_server_without_prefix_cache_counters_gives_na(fake_server, tmp_path):
    url = fake_server()  # KV counters only
    s = run_load(load(url, seed=1), progress=False).summary
    assert s["prefix_cache_hit_rate"] is None and s["prefix_cache_metric"] is None
    assert "prefix cache  n/a (the server exports no prefix-cache counters on /metrics)" in format_summary(s)
    write_run_outputs(tmp_path, run_load(load(url, seed=1), progress=False))
    assert json.loads((tmp_path / "summary.json").read_text())["prefix_cache_hit_rate"] is None


@pytest.mark.parametrize("text, expected", [
    # pdserve's router: tokens, summed over label sets
    ("pdserve:prefix_cache_hit_tokens_total 30\npdserve:prefix_cache_query_tokens_total 100\n"
     'pdserve:prefix_cache_hits_total{worker="a"} 1\npdserve:prefix_cache_queries_total{worker="a"} 1\n',
     (0.3, "tokens", "pdserve:prefix_cache_hit_tokens_total")),
    # vLLM v1
    ('vllm:prefix_cache_hits_total{engine="0"} 30\nvllm:prefix_cache_queries_total{engine="0"} 100\n',
     (0.3, "tokens", "vllm:prefix_cache_hits_total")),
    # pdserve's per-worker block counters only
    ('pdserve:prefix_cache_hits_total{worker="a"} 20\npdserve:prefix_cache_hits_total{worker="b"} 10\n'
     'pdserve:prefix_cache_queries_total{worker="a"} 60\npdserve:prefix_cache_queries_total{worker="b"} 40\n',
     (0.3, "blocks", "pdserve:prefix_cache_hits_total")),
])
def test_prefix_cache_delta_reads_known_counters(text, expected):
    zero = {name: 0.0 for name in parse_prometheus_text(text)}
    before = {k: v / 2 for k, v in parse_prometheus_text(text).items()}  # half before the run
    after = parse_prometheus_text(text)
    rate, unit, metric = expected
    d = prefix_cache_delta(zero, after)
    assert (d["prefix_cache_hit_rate"], d["prefix_cache_unit"], d["prefix_cache_metric"]) == (rate, unit, metric)
    half = prefix_cache_delta(before, after)
    assert half["prefix_cache_hit_rate"] == rate and half["prefix_cache_queries"] == d["prefix_cache_queries"] / 2


def test_prefix_cache_delta_without_queries_or_scrapes():
    names = {"pdserve:prefix_cache_hit_tokens_total": 5.0, "pdserve:prefix_cache_query_tokens_total": 9.0}
    idle = prefix_cache_delta(names, names)
    assert idle["prefix_cache_hit_rate"] is None and idle["prefix_cache_queries"] == 0.0
    assert "n/a (no prompt looked up" in format_summary_of(idle)
    assert prefix_cache_delta(None, names)["prefix_cache_hit_rate"] is None
    assert prefix_cache_delta(names, None)["prefix_cache_metric"] is None


def format_summary_of(fields: dict) -> str:
    from pdserve.loadgen.runner import describe_prefix_cache

    return describe_prefix_cache(fields)
