"""Exact placement decisions on crafted snapshots (pure: no workers, no clock)."""

from __future__ import annotations

import pytest

from pdserve.router.placement.registry import POLICIES, make_policy
from pdserve.router.placement.base import (
    ClusterSnapshot,
    Decision,
    LeastLoaded,
    NoWorkersAvailable,
    RequestInfo,
    RoundRobin,
    WorkerSnapshot,
)


def w(worker_id: str, role: str, **kw) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id=worker_id, role=role, **kw)  # type: ignore[arg-type]


def req(num_prompt_tokens: int = 100, max_tokens: int = 10, **kw) -> RequestInfo:
    return RequestInfo(request_id="r", num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, **kw)


PD = ClusterSnapshot((w("p0", "prefill"), w("p1", "prefill"), w("d0", "decode"), w("d1", "decode")))


def test_registry_and_make_policy():
    assert {"round-robin", "least-loaded"} <= set(POLICIES)
    assert isinstance(make_policy("round-robin"), RoundRobin)
    policy = make_policy("least-loaded", local_prefill_max_tokens=32)
    assert isinstance(policy, LeastLoaded) and policy.local_prefill_max_tokens == 32
    with pytest.raises(ValueError, match=r"unknown placement policy 'nope'.*least-loaded.*round-robin"):
        make_policy("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\]"):
        make_policy("round-robin", colour="red")
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        make_policy("round-robin", local_prefill_max_tokens=-1)


def test_every_registry_entry_names_a_policy_class_of_that_name():
    from pdserve.router.placement.base import PlacementPolicy
    from pdserve.router.placement.registry import policy_class

    for name in POLICIES:
        cls = policy_class(name)
        assert issubclass(cls, PlacementPolicy) and cls.name == name


def test_round_robin_disaggregated_cycles_both_pools():
    policy = RoundRobin()
    got = [policy.place(req(), PD) for _ in range(3)]
    assert got == [
        Decision("disaggregated", "p0", "d0", "round-robin pair"),
        Decision("disaggregated", "p1", "d1", "round-robin pair"),
        Decision("disaggregated", "p0", "d0", "round-robin pair"),
    ]


def test_round_robin_skips_unhealthy_and_excluded():
    snap = ClusterSnapshot((w("p0", "prefill", healthy=False), w("p1", "prefill"), w("d0", "decode"),
                            w("d1", "decode")))
    policy = RoundRobin()
    assert policy.place(req(excluded=frozenset({"d0"})), snap) == Decision("disaggregated", "p1", "d1",
                                                                           "round-robin pair")
    assert policy.place(req(excluded=frozenset({"d0"})), snap) == Decision("disaggregated", "p1", "d1",
                                                                           "round-robin pair")


def test_colocated_mode_picks_mixed_workers():
    snap = ClusterSnapshot((w("m1", "mixed"), w("m0", "mixed"), w("m2", "mixed", healthy=False)), mode="colocated")
    policy = RoundRobin()
    assert [policy.place(req(), snap).decode for _ in range(3)] == ["m0", "m1", "m0"]
    assert policy.place(req(), snap) == Decision("colocated", None, "m1", "colocated mode")


def test_no_prefill_worker_goes_local():
    snap = ClusterSnapshot((w("p0", "prefill", healthy=False), w("d0", "decode")))
    assert LeastLoaded().place(req(), snap) == Decision("local", None, "d0", "no healthy prefill worker")
    only_d = ClusterSnapshot((w("d0", "decode"),))
    assert RoundRobin().place(req(), only_d) == Decision("local", None, "d0", "no healthy prefill worker")


def test_short_prompts_go_local_when_enabled():
    policy = LeastLoaded(local_prefill_max_tokens=16)
    assert policy.place(req(num_prompt_tokens=16), PD) == Decision("local", None, "d0",
                                                                   "short prompt (16 <= 16 tokens)")
    assert policy.place(req(num_prompt_tokens=17), PD) == Decision("disaggregated", "p0", "d0", "least-loaded pair")
    assert LeastLoaded().place(req(num_prompt_tokens=1), PD).kind == "disaggregated"  # default 0: off


def test_resumed_requests_go_local():
    decision = RoundRobin().place(req(num_resumed_tokens=3, excluded=frozenset({"d0"})), PD)
    assert decision == Decision("local", None, "d1", "resumed tokens need a local run")


def test_mixed_worker_never_pairs_with_itself():
    snap = ClusterSnapshot((w("m0", "mixed"),))
    assert LeastLoaded().place(req(), snap) == Decision("local", None, "m0", "no healthy prefill worker")
    two = ClusterSnapshot((w("m0", "mixed"), w("m1", "mixed", num_running=5)))
    # D = least loaded (m0), P = the other one
    assert LeastLoaded().place(req(), two) == Decision("disaggregated", "m1", "m0", "least-loaded pair")


def test_least_loaded_uses_load_then_free_blocks_then_id():
    snap = ClusterSnapshot((
        w("p0", "prefill", num_waiting=3), w("p1", "prefill", num_waiting=1, num_running=1),
        w("p2", "prefill", num_running=4),
        w("d0", "decode", num_running=2, num_free_blocks=10, num_blocks=100),
        w("d1", "decode", num_running=2, num_free_blocks=50, num_blocks=100),
        w("d2", "decode", num_running=1, num_inflight=3),
    ))
    # p1: load 2 < p0: 3 < p2: 4; d0 and d1 tie on load 2, d1 has more free blocks;
    # d2's own count (3) wins over its stats (1)
    assert LeastLoaded().place(req(), snap) == Decision("disaggregated", "p1", "d1", "least-loaded pair")
    tie = ClusterSnapshot((w("p1", "prefill"), w("p0", "prefill"), w("d1", "decode"), w("d0", "decode")))
    assert LeastLoaded().place(req(), tie) == Decision("disaggregated", "p0", "d0", "least-loaded pair")


def test_inflight_counts_before_stats_catch_up():
    snap = ClusterSnapshot((w("p0", "prefill"), w("d0", "decode", num_inflight=1), w("d1", "decode")))
    assert LeastLoaded().place(req(), snap).decode == "d1"


def test_capacity_filters_workers_that_can_never_fit():
    snap = ClusterSnapshot((
        w("p0", "prefill", num_blocks=10, block_size=16),  # 160 tokens
        w("p1", "prefill", num_blocks=100, block_size=16),
        w("d0", "decode", num_blocks=10, block_size=16),
        w("d1", "decode", max_model_len=1000),
    ))
    assert LeastLoaded().place(req(num_prompt_tokens=200, max_tokens=10), snap) == Decision(
        "disaggregated", "p1", "d1", "least-loaded pair")
    with pytest.raises(NoWorkersAvailable, match=r"no healthy decode-capable worker fits request r \(1001 tokens"):
        LeastLoaded().place(req(num_prompt_tokens=1000, max_tokens=1), snap)


def test_no_decode_worker_left_is_degraded_to_a_prefill_worker():
    snap = ClusterSnapshot((w("p0", "prefill"), w("p1", "prefill"), w("d0", "decode", healthy=False)))
    for policy in (RoundRobin(), LeastLoaded()):
        decision = policy.place(req(), snap)
        assert (decision.kind, decision.prefill, decision.degraded) == ("local", None, True)
        assert decision.decode in ("p0", "p1") and decision.reason.startswith("degraded")
    assert RoundRobin().place(req(num_resumed_tokens=3), snap).degraded  # a migrated stream too
    healthy = ClusterSnapshot((w("p0", "prefill"), w("d0", "decode")))
    assert not RoundRobin().place(req(), healthy).degraded


def test_nothing_healthy_raises():
    snap = ClusterSnapshot((w("p0", "prefill", healthy=False), w("d0", "decode", healthy=False)))
    with pytest.raises(NoWorkersAvailable, match=r"0/2 workers healthy"):
        RoundRobin().place(req(), snap)
    with pytest.raises(NoWorkersAvailable, match=r"1 excluded"):
        RoundRobin().place(req(excluded=frozenset({"d0"})), ClusterSnapshot((w("d0", "decode"),)))
    with pytest.raises(NoWorkersAvailable):
        RoundRobin().place(req(), ClusterSnapshot((w("p0", "prefill"),), mode="colocated"))
    with pytest.raises(NoWorkersAvailable):
        LeastLoaded().place(req(), ClusterSnapshot(()))


def test_snapshot_and_decision_validation():
    with pytest.raises(ValueError, match="role"):
        w("x", "router")
    with pytest.raises(ValueError, match="mode"):
        ClusterSnapshot((), mode="hybrid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique"):
        ClusterSnapshot((w("a", "decode"), w("a", "prefill")))
    with pytest.raises(ValueError):
        Decision("disaggregated", None, "d0")
    with pytest.raises(ValueError):
        Decision("disaggregated", "d0", "d0")
    with pytest.raises(ValueError):
        Decision("local", "p0", "d0")
    assert Decision("disaggregated", "p0", "d0").workers == ("p0", "d0")


def test_only_workers_of_one_kv_compat_key_are_paired():
    from pdserve.router.placement.base import NoCompatiblePair

    a, b = "model=m dtype=bfloat16 block_size=16 wire=v2", "model=m dtype=float32 block_size=16 wire=v2"
    snap = ClusterSnapshot((w("p0", "prefill", kv_compat=a), w("p1", "prefill", kv_compat=b),
                            w("d0", "decode", kv_compat=b, num_running=5), w("d1", "decode", kv_compat=a)))
    from tests.router.network_fixtures import PROFILE

    for name in POLICIES:
        policy = make_policy(name, profile=PROFILE) if name == "network-aware" else make_policy(name)
        for _ in range(4):
            d = policy.place(req(), snap)
            assert d.kind == "disaggregated"
            assert snap.worker(d.prefill).kv_compat == snap.worker(d.decode).kv_compat, (name, d)
    mismatched = ClusterSnapshot((w("p0", "prefill", kv_compat=a), w("d0", "decode", kv_compat=b)))
    with pytest.raises(NoCompatiblePair, match="prefill p0 has .*bfloat16.*decode d0 has .*float32"):
        LeastLoaded().place(req(), mismatched)
    # an unknown key ("") pairs with any: clusters of workers that do not report one are unchanged
    unknown = ClusterSnapshot((w("p0", "prefill"), w("d0", "decode", kv_compat=b)))
    assert LeastLoaded().place(req(), unknown).kind == "disaggregated"
