"""Network-aware placement: exact decisions on crafted snapshots (see network_fixtures)."""

from __future__ import annotations

import pytest

from pdserve.router.placement.congestion import LinkMonitor
from pdserve.router.placement.base import ClusterSnapshot, Decision, SLOUnattainable
from pdserve.router.placement.registry import make_policy
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.cost import estimate_local, estimate_pair
from tests.router.network_fixtures import PROFILE, req, snapshot, topology, w

# p0 (node a) reaches d0 (node c) over 1 Gbps, p1 (node b) over 100 Gbps: p0 sorts first on purpose.
SPLIT = topology(("a", "c", 1.0), ("b", "c", 100.0))
SPLIT_WORKERS = (w("p0", "prefill", "a"), w("p1", "prefill", "b"), w("d0", "decode", "c"))


def test_cost_model_numbers():
    snap = snapshot(SPLIT_WORKERS, SPLIT)
    fast = estimate_pair(PROFILE, req(), snap.worker("p1"), snap.worker("d0"), snap)
    assert fast.prefill_s == pytest.approx(0.4096)
    assert fast.kv_s == pytest.approx(4096 * 128 * 1024 * 8 / 100e9)
    assert fast.hidden_s == pytest.approx(31 / 32 * fast.kv_s)  # the link keeps up: only 1/L exposed
    assert fast.ttft_s == pytest.approx(0.4096 + fast.kv_s / 32)
    slow = estimate_pair(PROFILE, req(), snap.worker("p0"), snap.worker("d0"), snap)
    assert slow.hidden_s == pytest.approx(31 / 32 * 0.4096)  # the compute hides what it overlaps
    assert slow.ttft_s == pytest.approx(0.4096 + slow.kv_s - 31 / 32 * 0.4096)
    busy = w("d1", "decode", "c", num_running=8, num_inflight=8, num_inflight_tokens=8 * 1000)
    local = estimate_local(PROFILE, req(1024), busy)
    step = PROFILE.decode_step_seconds(8, 1000 + (1024 + 16 - 1000) // 9)
    assert local.queue_s == pytest.approx(2 * step)  # 2 chunks of 512, each in a step with the batch
    assert local.tpot_s == pytest.approx(PROFILE.decode_step_seconds(9, 1004) + PROFILE.prefill_seconds(512))


def test_long_prompt_goes_over_the_fast_link():
    decision = NetworkAware(profile=PROFILE).place(req(4096), snapshot(SPLIT_WORKERS, SPLIT))
    assert (decision.kind, decision.prefill, decision.decode) == ("disaggregated", "p1", "d0")
    assert decision.reason.startswith("TTFT 0.411s p1->d0 (queue 0.000 + prefill 0.410 + kv 0.043 - hidden 0.042")


def test_every_link_congested_keeps_prefill_local():
    flows = {"a->c": 4, "b->c": 60}  # 1/5 Gbps and 100/61 Gbps left
    decision = NetworkAware(profile=PROFILE).place(req(4096), snapshot(SPLIT_WORKERS, SPLIT, flows))
    assert (decision.kind, decision.prefill, decision.decode) == ("local", None, "d0")
    # the best pair (1/5 Gbps) is priced with its KV in FP8 (the link is the bound; 18/32 of the
    # bytes on the wire but the first block's): 1.497 s, not 2.633 s
    assert "local beats every pair" in decision.reason and "best pair 1.497s" in decision.reason


def test_idle_links_keep_disaggregation_even_when_local_is_marginally_faster():
    decision = NetworkAware(profile=PROFILE).place(req(4096), snapshot(SPLIT_WORKERS, SPLIT))
    assert decision.kind == "disaggregated"
    always_local = NetworkAware(profile=PROFILE, local_margin=0.0).place(req(4096), snapshot(SPLIT_WORKERS, SPLIT))
    assert always_local == Decision("local", None, "d0", always_local.reason)


def test_new_flows_move_off_a_congested_link():
    topo = topology(("a", "c", 100.0), ("b", "c", 100.0))
    workers = (w("p0", "prefill", "a"), w("p1", "prefill", "b"), w("d0", "decode", "c"))
    policy = NetworkAware(profile=PROFILE)
    assert policy.place(req(), snapshot(workers, topo, {"a->c": 8})).prefill == "p1"
    assert policy.place(req(), snapshot(workers, topo, {"b->c": 8})).prefill == "p0"
    # flows the router starts itself spread over both links
    monitor, chosen = LinkMonitor(), []
    for _ in range(4):
        snap = ClusterSnapshot(workers, topology=topo, links=monitor.view())
        decision = policy.place(req(), snap)
        src = snap.node_of(snap.worker(decision.prefill))
        monitor.start(f"{src}->c", 4096 * PROFILE.kv_bytes_per_token)
        chosen.append(decision.prefill)
    assert chosen == ["p0", "p1", "p0", "p1"]


# d0 shares node a with p0 but runs 60 requests; d1 is on node b behind 5 Gbps, with 2.
TPOT_WORKERS = (w("p0", "prefill", "a"), w("d0", "decode", "a", num_running=60), w("d1", "decode", "b", num_running=2))
TPOT_TOPO = topology(("a", "b", 5.0))


def test_tpot_check_skips_an_overloaded_decode_worker():
    snap = snapshot(TPOT_WORKERS, TPOT_TOPO)
    assert NetworkAware(profile=PROFILE).place(req(), snap).decode == "d0"  # fastest TTFT without the check
    decision = NetworkAware(profile=PROFILE, slo_tpot=0.03).place(req(), snap)
    assert (decision.kind, decision.prefill, decision.decode) == ("disaggregated", "p0", "d1")
    assert "TPOT 0.011s" in decision.reason and "(1 over the TPOT SLO" in decision.reason


def test_admission_control_rejects_when_nothing_meets_the_slo():
    snap = snapshot(SPLIT_WORKERS, SPLIT)
    strict = NetworkAware(profile=PROFILE, slo_ttft=0.1, admission_control=True)
    with pytest.raises(SLOUnattainable, match=r"no option meets the TTFT SLO of 0.100s; best: TTFT 0.41"):
        strict.place(req(4096), snap)
    assert strict.place(req(256), snap).kind == "disaggregated"  # 0.026 s of prefill fits
    lenient = NetworkAware(profile=PROFILE, slo_ttft=0.1)
    assert "misses the TTFT SLO 0.100s" in lenient.place(req(4096), snap).reason
    tpot_only = NetworkAware(profile=PROFILE, slo_tpot=0.001, admission_control=True)
    with pytest.raises(SLOUnattainable, match="no option within the TPOT SLO"):
        tpot_only.place(req(4096), snap)


def test_slo_prefers_the_option_that_meets_it():
    # over 1 Gbps the pair misses the TTFT SLO and local meets it: the SLO wins over the margin
    topo = topology(("a", "c", 1.0))
    snap = snapshot((w("p0", "prefill", "a"), w("d0", "decode", "c")), topo)
    decision = NetworkAware(profile=PROFILE, slo_ttft=0.5, local_margin=0.99).place(req(4096), snap)
    assert decision.kind == "local" and "only local meets the TTFT SLO" in decision.reason


def test_decode_without_free_blocks_is_skipped():
    workers = (w("p0", "prefill", "a"), w("d0", "decode", "a", num_blocks=1000, num_free_blocks=10, block_size=16),
               w("d1", "decode", "b"))
    decision = NetworkAware(profile=PROFILE).place(req(1024), snapshot(workers, topology(("a", "b", 100.0))))
    assert decision.decode == "d1"


def test_queue_at_prefill_worker_counts():
    topo = topology(("a", "c", 100.0), ("b", "c", 100.0))
    workers = (w("p0", "prefill", "a", num_inflight=2, num_running=2, num_inflight_tokens=8192),
               w("p1", "prefill", "b"), w("d0", "decode", "c"))
    assert NetworkAware(profile=PROFILE).place(req(), snapshot(workers, topo)).prefill == "p1"


def test_shared_rules_and_local_only_paths():
    policy = NetworkAware(profile=PROFILE, local_prefill_max_tokens=32)
    snap = snapshot((w("p0", "prefill", "a"), w("d0", "decode", "a", num_running=9), w("d1", "decode", "b")),
                    topology())
    assert policy.place(req(16), snap) == Decision("local", None, "d1", "short prompt (16 <= 32 tokens)")
    assert policy.place(req(4096, num_resumed_tokens=3), snap).decode == "d1"
    colocated = ClusterSnapshot((w("m0", "mixed", "a", num_running=5), w("m1", "mixed", "b")), mode="colocated")
    assert policy.place(req(), colocated) == Decision("colocated", None, "m1", "colocated mode")


def test_options_are_checked():
    with pytest.raises(ValueError, match="network-aware needs --profile"):
        make_policy("network-aware")
    with pytest.raises(ValueError, match="slo_ttft must be a number of seconds > 0"):
        NetworkAware(profile=PROFILE, slo_ttft=0)
    with pytest.raises(ValueError, match="admission control needs an SLO"):
        NetworkAware(profile=PROFILE, admission_control=True)
    with pytest.raises(ValueError, match="local_margin"):
        NetworkAware(profile=PROFILE, local_margin=1.5)
    assert isinstance(make_policy("network-aware", profile=PROFILE, slo_tpot=0.1), NetworkAware)


def test_a_link_whose_transfer_missed_its_deadline_is_no_longer_chosen():
    # p0 reaches d0 and d1 over equal 10 Gbps links; d1 is a little busier, so d0 wins while both links look equal
    topo = topology(("a", "c", 10.0), ("a", "d", 10.0))
    workers = (w("p0", "prefill", "a"), w("d0", "decode", "c"), w("d1", "decode", "d", num_running=2))
    policy, monitor = NetworkAware(profile=PROFILE), LinkMonitor()

    def place():
        return policy.place(req(), ClusterSnapshot(workers, topology=topo, links=monitor.view()))

    assert (place().prefill, place().decode) == ("p0", "d0")
    # the link to d0 slows: a transfer of the prompt's KV misses its 5 s deadline
    flow = monitor.start("a->c", 4096 * PROFILE.kv_bytes_per_token)
    monitor.finish(flow, missed_deadline_s=5.0)
    assert monitor.state("a->c").measured_gbps == pytest.approx(4096 * PROFILE.kv_bytes_per_token * 8 / 5.0 / 1e9)
    decision = place()
    assert (decision.kind, decision.prefill, decision.decode) == ("disaggregated", "p0", "d1"), decision.reason
