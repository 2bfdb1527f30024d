"""Worker figures (queue, KV usage, prefix cache, KV transfer) at the router's /metrics."""

from types import SimpleNamespace

from prometheus_client import generate_latest

from pdserve.proto import worker_pb2 as pb
from pdserve.router.metrics import RouterMetrics, WorkerStatsCollector


def test_worker_series_from_polled_stats():
    metrics = RouterMetrics()
    stats = pb.StatsResponse(worker_id="d0", role="decode", num_waiting=2, num_running=3, num_blocks=100,
                             num_free_blocks=75, prefix_cache_hits=7, prefix_cache_queries=10,
                             kv_transfer_bytes=125_000_000, kv_transfer_seconds=0.5, num_preemptions=1,
                             engine_steps=40, engine_step_seconds=0.5, engine_decode_only_steps=30,
                             engine_decode_only_seconds=0.25, engine_idle_seconds=2.0,
                             engine_prefill_graph_steps=6, engine_prefill_graph_seconds=0.125)
    workers = [SimpleNamespace(worker_id="d0", endpoint=SimpleNamespace(role="decode"), healthy=True, stats=stats),
               SimpleNamespace(worker_id="p0", endpoint=SimpleNamespace(role="prefill"), healthy=False, stats=None)]
    metrics.registry.register(WorkerStatsCollector(lambda: workers))
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:num_requests_waiting{role="decode",worker="d0"} 2.0' in text
    assert 'pdserve:num_requests_running{role="decode",worker="d0"} 3.0' in text
    assert 'pdserve:kv_cache_usage_ratio{role="decode",worker="d0"} 0.25' in text
    assert 'pdserve:prefix_cache_hits_total{role="decode",worker="d0"} 7.0' in text
    assert 'pdserve:kv_transfer_gbps{role="decode",worker="d0"} 2.0' in text
    assert 'pdserve:worker_up{role="prefill",worker="p0"} 0.0' in text
    assert 'pdserve:engine_steps_total{role="decode",worker="d0"} 40.0' in text
    assert 'pdserve:engine_decode_only_step_seconds_total{role="decode",worker="d0"} 0.25' in text
    assert 'pdserve:engine_idle_seconds_total{role="decode",worker="d0"} 2.0' in text
    assert 'pdserve:engine_prefill_graph_steps_total{role="decode",worker="d0"} 6.0' in text
    assert 'pdserve:engine_prefill_graph_step_seconds_total{role="decode",worker="d0"} 0.125' in text
    assert 'pdserve:worker_up{role="decode",worker="d0"} 1.0' in text
    assert 'worker="p0"} ' not in text.split("pdserve:num_requests_waiting")[1].split("# HELP")[0]
