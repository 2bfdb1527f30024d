"""The router's feedback to its placement policy (`observe_outcome`), against fake gRPC workers:
what a finished request reports, and that a failing policy never fails the request."""

from __future__ import annotations

import logging

import grpc
import pytest

from pdserve.router.placement.base import Outcome
from pdserve.router.placement.policies.network_aware import NetworkAware
from tests.router.network_fixtures import PROFILE
from tests.router.test_cluster_backend import Script, check_complete, cluster, collect, run


def _record(env) -> list[Outcome]:
    seen: list[Outcome] = []
    env.backend.policy.observe_outcome = seen.append
    return seen


def test_a_finished_disaggregated_request_reports_its_outcome():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            seen = _record(env)
            check_complete(await collect(env.backend, "r1", max_tokens=6), "r1", 6)
            [o] = seen
            assert (o.request_id, o.placement, o.prefill_worker, o.decode_worker) == ("r1", "disaggregated", "p0", "d0")
            assert (o.prompt_tokens, o.output_tokens, o.attempts) == (3, 6, 1)
            assert o.ttft_s is not None and o.ttft_s > 0 and o.tpot_s is not None and o.tpot_s >= 0
            assert o.prefill_s is not None and o.prefill_s >= 0  # what P reported, its queue excluded
    run(main)


def test_local_runs_and_recoveries_report_where_they_ran():
    async def main():
        async with cluster(("m0", "mixed"), mode="colocated") as env:
            seen = _record(env)
            check_complete(await collect(env.backend, "a", max_tokens=1), "a", 1)
            [o] = seen
            assert (o.placement, o.prefill_worker, o.decode_worker, o.prefill_s, o.tpot_s) == ("local", None, "m0",
                                                                                              None, None)
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.DEADLINE_EXCEEDED)),
                           ("d0", "decode")) as env:
            seen = _record(env)
            check_complete(await collect(env.backend, "r1"), "r1", 6)
            [o] = seen  # the KV missed its deadline: D prefilled it, in a second attempt
            assert (o.placement, o.decode_worker, o.attempts) == ("local", "d0", 2)
    run(main)


def test_a_failing_observe_outcome_does_not_fail_the_request(caplog):
    def broken(outcome: Outcome) -> None:
        raise RuntimeError("calibration bug")

    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            env.backend.policy.observe_outcome = broken
            for rid in ("r1", "r2"):
                check_complete(await collect(env.backend, rid, max_tokens=4), rid, 4)
            assert env.backend.snapshot().worker("d0").num_inflight == 0

    with caplog.at_level(logging.WARNING, logger="pdserve.router.cluster.recorder"):
        run(main)
    failures = [r for r in caplog.records if "observe_outcome failed" in r.getMessage()]
    assert len(failures) == 2 and "r1" in failures[0].getMessage()


def test_network_aware_learns_from_the_router_and_exports_its_factors():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            policy = NetworkAware(profile=PROFILE)
            env.backend.policy = policy
            env.backend.recorder.set_calibration_gauges(policy)
            assert env.metric("pdserve:policy_calibration_factor", policy="network-aware", quantity="prefill") == 1.0
            check_complete(await collect(env.backend, "r1"), "r1", 6)
            cal = policy.calibration
            assert cal.num_outcomes == 1 and cal.num_pending == 0
            # the fake P reports a 1 ms prefill; the profile says 1.6 ms for 3 tokens
            assert cal.ratios["prefill"].samples == 1
            assert cal.ratios["prefill"].value == pytest.approx(0.001 / PROFILE.prefill_seconds(3))
            assert cal.ratios["tpot.disaggregated"].samples == 1
            # its TTFT was predicted before the prefill factor was in use: not a residual's sample
            assert cal.ratios["ttft.disaggregated"].samples == 0
            assert env.metric("pdserve:policy_calibration_factor", policy="network-aware",
                              quantity="prefill") == 1.0  # one sample: not used yet
    run(main)
