"""The simulator runs network-aware with its calibration: a policy whose profile underestimates
the served prefill 2x learns it from the simulated outcomes and leaves a split that cannot
carry the load for "local", which meets the SLOs there, where the uncalibrated policy keeps the
split and its TTFT queue grows. When local meets the TPOT SLO at no rate, the calibrated policy
keeps the split: it serves more requests within the SLOs (goodput first, pdserve/router/placement/policies/split.py)."""

from __future__ import annotations

import dataclasses

from pdserve.router.placement.topology import Topology
from pdserve.sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from pdserve.sim.run import Arrival, simulate, to_record
from tests.router.test_split import FLAT

SERVED = dataclasses.replace(FLAT, prefill_times=tuple(2 * t for t in FLAT.prefill_times))


def _run(calibrate: bool, slo_tpot: float = 0.05):
    # two mixed workers on one node computing with SERVED (a 1000-token prefill: 0.2 s); the
    # policy models them with FLAT (0.1 s). 6 req/s: split, the prefill worker needs 6 x 0.2 = 1.2
    # of itself; local, each worker 3 x 0.2 = 0.6 (TPOT ~22-31 ms: within a 50 ms SLO, over 11 ms).
    config = ClusterConfig(
        profile=SERVED, topology=Topology(),
        workers=(WorkerConfig("w0", "mixed", "n0"), WorkerConfig("w1", "mixed", "n0")),
        engine=EngineLimits(num_blocks=20000, block_size=16, max_num_batched_tokens=512, max_num_seqs=64),
        router=RouterConfig(stats_interval_s=0.0, policy_options={"network-aware": {
            "profile": FLAT, "slo_ttft": 1.0, "slo_tpot": slo_tpot, "calibrate": calibrate}}),
    )
    return simulate(config, "network-aware", [Arrival(i / 6, 1000, 100) for i in range(150)])


def test_a_calibrated_policy_leaves_the_split_its_served_prefill_cannot_carry():
    plain, calibrated = _run(False), _run(True)
    plain_kinds = [r.decision.kind for r in plain.requests]
    kinds = [r.decision.kind for r in calibrated.requests]
    assert plain_kinds[7:40] == ["disaggregated"] * 33 and kinds[7:19] == ["disaggregated"] * 12
    assert set(kinds[40:]) == {"local"}  # after the first outcomes: local, and it stays
    ttft = [to_record(r).ttft_s for r in calibrated.requests]
    plain_ttft = [to_record(r).ttft_s for r in plain.requests]
    assert max(ttft[100:]) < 0.5 < 5.0 < max(plain_ttft[100:])  # the split's queue grows
    reason = calibrated.requests[-1].decision.reason
    assert "split 1P: overloaded" in reason and "calibrated: prefill x2." in reason


def test_a_split_is_kept_when_local_meets_the_tpot_slo_at_no_rate():
    calibrated = _run(True, slo_tpot=0.011)
    kinds = [r.decision.kind for r in calibrated.requests]
    assert set(kinds[7:]) == {"disaggregated"}
    reason = calibrated.requests[-1].decision.reason
    assert reason.startswith("hybrid split 1P: overloaded, within SLOs to") and "calibrated: prefill x2." in reason
    local = reason.split("local:")[1]
    assert "within SLOs to" in local and float(local.split("within SLOs to ")[1].split()[0]) < float(
        reason.split("within SLOs to ")[1].split()[0])
