"""Network-aware's search (router.placement.policies.search) chooses exactly what pricing every
option chooses (router.placement.policies.oracle), on clusters of every size and kind.

Hand-checked cases (PROFILE of network_fixtures: prefill 0.1 ms a token, a decode step 0.01 s
plus 0.04/63 s per request beyond the first, 128 KiB of KV a token, 32 layers), then seeded
random clusters compared option by option and decision by decision with the exhaustive search.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from pdserve.router.placement.congestion import CongestionView, LinkState
from pdserve.router.placement.base import ClusterSnapshot, RequestInfo, SLOUnattainable
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.oracle import Exhaustive, OracleNetworkAware
from pdserve.router.placement.policies.columns import Columns
from pdserve.router.placement.policies.search import Search
from pdserve.router.placement.policies.baselines import PrefixIndex
from pdserve.router.placement.policies.cost import estimate_local, estimate_pair
from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Link, Topology
from tests.router.network_fixtures import PROFILE, req, snapshot, topology, w


def both(prefills, decodes, request, snap, cached=None, profile=PROFILE, tpot_limit=None, prefill_factor=1.0):
    """(exhaustive, search) option sets over the same workers; the search's feasibility is room and
    TPOT within `tpot_limit`. `prefill_factor`: `profile`'s prefill times are scaled by it (the
    calibration's), and the transfer hides behind the unscaled forward."""
    cached = cached or {}
    if prefill_factor != 1.0:
        profile = dataclasses.replace(profile, prefill_times=tuple(t * prefill_factor for t in profile.prefill_times))

    def pair(p, d):
        return estimate_pair(profile, request, p, d, snap, cached_tokens=cached.get(p.worker_id, 0),
                             prefill_factor=prefill_factor)

    def local(d):
        return estimate_local(profile, request, d, cached_tokens=cached.get(d.worker_id, 0))

    return Exhaustive(prefills, decodes, pair, local), search(prefills, decodes, request, snap, pair, local, cached,
                                                             profile, tpot_limit, prefill_factor)


def search(prefills, decodes, request, snap, pair, local, cached=None, profile=PROFILE, tpot_limit=None,
           prefill_factor=1.0):
    columns = Columns()
    columns.update(snap)
    rows = [np.array([columns.index[x.worker_id] for x in sorted(side, key=lambda x: x.worker_id)], dtype=np.intp)
            for side in (prefills, decodes)]  # in worker-id order, as the policy gives them
    return Search(profile, request, columns, *rows, snap, columns.load(), pair, local, cached or {}, 1,
                  tpot_limit=tpot_limit, tpot_factor=1.0, prefill_factor=prefill_factor)


def split(snap):
    prefills = [x for x in snap.workers if x.can_prefill]
    decodes = [x for x in snap.workers if x.can_decode]
    return prefills, decodes


# ---------------------------------------------------------------- hand-checked cases


def test_idle_identical_workers_tie_to_the_lowest_ids():
    # 3 nodes, each with one prefill and two decode workers, all idle; every node's local link
    # is the fastest (200 Gbit/s), so the 3 x 2 local pairs tie on TTFT; ids break the tie.
    workers = tuple(x for n in "abc" for x in (w(f"p{n}", "prefill", n), w(f"d{n}1", "decode", n),
                                              w(f"d{n}2", "decode", n)))
    snap = snapshot(workers, topology(remote_gbps=10.0))
    exhaustive, pruned = both(*split(snap), req(1024), snap)
    best = pruned.best_pair()
    assert (best.prefill, best.decode) == ("pa", "da1")
    assert best == exhaustive.best_pair()
    # 1024 tokens: 0.1024 s of prefill; 128 MiB over 200 Gbit/s = 5.37 ms, 1/32 of it exposed; idle admit 0
    assert best.ttft_s == pytest.approx(0.1024 + 1024 * 131072 * 8 / 200e9 / 32)


def test_the_optimum_behind_a_slow_link_is_kept():
    # p0's own node holds d0, busy with 63 requests (admit 0.05 s); d1 sits behind a 10 Gbit/s
    # link, idle. 1024 tokens: 0.107 s of KV over 10 Gbit/s, of which 0.1024 x 31/32 hides
    # behind the prefill, so d1 costs 0.1074 - 0.0992 = 0.0082 s more KV but 0.05 s less admit.
    workers = (w("p0", "prefill", "a"), w("d0", "decode", "a", num_running=63), w("d1", "decode", "b"))
    snap = snapshot(workers, topology(remote_gbps=10.0))
    exhaustive, pruned = both(*split(snap), req(1024, max_tokens=1), snap)
    best = pruned.best_pair()
    assert (best.prefill, best.decode) == ("p0", "d1") and best == exhaustive.best_pair()
    kv = 1024 * 131072 * 8 / 10e9
    assert best.ttft_s == pytest.approx(0.1024 + kv - 31 / 32 * 0.1024)


def test_a_prefill_worker_with_a_worse_bound_can_still_win_on_its_link():
    # p0 (node a) has the smaller queue, but only a 1 Gbit/s link to d0 (node c); p1 (node b)
    # queues 100 tokens (0.01 s) and reaches c over 100 Gbit/s. Both bounds use the fastest
    # class (200 Gbit/s local), so p0 is visited first; p1 must still win.
    workers = (w("p0", "prefill", "a"), w("p1", "prefill", "b", num_inflight=1, num_running=1, num_inflight_tokens=100),
               w("d0", "decode", "c"))
    snap = snapshot(workers, topology(("a", "c", 1.0), ("b", "c", 100.0)))
    exhaustive, pruned = both(*split(snap), req(4096), snap)
    best = pruned.best_pair()
    assert (best.prefill, best.decode) == ("p1", "d0") and best == exhaustive.best_pair()
    assert best.ttft_s == pytest.approx(0.01 + 0.4096 + 4096 * 131072 * 8 / 100e9 / 32)


# Exact ties between different options: every number below is a sum of powers of two.
# 2 layers (half the overlapped KV hides); prefill 0.25 s up to 256 tokens, then 1/1024 s a
# token; a decode step 0.203125 s for one request, 0.25 s for two; 128 KiB of KV a token, so
# a 256-token prompt is 2^28 bits: 1/16 s at 2^32 bit/s (4.294967296 Gbit/s), 0.5 s at 2^29.
DYADIC = Profile(
    hardware="test", device="cpu", model="m", dtype="float32", num_layers=2, kv_bytes_per_token=2**17,
    block_size=16, max_num_batched_tokens=512, prefill_tokens=(256, 512), prefill_times=(0.25, 0.5),
    decode_batch_sizes=(1, 2), decode_contexts=(1, 2), decode_times=((0.203125, 0.203125), (0.25, 0.25)),
)
DYADIC_TOPOLOGY = Topology(links=(Link("a", "b", 0.536870912, 0.0),), local_gbps=4.294967296, local_latency_ms=0.0,
                           remote_gbps=0.536870912, remote_latency_ms=0.0)


def test_an_exact_tie_with_a_later_prefill_worker_goes_to_the_lower_id():
    # p9 (node a, idle queue) has the lower bound, 0.25 + 1/16 - 1/32 = 0.28125, but reaches
    # d0 (node b) only at 2^29 bit/s: 0.25 + 0.5 - 0.125 = 0.625. p1 queues 352 tokens
    # (0.34375 s) and is local to d0: 0.34375 + 0.28125 = 0.625 too. Same TTFT, same loads
    # (one request each): the lower id, p1, wins, though its bound equals the best found.
    workers = (w("p9", "prefill", "a", num_inflight=1),
               w("p1", "prefill", "b", num_inflight=1, num_inflight_tokens=352), w("d0", "decode", "b"))
    snap = snapshot(workers, DYADIC_TOPOLOGY)
    exhaustive, pruned = both(*split(snap), req(256), snap, profile=DYADIC)
    ttfts = {(e.prefill, e.decode): e.ttft_s for e in exhaustive.pairs}
    assert ttfts == {("p9", "d0"): 0.625, ("p1", "d0"): 0.625}
    assert (pruned.best_pair().prefill, pruned.best_pair().decode) == ("p1", "d0")
    assert pruned.best_pair() == exhaustive.best_pair()


def test_an_exact_tie_between_a_cached_and_a_plain_local_run():
    # 352 tokens, 512-token chunks. d5 (two requests) has 96 tokens cached: one chunk, two steps
    # of 0.25 + 0.25 s of prefill = 0.75 s. d1 (one request) has none: two steps of 0.203125 +
    # 0.34375 s = 0.75 s. Same TTFT; d1 is the less loaded.
    workers = (w("d5", "decode", "a", num_running=2), w("d1", "decode", "a", num_running=1))
    snap = snapshot(workers, DYADIC_TOPOLOGY)
    exhaustive, pruned = both(*split(snap), req(352, max_tokens=1), snap, cached={"d5": 96}, profile=DYADIC)
    assert {e.decode: e.ttft_s for e in exhaustive.locals} == {"d5": 0.75, "d1": 0.75}
    assert pruned.best_local().decode == "d1" and pruned.best_local() == exhaustive.best_local()


def test_mixed_worker_never_pairs_with_itself_and_counts_match():
    workers = (w("m0", "mixed", "a"), w("m1", "mixed", "a", num_running=3), w("d0", "decode", "b"))
    snap = snapshot(workers, topology(("a", "b", 100.0)))
    prefills, decodes = split(snap)
    exhaustive, pruned = both(prefills, decodes, req(2048), snap)
    assert pruned.num_pairs == exhaustive.num_pairs == 2 * 3 - 2
    # m0 -> m0 (idle, its own 200 Gbit/s node) would be best; m1 queues 3 x 2048 tokens (0.61 s),
    # m0 -> m1 admits after a step of 3 (0.011 s): m0 -> d0 over 100 Gbit/s, idle, wins
    assert (pruned.best_pair().prefill, pruned.best_pair().decode) == ("m0", "d0")
    assert pruned.best_pair() == exhaustive.best_pair()
    # a single mixed worker has no pair at all
    alone = snapshot((w("m0", "mixed", "a"),), topology())
    _, pruned = both(*split(alone), req(2048), alone)
    assert pruned.best_pair() is None and pruned.num_pairs == 0


def test_feasibility_is_per_decode_worker():
    # d0 is local to p0 but has no free blocks; d1 is remote with room: the feasible best is d1,
    # the best of all d0; one pair of two lacks room
    workers = (w("p0", "prefill", "a"), w("d0", "decode", "a", num_blocks=100, num_free_blocks=1, block_size=16),
               w("d1", "decode", "b"))
    snap = snapshot(workers, topology(remote_gbps=100.0))
    exhaustive, pruned = both(*split(snap), req(1024), snap)
    has_room = lambda e: e.room  # noqa: E731
    assert pruned.best_pair(has_room).decode == "d1" == exhaustive.best_pair(has_room).decode
    assert pruned.best_pair().decode == "d0" == exhaustive.best_pair().decode
    assert pruned.count_without_room() == exhaustive.count_without_room() == 1


def test_a_cost_model_the_search_does_not_know_falls_back_to_every_pair():
    workers = (w("p0", "prefill", "a"), w("p1", "prefill", "b"), w("d0", "decode", "a"), w("d1", "decode", "b"))
    snap = snapshot(workers, topology(remote_gbps=100.0))
    request = req(1024)

    def odd_pair(p, d):  # a model where p0 -> d0, the formula's best (ids break its tie with p1 -> d1), costs 1 s more
        e = estimate_pair(PROFILE, request, p, d, snap)
        if (p.worker_id, d.worker_id) == ("p0", "d0"):
            return dataclasses.replace(e, queue_s=1.0)
        return e

    pruned = search(*split(snap), request, snap, odd_pair, lambda d: estimate_local(PROFILE, request, d))
    best = pruned.best_pair()
    assert (best.prefill, best.decode) == ("p1", "d1") and pruned.fallbacks == 1


def test_production_never_prices_every_option(monkeypatch):
    """Small, mixed, colocated, hybrid, short and degraded placements all go through the search."""
    def refuse(*args, **kwargs):
        raise AssertionError("production called the oracle")

    monkeypatch.setattr(Exhaustive, "__init__", refuse)
    policy = NetworkAware(profile=PROFILE, local_prefill_max_tokens=100)
    clusters = [(w("p0", "prefill", "a"), w("d0", "decode", "a")),
                (w("m0", "mixed", "a"), w("m1", "mixed", "b"), w("d0", "decode", "b"), w("p0", "prefill", "a")),
                (w("m0", "mixed", "a"), w("m1", "mixed", "b")), (w("p0", "prefill", "a"), w("d0", "decode", "a",
                                                                                              healthy=False))]
    for workers in clusters:
        for mode in ("disaggregated", "colocated"):
            for n in (50, 1000):
                snap = dataclasses.replace(snapshot(workers, topology()), mode=mode)
                if mode == "colocated" and not any(x.can_decode and x.healthy for x in workers):
                    continue
                policy.place(req(n), snap)
    with pytest.raises(AssertionError, match="oracle"):
        OracleNetworkAware(profile=PROFILE).place(req(1000), snapshot(clusters[0], topology()))


def test_profile_step_time_reads_only_the_rows_it_needs():
    profile = Profile.from_dict({**PROFILE.to_dict(), "decode": {
        "batch_sizes": [1, 8, 32, 128], "contexts": [128, 1024, 8192],
        "seconds": [[0.010, 0.011, 0.02], [0.012, 0.014, 0.03], [0.015, 0.02, 0.06], [0.02, 0.04, 0.2]]}})

    def full(batch, context):  # every row interpolated, as before
        from pdserve.router.placement.profiles import _interpolate
        per_batch = [_interpolate(profile.decode_contexts, row, max(context, 1)) for row in profile.decode_times]
        return _interpolate(profile.decode_batch_sizes, per_batch, batch)

    for batch in (1, 2, 8, 9, 31, 32, 100, 128, 129, 500):
        for context in (0, 1, 128, 500, 1024, 5000, 8192, 20000):
            assert profile.decode_step_seconds(batch, context) == full(batch, context)
            assert profile.decode_step_seconds(batch, context) == full(batch, context)  # remembered
    assert profile.decode_step_seconds(0, 100) == 0.0


# ---------------------------------------------------------------- random clusters


def random_cluster(rng: random.Random) -> ClusterSnapshot:
    nodes = [f"n{i}" for i in range(rng.randint(1, 6))]
    links = []
    for a in nodes:
        for b in nodes:
            if rng.random() < 0.3:
                links.append(Link(a, b, rng.choice([1.0, 25.0, 100.0, 100.0]), rng.choice([0.0, 0.005])))
    topo = Topology(links=tuple(links), local_gbps=rng.choice([100.0, 200.0]),
                    local_latency_ms=rng.choice([0.0, 0.005]), remote_gbps=rng.choice([10.0, 25.0]),
                    remote_latency_ms=rng.choice([0.0, 0.01]))
    workers = []
    for i in range(rng.randint(2, 24)):
        role = rng.choice(["prefill", "decode", "decode", "mixed"] if rng.random() < 0.3 else ["prefill", "decode"])
        kw = {}
        if rng.random() < 0.6:  # few distinct loads: many exact ties
            n = rng.choice([0, 1, 2, 8])
            kw = dict(num_running=n, num_inflight=rng.choice([0, n]),
                      num_inflight_tokens=rng.choice([0, 512, 4096]) * n)
        if rng.random() < 0.3:
            kw.update(num_blocks=512, block_size=16, num_free_blocks=rng.choice([0, 8, 300, 512]))
        workers.append(w(f"{role[0]}{i:02d}", role, rng.choice(nodes), **kw))
    states = {}
    for a in nodes:
        for b in nodes:
            if rng.random() < 0.25:
                states[f"{a}->{b}"] = LinkState(active_flows=rng.randint(0, 3),
                                                 measured_gbps=rng.choice([None, 5.0, 50.0, 300.0]))
    return ClusterSnapshot(tuple(workers), topology=topo, links=CongestionView(states),
                           kv_bytes_per_token=rng.choice([0, 65536]))


def wide_cluster(rng: random.Random) -> ClusterSnapshot:
    """Many nodes, few explicit links and flows: most node pairs take the idle remote default
    link, which the search prices all at once; flows and measured rates on some default pairs
    too (below, at and above the default capacity)."""
    nodes = [f"n{i:02d}" for i in range(rng.randint(8, 24))]
    links = [Link(a, b, rng.choice([25.0, 100.0]), 0.005) for a in nodes for b in nodes if rng.random() < 0.04]
    topo = Topology(links=tuple(links), local_gbps=200.0, local_latency_ms=0.005, remote_gbps=25.0,
                    remote_latency_ms=rng.choice([0.0, 0.01]))
    workers = []
    for i in range(rng.randint(10, 48)):
        role = "mixed" if rng.random() < 0.1 else rng.choice(["prefill", "decode", "decode"])
        kw = {}
        if rng.random() < 0.5:
            n = rng.choice([0, 1, 3])
            kw = dict(num_running=n, num_inflight=n, num_inflight_tokens=rng.choice([256, 2048]) * n)
        if rng.random() < 0.2:
            kw.update(num_blocks=512, block_size=16, num_free_blocks=rng.choice([0, 512]))
        workers.append(w(f"{role[0]}{i:02d}", role, rng.choice(nodes), **kw))
    states = {}
    for _ in range(rng.randint(0, 6)):
        a, b = rng.sample(nodes, 2)
        states[f"{a}->{b}"] = LinkState(active_flows=rng.choice([0, 0, 1, 2]),
                                        measured_gbps=rng.choice([None, 10.0, 25.0, 40.0]))
    return ClusterSnapshot(tuple(workers), topology=topo, links=CongestionView(states))


@pytest.mark.parametrize("seed", range(200))
def test_wide_random_clusters_same_options(seed):
    rng = random.Random(5000 + seed)
    snap = wide_cluster(rng)
    prefills, decodes = split(snap)
    if not decodes:
        return
    request = req(rng.choice([16, 300, 1024, 4096]), max_tokens=rng.choice([1, 300]))
    exhaustive, pruned = both(prefills, decodes, request, snap, tpot_limit=0.02)
    feasible = lambda e: e.room and e.tpot_s <= 0.02  # noqa: E731
    for f in (None, feasible):
        assert pruned.best_pair(f) == exhaustive.best_pair(f)
        assert pruned.best_local(f) == exhaustive.best_local(f)
    assert pruned.fallbacks == 0


def test_idle_default_links_are_priced_together():
    # 10 nodes, one prefill worker on n0, one idle decode worker on each of n1..n9, no explicit
    # link: every pair takes the idle 10 Gbit/s default, the same time, so the lowest id wins
    # (d1). A flow on n0->n1, or a measured rate below the default's capacity, slows that pair:
    # d2 wins; a measured rate at the capacity, or an entry with neither, changes nothing.
    workers = (w("p0", "prefill", "n0"),) + tuple(w(f"d{i}", "decode", f"n{i}") for i in range(1, 10))
    for state, expected in ((None, "d1"), (LinkState(active_flows=1), "d2"), (LinkState(measured_gbps=5.0), "d2"),
                            (LinkState(measured_gbps=10.0), "d1"), (LinkState(), "d1")):
        snap = ClusterSnapshot(workers, topology=topology(remote_gbps=10.0),
                               links=CongestionView({"n0->n1": state} if state else {}))
        exhaustive, pruned = both(*split(snap), req(1024), snap)
        assert pruned.best_pair().decode == expected == exhaustive.best_pair().decode
        assert pruned.best_pair() == exhaustive.best_pair() and pruned.fallbacks == 0


@pytest.mark.parametrize("seed", range(400))
def test_random_clusters_same_options(seed):
    rng = random.Random(seed)
    snap = random_cluster(rng)
    prefills, decodes = split(snap)
    if not decodes:
        return
    request = req(rng.choice([1, 16, 300, 1024, 4096]), max_tokens=rng.choice([1, 16, 300]))
    cached = {x.worker_id: rng.choice([0, 0, 0, 16, 256]) for x in snap.workers}
    tpot = rng.choice([0.011, 0.02, 1.0])
    factor = rng.choice([1.0, 0.7, 1.6])  # drawn last: the draws before it are the cases they were
    exhaustive, pruned = both(prefills, decodes, request, snap, cached, tpot_limit=tpot, prefill_factor=factor)
    feasible = lambda e: e.room and e.tpot_s <= tpot  # noqa: E731
    for f in (None, feasible):
        assert pruned.best_pair(f) == exhaustive.best_pair(f)
        assert pruned.best_local(f) == exhaustive.best_local(f)
    assert pruned.num_pairs == exhaustive.num_pairs
    assert pruned.count_without_room() == exhaustive.count_without_room()
    assert pruned.count_over_tpot(tpot, 1.3) == exhaustive.count_over_tpot(tpot, 1.3)
    assert pruned.fallbacks == 0


@pytest.mark.parametrize("seed", range(60))
def test_random_clusters_same_decisions(seed):
    """The policy and its oracle on a sequence of requests that share prefixes (each decision
    feeds its prefix index), with and without SLOs and admission control."""
    rng = random.Random(1000 + seed)
    snap = random_cluster(rng)
    options = rng.choice([{}, {"slo_tpot": 0.02}, {"slo_ttft": 0.3, "slo_tpot": 0.02, "admission_control": True},
                          {"local_margin": 0.0}])
    policies = [NetworkAware(profile=PROFILE, **options), OracleNetworkAware(profile=PROFILE, **options)]
    prefixes = [tuple(rng.randrange(100) for _ in range(64)) for _ in range(3)]
    for i in range(12):
        ids = rng.choice(prefixes)[:rng.choice([16, 48, 64])] + tuple(range(rng.randint(0, 900)))
        request = RequestInfo(request_id=f"r{i}", num_prompt_tokens=len(ids), max_tokens=rng.choice([1, 64]),
                              prompt_token_ids=ids)
        outcomes = []
        for policy in policies:
            try:
                outcomes.append(policy.place(request, snap))
            except SLOUnattainable as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]


def test_prefix_depths_match_matched_blocks():
    index = PrefixIndex(block_size=2, max_blocks=4)
    keys = index.keys((1, 2, 3, 4, 5, 6, 7, 8))
    index.record(keys[:3], "a")
    index.record(keys[:1], "b")
    assert index.depths(keys) == {"b": 1, "a": 3}
    assert {x: index.matched_blocks(keys, x) for x in "abc"} == {"a": 3, "b": 1, "c": 0}
