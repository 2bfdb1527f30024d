"""Duties: a directory's role override for mixed workers, as the router's worker pool applies it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.router.cluster.directory import StaticDirectory, WorkerEndpoint, check_duty
from pdserve.router.cluster.worker_pool import WorkerPool
from pdserve.router.placement.base import ClusterSnapshot, RequestInfo
from pdserve.router.placement.registry import make_policy
from tests.router.fake_workers import Cluster, FakeWorker


def test_check_duty_lets_only_mixed_workers_take_another_role():
    check_duty("m0", "mixed", "decode")
    check_duty("p0", "prefill", "prefill")
    with pytest.raises(ValueError, match="only a mixed worker can take decode duty"):
        check_duty("p0", "prefill", "decode")
    with pytest.raises(ValueError, match="duty must be one of"):
        check_duty("m0", "mixed", "verifier")


def test_static_directory_set_duty_names_the_bad_worker():
    directory = StaticDirectory([WorkerEndpoint("m0", "mixed", "127.0.0.1:1"),
                                 WorkerEndpoint("d0", "decode", "127.0.0.1:2")])
    directory.set_duty("m0", "decode")
    assert directory.duties == {"m0": "decode"}
    directory.set_duty("m0", "mixed")  # its own role again: no override
    assert directory.duties == {}
    with pytest.raises(ValueError, match="no worker 'x'"):
        directory.set_duty("x", "decode")
    with pytest.raises(ValueError, match="'d0' is a decode worker"):
        directory.set_duty("d0", "prefill")


def test_the_pool_counts_and_places_a_mixed_worker_as_its_duty(caplog):
    async def scenario() -> None:
        shared = Cluster()
        workers = [await FakeWorker(f"m{i}", "mixed", shared).start() for i in range(3)]
        workers.append(await FakeWorker("p0", "prefill", shared).start())
        directory = StaticDirectory([w.endpoint for w in workers])
        pool = WorkerPool(directory, interval_s=10, health_timeout_s=2)
        policy = make_policy("least-loaded")
        try:
            await pool.refresh()
            assert {s.worker_id: s.role for s in pool.snapshots()} == {"m0": "mixed", "m1": "mixed", "m2": "mixed",
                                                                       "p0": "prefill"}
            directory.set_duty("m0", "decode")
            directory.set_duty("m1", "decode")
            directory.set_duty("m2", "prefill")
            directory.duties["p0"] = "decode"  # a directory that does not check: the pool refuses it
            with caplog.at_level(logging.WARNING, logger="pdserve.router.cluster.worker_pool"):
                await pool.refresh()
                await pool.refresh()
            assert sum("ignoring a duty" in r.getMessage() for r in caplog.records) == 1  # warned once
            snaps = {s.worker_id: s for s in pool.snapshots()}
            assert {i: s.role for i, s in snaps.items()} == {"m0": "decode", "m1": "decode", "m2": "prefill",
                                                             "p0": "prefill"}
            assert pool.workers["m0"].endpoint.role == "mixed" and pool.describe()["m0"]["duty"] == "decode"
            assert "duty" not in pool.describe()["p0"]
            # placement: prefills only on prefill-duty or prefill workers, decodes only on decode-duty ones
            for i in range(6):
                d = policy.place(RequestInfo(f"r{i}", 400, 8),
                                 ClusterSnapshot(tuple(pool.snapshots()), mode="disaggregated"))
                assert d.kind == "disaggregated" and d.prefill in {"m2", "p0"} and d.decode in {"m0", "m1"}
            directory.set_duty("m0", "mixed")
            await pool.refresh()
            assert pool.workers["m0"].role == "mixed" and pool.workers["m0"].duty is None
        finally:
            await pool.close()
            for w in workers:
                await w.stop()

    asyncio.run(scenario())
