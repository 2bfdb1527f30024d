import time

import pytest

from pdserve import kvtransfer
from pdserve.kvtransfer import LinkPacer, TokenBucket
from kvx_peer import CacheSpec, make_caches


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_token_bucket_exact_sleeps():
    clock = FakeClock()
    bucket = TokenBucket(rate_gbps=8.0, burst_bytes=1000, clock=clock, sleep=clock.sleep)  # 1e9 B/s
    assert bucket.acquire(600) == 0.0  # from the initial burst
    assert bucket.acquire(400) == 0.0  # burst used up exactly
    assert bucket.acquire(2000) == pytest.approx(2e-6)  # 2000 B at 1e9 B/s
    clock.now += 1e-6  # refills 1000 B, capped at the burst
    assert bucket.acquire(500) == 0.0
    clock.now += 10.0  # idle: refill capped at burst_bytes
    assert bucket.acquire(1500) == pytest.approx(0.5e-6)
    assert clock.sleeps == [pytest.approx(2e-6), pytest.approx(0.5e-6)]
    assert bucket.delayed_seconds == pytest.approx(2.5e-6)


def test_token_bucket_back_to_back_debt():
    clock = FakeClock()
    bucket = TokenBucket(rate_gbps=0.008, burst_bytes=1, clock=clock, sleep=lambda s: None)  # 1e6 B/s, no sleeping
    assert bucket.reserve(1) == 0.0
    assert bucket.reserve(1000) == pytest.approx(1e-3)
    assert bucket.reserve(1000) == pytest.approx(2e-3)  # queued behind the first
    with pytest.raises(ValueError):
        TokenBucket(rate_gbps=0)


def test_link_pacer_routes():
    clock = FakeClock()
    pacer = LinkPacer(clock=clock, sleep=clock.sleep, burst_bytes=100)
    pacer.set_link("n0->n1", rate_gbps=0.0008)  # 1e5 B/s
    pacer.route("ucx://a:1", "n0->n1")
    pacer.route("ucx://a:2", "n0->n1")
    assert pacer.acquire("ucx://a:1", 100) == 0.0
    assert pacer.acquire("ucx://a:2", 100) == pytest.approx(1e-3)  # shares the link
    assert pacer.acquire("ucx://b:1", 10**9) == 0.0  # unpaced
    with pytest.raises(ValueError, match="unknown link"):
        pacer.route("x", "nope")
    assert LinkPacer(default_gbps=1.0).bucket_for("anything").rate_gbps == 1.0


@pytest.mark.timeout(30)
def test_paced_fake_transfer_20MB_at_1Gbps():
    # 10 layers x (K+V) x 125 blocks x 8000 B = 20e6 B of payload
    spec = CacheSpec(num_layers=10, num_blocks=125, block_size=16, num_kv_heads=1, head_dim=125)
    src, dst = make_caches(spec, seed=3), make_caches(spec, seed=None)
    pacer = LinkPacer(burst_bytes=64 * 1024)
    with kvtransfer.create_receiver("fake", dst) as receiver:
        pacer.set_link(receiver.address(), rate_gbps=1.0)
        with kvtransfer.create_sender("fake", src, pacer=pacer) as sender:
            ids = list(range(125))

            def transfer(transfer_id):
                receiver.expect(transfer_id, ids, 10, deadline_s=30)
                start = time.perf_counter()
                for layer in range(10):
                    sender.send_layer(receiver.address(), transfer_id, layer, ids, ids)
                result = sender.finish(transfer_id, timeout=20)
                receiver.wait(transfer_id, timeout=5)
                return result, time.perf_counter() - start

            transfer("warm-up")  # first-touch page faults of the staging buffers
            time.sleep(0.05)  # the bucket refills to its burst
            result, elapsed = transfer("paced")
    assert result.num_bytes == 20_000_000
    assert elapsed == pytest.approx(0.16, rel=0.10)
    assert result.gbps == pytest.approx(1.0, rel=0.10)


def test_token_bucket_ready_at_keeps_a_backlogged_link_at_rate():
    """Messages queued at once and sent by a loop that loses 0.5 ms after every wait: without
    ready_at each message's slot starts late; with it the link stays at its rate."""
    def run(stamp: bool) -> float:
        clock = FakeClock()
        bucket = TokenBucket(rate_gbps=8.0, burst_bytes=1000, clock=clock, sleep=clock.sleep)  # 1e9 B/s
        queued = clock.now
        for _ in range(10):
            bucket.acquire(1_000_000, ready_at=queued if stamp else None)  # 1 ms each at the rate
            clock.now += 0.5e-3  # the sender's own work after each wait
        return clock.now - queued
    assert run(stamp=False) == pytest.approx(10 * 1.5e-3, rel=1e-3)
    assert run(stamp=True) == pytest.approx(10e-3 - 1e-6 + 0.5e-3, rel=1e-3)


def test_token_bucket_ready_at_banks_no_more_than_a_burst():
    clock = FakeClock()
    bucket = TokenBucket(rate_gbps=8.0, burst_bytes=1000, clock=clock, sleep=clock.sleep)  # 1e9 B/s
    clock.now += 1.0
    # ready 0.5 s ago on an idle link: it would have gone then
    assert bucket.reserve(2000, ready_at=clock.now - 0.5) == 0.0
    # what is ready now finds one burst, no more
    assert bucket.reserve(1000) == 0.0
    assert bucket.reserve(1000) == pytest.approx(1e-6)
    assert bucket.reserve(500, ready_at=clock.now + 5) == pytest.approx(1.5e-6)  # a future stamp counts as now


# ---- UCX over loopback: when finish() returns, and the link-bound rate -------------------

@pytest.fixture(scope="module")
def peer():
    from kvx_peer import Peer

    peer = Peer()
    yield peer
    assert peer.stop() == 0, "peer process did not exit cleanly"


@pytest.mark.timeout(60)
def test_ucx_paced_finish_returns_at_the_ack_and_link_bound_rate_is_the_set_rate(peer):
    """Two transfers on one paced link, B enqueued while A is on it (a second request behind the
    first). finish(A) must return at A's acknowledgement: the worker's Prefill reply, and the
    router's kv_done_at stamp, follow it. It used to wait until the driver got round to recording
    A's last sends, up to max_inflight of B's paced messages later (~60 ms here, ~0.3 s at
    1 Gbit/s with 2.5 MB layers), which shifted A's [kv_done_at - kv, kv_done_at] interval late
    and made the grid's union-of-intervals rate read above the SET rate (1.15x at 1 Gbit/s).
    The link-bound figure (link_bytes over phase "link") reads the SET rate."""
    import threading

    spec = CacheSpec(num_layers=30, num_blocks=8, block_size=16, num_kv_heads=3, head_dim=64)
    rate = 0.2  # 25 MB/s: a layer of 4 blocks (98 KB) takes ~3.9 ms
    address = peer.call("open_receiver", spec)
    pacer = LinkPacer(burst_bytes=64 << 10)
    pacer.set_link(address, rate_gbps=rate)
    ids = list(range(4))
    results, returned = {}, {}
    with kvtransfer.create_sender("ucx", make_caches(spec, seed=5), pacer=pacer) as sender:
        for name in ("warm", "a", "b"):
            peer.call("expect", name, ids, 30, 30.0)
        for layer in range(30):
            sender.send_layer(address, "warm", layer, ids, ids)
        sender.finish("warm", 20)
        time.sleep(0.05)

        def finish(name):
            results[name] = sender.finish(name, 20)
            returned[name] = time.monotonic()

        start = time.monotonic()
        for layer in range(30):
            sender.send_layer(address, "a", layer, ids, ids)
        waiter = threading.Thread(target=finish, args=("a",))
        waiter.start()
        time.sleep(0.03)
        for layer in range(30):
            sender.send_layer(address, "b", layer, ids, ids)
        finish("b")
        waiter.join()
        for name in ("a", "b"):
            peer.call("wait", name, 20.0)
    a, b = results["a"], results["b"]
    # A's last message completed before its ACK, and finish(A) returned right after the ACK
    assert a.phases["queue"] + a.phases["wire"] <= a.seconds + 0.01
    assert returned["a"] - start <= a.seconds + 0.02
    # B queued behind A: almost all of it was link-bound, and the link ran at its SET rate
    assert b.link_bytes >= 0.9 * b.num_bytes
    link_gbps = (a.link_bytes + b.link_bytes) * 8 / (a.phases["link"] + b.phases["link"]) / 1e9
    assert link_gbps == pytest.approx(rate, rel=0.05)
    # and the bytes over the union of the transfers' intervals, stamped at finish's return
    spans = sorted((returned[n] - r.seconds, returned[n]) for n, r in results.items())
    busy = max(spans[0][1], spans[1][1]) - spans[0][0] if spans[1][0] <= spans[0][1] else \
        (spans[0][1] - spans[0][0]) + (spans[1][1] - spans[1][0])
    assert (a.num_bytes + b.num_bytes) * 8 / busy / 1e9 <= rate * 1.05
