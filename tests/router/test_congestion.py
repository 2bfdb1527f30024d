"""Link congestion: flows, the fair-share model, and the measured estimate."""

from __future__ import annotations

import pytest

from pdserve.router.placement.congestion import (CongestionView, LinkMonitor, LinkState, available_gbps,
                                                 transfer_seconds, usable_gbps)
from pdserve.router.placement.topology import Link

LINK = Link("a", "b", 100.0, 0.5)


def test_fair_share_model():
    assert available_gbps(LINK, LinkState()) == 100.0
    assert available_gbps(LINK, LinkState(active_flows=3)) == 25.0
    assert available_gbps(LINK, LinkState(active_flows=1, measured_gbps=40.0)) == 20.0
    assert usable_gbps(LINK, LinkState(measured_gbps=400.0)) == 100.0  # never above capacity
    assert transfer_seconds(LINK, LinkState(active_flows=1), 10**9) == pytest.approx(0.0005 + 8e9 / 50e9)
    assert transfer_seconds(LINK, LinkState(), 0) == 0.0


def test_flows_start_and_finish():
    m = LinkMonitor()
    f1, f2 = m.start("a->b", 1000), m.start("a->b", 500)
    assert m.state("a->b") == LinkState(bytes_in_flight=1500, active_flows=2)
    assert m.finish(f1) is None
    assert m.finish(f1) is None  # idempotent
    assert m.state("a->b") == LinkState(bytes_in_flight=500, active_flows=1)
    m.finish(f2)
    assert m.state("a->b") == LinkState() and m.state("x->y") == LinkState()
    view = m.view()
    assert isinstance(view, CongestionView) and view.state("a->b") == LinkState()


def test_ewma_of_samples_scaled_by_peak_sharing():
    m = LinkMonitor(alpha=0.5)
    flow = m.start("a->b", 10**9)
    assert m.finish(flow, kv_bytes=10**9, kv_seconds=1.0) == pytest.approx(8.0)
    assert m.state("a->b").measured_gbps == pytest.approx(8.0)
    f1, f2 = m.start("a->b", 1), m.start("a->b", 1)  # two flows shared the link: each saw half
    m.finish(f2)
    assert m.finish(f1, kv_bytes=10**9, kv_seconds=1.0) == pytest.approx(16.0)
    assert m.state("a->b").measured_gbps == pytest.approx(12.0) and m.state("a->b").num_samples == 2


def test_compute_bound_samples_only_raise_the_estimate():
    m = LinkMonitor(alpha=0.5)
    # the transfer ended within the prefill: paced by the compute; no estimate yet, so it is ignored
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=1.0, prefill_seconds=2.0)
    assert m.state("a->b").measured_gbps is None
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=1.0, prefill_seconds=0.5)  # link-bound: 8
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=2.0, prefill_seconds=3.0)  # lower bound 4 < 8
    assert m.state("a->b").measured_gbps == pytest.approx(8.0)
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=0.5, prefill_seconds=3.0)  # lower bound 16 > 8
    assert m.state("a->b").measured_gbps == pytest.approx(12.0)


def test_a_transfer_just_past_its_compute_is_compute_bound():
    m = LinkMonitor(alpha=0.5)
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=1.0, prefill_seconds=0.25)  # link-bound: 8
    # layer-wise push on a slow host: the last layer and the ACK land 10% after the compute
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=2.2, prefill_seconds=2.0)
    assert m.state("a->b").measured_gbps == pytest.approx(8.0) and m.state("a->b").num_samples == 1
    # 30% past the compute is past the slack: the link held it back
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=2.0, prefill_seconds=1.5)
    assert m.state("a->b").measured_gbps == pytest.approx(6.0)
    strict = LinkMonitor(alpha=0.5, compute_slack=0)
    strict.finish(strict.start("a->b", 1), kv_bytes=10**9, kv_seconds=2.2, prefill_seconds=2.0)
    assert strict.state("a->b").measured_gbps == pytest.approx(8 / 2.2)
    with pytest.raises(ValueError, match="compute_slack"):
        LinkMonitor(compute_slack=-0.1)


def test_alpha_is_checked():
    with pytest.raises(ValueError, match="alpha"):
        LinkMonitor(alpha=0)


def test_link_monitor_views_reuse_unchanged_states():
    monitor = LinkMonitor()
    a = monitor.start("x->y", 100)
    monitor.start("y->z", 50)
    first = monitor.view()
    assert monitor.view() is first
    monitor.finish(a, kv_bytes=100, kv_seconds=1e-6)
    second = monitor.view()
    assert second is not first and second.links["y->z"] is first.links["y->z"]
    assert second.links["x->y"] == LinkState(bytes_in_flight=0, active_flows=0, measured_gbps=0.8, num_samples=1)
    assert first.links["x->y"] == LinkState(bytes_in_flight=100, active_flows=1)
    # each view records what changed since the one before it
    assert second.changes_since(first) == ("x->y",) and second.changes_since(second) == ()
    monitor.start("z->x", 10)
    third = monitor.view()
    assert third.changes_since(second) == ("z->x",) and third.changes_since(first) is None
    assert list(third.links) == ["x->y", "y->z", "z->x"]
    assert CongestionView(third.links).changes_since(third) is None


def test_a_transfer_that_missed_its_deadline_lowers_the_estimate_at_once():
    m = LinkMonitor(alpha=0.3)
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=0.1)  # 80 Gbit/s measured
    assert m.state("a->b").measured_gbps == pytest.approx(80.0)
    # 10**8 bytes not acknowledged within 5 s: the link carried under 0.16 Gbit/s
    assert m.finish(m.start("a->b", 10**8), missed_deadline_s=5.0) == pytest.approx(0.16)
    assert m.state("a->b").measured_gbps == pytest.approx(0.16) and m.state("a->b").num_samples == 2
    # a bound above the estimate says nothing new
    m.finish(m.start("a->b", 10**10), missed_deadline_s=5.0)
    assert m.state("a->b").measured_gbps == pytest.approx(0.16)
    # two flows shared the link when it missed: the link carried under twice the flow's rate
    f1, f2 = m.start("c->d", 10**8), m.start("c->d", 10**8)
    m.finish(f2)
    assert m.finish(f1, missed_deadline_s=5.0) == pytest.approx(0.32)
    # an unknown size (no KV bytes per token learned yet) bounds nothing
    assert m.finish(m.start("e->f", 0), missed_deadline_s=5.0) is None
    assert m.state("e->f").measured_gbps is None
    # a transfer that succeeds later raises it again through the EWMA
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=0.1)
    assert m.state("a->b").measured_gbps == pytest.approx(0.3 * 80 + 0.7 * 0.16)


def test_a_first_contact_transfer_only_raises_the_estimate():
    m = LinkMonitor(alpha=0.5)
    first = m.start("a->b", 1)
    first.first_contact = True  # it paid for the connection: 1 Gbit/s where the link carries 8
    assert m.finish(first, kv_bytes=10**9, kv_seconds=8.0) == pytest.approx(1.0)
    assert m.state("a->b").measured_gbps is None and m.state("a->b").num_samples == 0
    m.finish(m.start("a->b", 1), kv_bytes=10**9, kv_seconds=1.0)  # a measurement: 8
    slow_first = m.start("a->b", 1)
    slow_first.first_contact = True  # another pair's first transfer on the same link: 2, ignored
    m.finish(slow_first, kv_bytes=10**9, kv_seconds=4.0)
    assert m.state("a->b").measured_gbps == pytest.approx(8.0)
    fast_first = m.start("a->b", 1)
    fast_first.first_contact = True  # a lower bound above the estimate still raises it
    m.finish(fast_first, kv_bytes=10**9, kv_seconds=0.5)
    assert m.state("a->b").measured_gbps == pytest.approx(12.0)


def test_a_paced_link_is_measured_by_what_its_bucket_held_back():
    """A paced link's sender reports the bytes and seconds its bucket held back (phase "link"):
    their ratio is the sample, whatever the compute did; a paced transfer the bucket never held
    back only shows that the link kept up. (On one H200, 2,048 tokens at 100 Gbit/s outlasted
    their prefill by the last layer's landing and ACK, past the slack, and were taken for a
    ~20 Gbit/s link.)"""
    m = LinkMonitor(alpha=0.5)
    # 207 MB in 82 ms after a 60 ms prefill: past the slack, yet the bucket held nothing back
    m.finish(m.start("a->b", 1), kv_bytes=207 * 10**6, kv_seconds=0.082, prefill_seconds=0.060,
             link_bytes=0, link_seconds=0.0)
    assert m.state("a->b").measured_gbps is None  # a lower bound before any measurement is ignored
    # the same transfer unpaced counts as a measurement of ~20 Gbit/s
    unpaced = LinkMonitor(alpha=0.5)
    unpaced.finish(unpaced.start("a->b", 1), kv_bytes=207 * 10**6, kv_seconds=0.082, prefill_seconds=0.060)
    assert unpaced.state("a->b").measured_gbps == pytest.approx(20.2, abs=0.1)
    # at 1 Gbit/s the bucket held 200 MB back for 1.6 s: 1 Gbit/s, not the 207 MB / 1.7 s of the whole
    assert m.finish(m.start("a->b", 1), kv_bytes=207 * 10**6, kv_seconds=1.7, prefill_seconds=0.060,
                    link_bytes=200 * 10**6, link_seconds=1.6) == pytest.approx(1.0)
    assert m.state("a->b").measured_gbps == pytest.approx(1.0)
    # then a held-back-free transfer at 10x that only raises it (a lower bound), by the EWMA
    m.finish(m.start("a->b", 1), kv_bytes=207 * 10**6, kv_seconds=0.166, prefill_seconds=0.060,
             link_bytes=0, link_seconds=0.0)
    assert m.state("a->b").measured_gbps == pytest.approx(0.5 * 1.0 + 0.5 * 207e6 * 8 / 0.166 / 1e9)
