"""experiments/gpu_serving.py reads the router's /metrics between two scrapes: its histogram
quantiles and counters, checked on a real RouterMetrics registry (the GPU walk itself runs on
the device machine)."""

from prometheus_client import generate_latest

from experiments import gpu_serving
from pdserve.router.metrics import RouterMetrics


def test_histogram_and_counter_between_scrapes():
    m = RouterMetrics()
    m.kv_transfer_seconds.labels("n0->n1").observe(0.5)  # before the first scrape: not counted
    before = gpu_serving.scrape(generate_latest(m.registry).decode())
    for link, seconds in (("n0->n1", 0.0012), ("n0->n1", 0.0018), ("n1->n0", 0.004), ("n1->n0", 0.0045)):
        m.kv_transfer_seconds.labels(link).observe(seconds)
        m.kv_transfer_phase_seconds.labels(phase="ack").observe(seconds / 2)
    m.kv_transfer_bytes.labels("n0->n1").inc(300)
    m.kv_transfer_bytes.labels("n1->n0").inc(100)
    m.request_recoveries.labels("local_fallback").inc(2)
    after = gpu_serving.scrape(generate_latest(m.registry).decode())
    kv = gpu_serving.histogram(before, after, "pdserve:kv_transfer_seconds")  # every link
    assert kv["count"] == 4 and abs(kv["mean"] - 0.002875) < 1e-12
    assert 0.0015 < kv["p50"] <= 0.003  # linear within the bucket holding the median
    assert gpu_serving.histogram(before, after, "pdserve:kv_transfer_seconds", link="n1->n0")["count"] == 2
    assert gpu_serving.histogram(before, after, "pdserve:kv_transfer_phase_seconds", phase="ack")["count"] == 4
    assert gpu_serving.counter(before, after, "pdserve:kv_transfer_bytes_total") == 400
    assert gpu_serving.counter(before, after, "pdserve:request_recoveries_total", kind="local_fallback") == 2
    assert gpu_serving.counter(before, after, "pdserve:request_recoveries_total", kind="migrate") == 0
