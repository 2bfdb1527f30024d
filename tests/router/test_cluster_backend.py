"""ClusterBackend against fake gRPC workers on loopback: the normal paths and every failure path.

Each test runs in its own event loop under a hard timeout; waits poll with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.errors import InvalidRequest, Overloaded, ServiceUnavailable
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
from tests.router.conftest import CharTokenizer
from tests.router.fake_workers import Cluster, FakeWorker, MutableDirectory, Script, expected_tokens

PROMPT = [10, 11, 12]
TEST_TIMEOUT_S = 20


def run(test: Callable[[], object]) -> None:
    asyncio.run(asyncio.wait_for(test(), TEST_TIMEOUT_S))  # type: ignore[arg-type]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@dataclass
class Env:
    workers: dict[str, FakeWorker]
    backend: ClusterBackend
    directory: MutableDirectory
    metrics: RouterMetrics

    def __getitem__(self, worker_id: str) -> FakeWorker:
        return self.workers[worker_id]

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def healthy(self, worker_id: str) -> bool:
        return self.backend.snapshot().worker(worker_id).healthy


@contextlib.asynccontextmanager
async def cluster(*specs: tuple[str, str] | tuple[str, str, Script], policy: str = "round-robin",
                  **backend_kwargs: object) -> AsyncIterator[Env]:
    shared = Cluster()
    workers = {}
    for spec in specs:
        worker_id, role, *script = spec
        workers[worker_id] = await FakeWorker(worker_id, role, shared, script[0] if script else None).start()
    directory = MutableDirectory([w.endpoint for w in workers.values()])
    metrics = RouterMetrics()
    options: dict[str, Any] = dict(stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=1.0, kv_deadline_s=1.0,
                                   metrics=metrics)
    options.update(backend_kwargs)
    backend = ClusterBackend(directory, make_policy(policy), CharTokenizer(), "fake-model", 4096, **options)
    await backend.start()
    try:
        yield Env(workers, backend, directory, metrics)
    finally:
        await backend.close()
        for worker in workers.values():
            await worker.stop()


async def collect(backend: ClusterBackend, request_id: str, max_tokens: int = 6, prompt: list[int] = PROMPT,
                  **params: object) -> list[RequestOutput]:
    return [o async for o in backend.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))]


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def check_complete(outputs: list[RequestOutput], request_id: str, n: int, seed: int | None = None) -> None:
    """One continuous stream: every expected token once, in order, finished with usage counts."""
    want = expected_tokens(PROMPT, n, seed)
    assert tokens(outputs) == want
    assert "".join(o.new_text for o in outputs) == "".join(map(chr, want))
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    last = outputs[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == ("length", len(PROMPT), n)
    assert {o.request_id for o in outputs} == {request_id}


# ---------------------------------------------------------------- normal paths


def test_disaggregated_flow():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            outputs = await collect(env.backend, "r1", max_tokens=6, seed=3)
            check_complete(outputs, "r1", 6, seed=3)
            assert len(outputs) == 6 and outputs[0].num_output_tokens == 1  # the first token, alone, from P
            assert env["p0"].calls == [("Prefill", "r1")]
            assert env["d0"].calls == [("Reserve", "r1"), ("Decode", "r1")]
            assert env["d0"].aborts == [] and env["p0"].aborts == []
            assert env.metric("pdserve:placement_decisions_total", policy="round-robin", kind="disaggregated") == 1
            assert env.metric("pdserve:kv_transfer_bytes_total", link="p0->d0") == 3000
            assert env.metric("pdserve:kv_transfer_seconds_count", link="p0->d0") == 1
            assert env.backend.snapshot().worker("d0").num_inflight == 0
            health = await env.backend.health()
            assert health["healthy"] is True and set(health["workers"]) == {"p0", "d0"}
    run(main)


def test_first_token_that_finishes_frees_the_reservation():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            outputs = await collect(env.backend, "r1", max_tokens=1)
            check_complete(outputs, "r1", 1)
            await until(lambda: env["d0"].aborts == ["r1"])
            assert env["d0"].called("Decode") == []
    run(main)


def test_colocated_mode_round_robins_mixed_workers():
    async def main():
        async with cluster(("m0", "mixed"), ("m1", "mixed"), mode="colocated") as env:
            for rid in ("a", "b", "c"):
                check_complete(await collect(env.backend, rid, max_tokens=4), rid, 4)
            assert env["m0"].calls == [("Generate", "a"), ("Generate", "c")]
            assert env["m1"].calls == [("Generate", "b")]
            assert env.metric("pdserve:placement_decisions_total", policy="round-robin", kind="colocated") == 3
    run(main)


def test_least_loaded_sees_inflight_before_the_next_poll():
    async def main():
        slow = Script(step_delay_s=0.05)
        async with cluster(("m0", "mixed", slow), ("m1", "mixed", slow), policy="least-loaded", mode="colocated",
                           stats_interval_s=30) as env:
            first = asyncio.create_task(collect(env.backend, "a", max_tokens=8))
            await until(lambda: env["m0"].called("Generate") == ["a"])
            second = await collect(env.backend, "b", max_tokens=2)
            check_complete(second, "b", 2)
            check_complete(await first, "a", 8)
            assert env["m1"].called("Generate") == ["b"]
    run(main)


# ---------------------------------------------------------------- failures before the first token


def test_prefill_unavailable_replaces_on_another_prefill_worker():
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.UNAVAILABLE)), ("p1", "prefill"),
                           ("d0", "decode")) as env:
            outputs = await collect(env.backend, "r1")
            check_complete(outputs, "r1", 6)
            assert env["p0"].called("Prefill") == ["r1"]
            assert env["p1"].called("Prefill") == ["r1.1"]
            assert env["d0"].called("Reserve") == ["r1", "r1.1"]
            assert env["d0"].aborts == ["r1"]  # the first reservation was freed
            assert env["d0"].called("Decode") == ["r1.1"]
            assert env.metric("pdserve:request_recoveries_total", kind="replace") == 1
    run(main)


def test_prefill_worker_death_falls_back_to_local_prefill():
    async def main():
        async with cluster(("p0", "prefill", Script(die_in_prefill=True)), ("d0", "decode")) as env:
            outputs = await collect(env.backend, "r1")
            check_complete(outputs, "r1", 6)
            assert env["d0"].calls == [("Reserve", "r1"), ("Abort", "r1"), ("Generate", "r1.1")]
            assert not env.healthy("p0")
            assert env.metric("pdserve:placement_decisions_total", policy="round-robin", kind="local") == 1
            # later requests go local at once while P is down
            check_complete(await collect(env.backend, "r2"), "r2", 6)
            assert env["d0"].called("Generate") == ["r1.1", "r2"]
    run(main)


def test_kv_deadline_on_prefill_falls_back_to_generate_on_d():
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.DEADLINE_EXCEEDED)),
                           ("p1", "prefill"), ("d0", "decode")) as env:
            outputs = await collect(env.backend, "r1")
            check_complete(outputs, "r1", 6)
            assert env["d0"].calls == [("Reserve", "r1"), ("Abort", "r1"), ("Generate", "r1.1")]
            assert list(env["d0"].generate_requests[0].resumed_token_ids) == []
            assert env["p0"].aborts == ["r1"] and env["p1"].calls == []
            assert env.healthy("p0")  # a missed deadline is no death
            assert env.metric("pdserve:request_recoveries_total", kind="local_fallback") == 1
    run(main)


@pytest.mark.parametrize("leaves", [False, True], ids=["stays", "leaves-the-directory"])
def test_an_abort_that_did_not_reach_a_stopped_worker_is_sent_again_when_it_answers(leaves):
    """Issue 30's sigstop row: the KV missed its deadline while D was stopped, so the router's
    Abort of D's reservation did not reach D (timed out unserved, or D had left the directory
    and its connection was closed); D leases a reservation for the router's queue bound, so it
    held the blocks for minutes. The Abort goes again after D's next good poll."""
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.DEADLINE_EXCEEDED)),
                           ("d0", "decode", Script(hang_aborts=True))) as env:
            task = asyncio.create_task(collect(env.backend, "r1"))
            await until(lambda: env["d0"].called("Generate") == ["r1.1"], timeout_s=5)
            check_complete(await task, "r1", 6)
            assert "r1" in env["d0"].reservations and env["d0"].aborts == []  # the Abort did not reach D
            if leaves:  # the directory drops D while it does not answer, then lists it again
                entries = env.directory.entries
                env.directory.entries = [e for e in entries if e.worker_id != "d0"]
                await until(lambda: "d0" not in env.backend.pool.workers)
                env.directory.entries = entries
            env["d0"].script.hang_aborts = False  # D wakes up
            await until(lambda: "r1" not in env["d0"].reservations, timeout_s=3)
            assert env["d0"].aborts == ["r1"]
            await asyncio.sleep(0.2)  # sent once: the next polls send nothing
            assert env["d0"].aborts == ["r1"]
    run(main)


def test_kv_deadline_on_decode_resumes_after_the_first_token():
    async def main():
        async with cluster(("p0", "prefill", Script(push_kv=False)), ("d0", "decode")) as env:
            outputs = await collect(env.backend, "r1")
            check_complete(outputs, "r1", 6)
            assert env["d0"].calls == [("Reserve", "r1"), ("Decode", "r1"), ("Abort", "r1"), ("Generate", "r1.1")]
            assert list(env["d0"].generate_requests[0].resumed_token_ids) == expected_tokens(PROMPT, 1)
    run(main)


def test_full_decode_worker_is_skipped_then_overloaded():
    async def main():
        full = Script(reserve_error=grpc.StatusCode.RESOURCE_EXHAUSTED)
        async with cluster(("p0", "prefill"), ("d0", "decode", full), ("d1", "decode")) as env:
            check_complete(await collect(env.backend, "r1"), "r1", 6)
            assert env["d1"].called("Reserve") == ["r1.1"]
            assert env.healthy("d0")  # full, not dead
        async with cluster(("p0", "prefill"), ("d0", "decode", full)) as env:
            with pytest.raises(Overloaded):
                await collect(env.backend, "r1")
    run(main)


def test_rejected_request_is_a_client_error_and_frees_the_reservation():
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.INVALID_ARGUMENT)),
                           ("d0", "decode")) as env:
            with pytest.raises(InvalidRequest, match="scripted INVALID_ARGUMENT"):
                await collect(env.backend, "r1")
            assert env["d0"].aborts == ["r1"]
            assert env.healthy("p0")
    run(main)


def test_retries_are_bounded():
    async def main():
        broken = Script(generate_error=grpc.StatusCode.INTERNAL)
        async with cluster(("m0", "mixed", broken), ("m1", "mixed", broken), ("m2", "mixed", broken),
                           ("m3", "mixed", broken), mode="colocated", max_retries=2) as env:
            start = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="failed on every worker tried"):
                await collect(env.backend, "r1")
            assert time.monotonic() - start < 2
            assert sum(len(w.called("Generate")) for w in env.workers.values()) == 3
    run(main)


# ---------------------------------------------------------------- failures mid-stream


def test_decode_worker_death_migrates_with_resumed_tokens():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode", Script(die_after_tokens=2)), ("d1", "decode")) as env:
            outputs = await collect(env.backend, "r1", max_tokens=8)
            check_complete(outputs, "r1", 8)  # no token lost, none duplicated
            assert env["d0"].called("Decode") == ["r1"]
            migrated = env["d1"].generate_requests
            assert [g.request_id for g in migrated] == ["r1.1"]
            assert list(migrated[0].resumed_token_ids) == expected_tokens(PROMPT, 3)  # P's first + D0's two
            assert list(migrated[0].prompt_token_ids) == PROMPT
            assert not env.healthy("d0")
            assert env.metric("pdserve:request_recoveries_total", kind="migrate") == 1
    run(main)


def test_colocated_worker_death_migrates():
    async def main():
        async with cluster(("m0", "mixed", Script(die_after_tokens=3)), ("m1", "mixed"), mode="colocated") as env:
            check_complete(await collect(env.backend, "r1", max_tokens=7), "r1", 7)
            assert list(env["m1"].generate_requests[0].resumed_token_ids) == expected_tokens(PROMPT, 3)
    run(main)


def test_death_with_nowhere_to_go_raises_service_unavailable():
    async def main():
        async with cluster(("d0", "decode", Script(die_after_tokens=1)), mode="colocated") as env:
            received: list[RequestOutput] = []
            start = time.monotonic()
            with pytest.raises(ServiceUnavailable) as err:
                async for output in env.backend.generate("r1", PROMPT, SamplingParams(max_tokens=6)):
                    received.append(output)
            assert time.monotonic() - start < 3
            assert tokens(received) == expected_tokens(PROMPT, 1)
            assert err.value.headers["Retry-After"] == "1"
    run(main)


def test_a_worker_death_while_draining_ends_the_request_instead_of_moving_it():
    """Shutting down (`drain`): the request whose decode worker dies ends with ServiceUnavailable
    at once; it is not migrated to the other decode worker (the one the same death would move it
    to when serving: test_decode_worker_death_migrates_with_resumed_tokens)."""
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode", Script(die_after_tokens=2)), ("d1", "decode")) as env:
            env.backend.drain()
            received: list[RequestOutput] = []
            with pytest.raises(ServiceUnavailable, match="shutting down"):
                async for output in env.backend.generate("r1", PROMPT, SamplingParams(max_tokens=8)):
                    received.append(output)
            assert tokens(received) == expected_tokens(PROMPT, 3)  # P's first token and D0's two
            assert env["d1"].generate_requests == [] and env["d1"].called("Decode") == []
            assert env.metric("pdserve:request_recoveries_total", kind="migrate") == 0
            await asyncio.sleep(0.3)  # six monitor intervals: none polls the dead worker any more
            assert env.healthy("d0")
    run(main)


# ---------------------------------------------------------------- riding through a worker restart


def test_only_decode_worker_dies_mid_stream_the_prefill_worker_finishes_it():
    """1P+1D, D dies while streaming: the stream migrates to P (degraded), the client sees one
    complete stream, and later requests run on P until D is back."""
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode", Script(die_after_tokens=2))) as env:
            check_complete(await collect(env.backend, "r1", max_tokens=6), "r1", 6)
            assert env["p0"].called("Generate") == ["r1.1"]
            assert list(env["p0"].generate_requests[0].resumed_token_ids) == expected_tokens(PROMPT, 3)
            assert env.metric("pdserve:request_recoveries_total", kind="migrate") == 1
            assert env.metric("pdserve:request_recoveries_total", kind="degraded") == 1
            await until(lambda: not env.healthy("d0"))
            check_complete(await collect(env.backend, "r2"), "r2", 6)
            assert env["p0"].called("Generate") == ["r1.1", "r2"]
            health = await env.backend.health()
            assert health["healthy"] is True and "degraded" in health
    run(main)


def test_kv_push_failure_is_the_decode_workers_failure():
    """Prefill answers ABORTED (its KV could not reach D): D is excluded, P is not, and the
    request runs on P alone."""
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.ABORTED)), ("d0", "decode")) as env:
            check_complete(await collect(env.backend, "r1"), "r1", 6)
            assert env["p0"].called("Generate") == ["r1.1"]
            assert env["d0"].called("Generate") == []
            assert env.healthy("p0")
    run(main)


def test_request_waits_for_a_worker_to_come_back():
    async def main():
        async with cluster(("d0", "decode"), mode="colocated", worker_wait_s=10.0) as env:
            port = env["d0"].port
            await env["d0"].stop()
            await until(lambda: not env.healthy("d0"))
            task = asyncio.create_task(collect(env.backend, "r1"))
            await until(lambda: env.metric("pdserve:requests_waiting_for_worker") == 1)
            await asyncio.sleep(0.3)
            assert not task.done()
            await env["d0"].start(port)  # back (restarted) at the same address
            start = time.monotonic()
            check_complete(await task, "r1", 6)
            assert time.monotonic() - start < 2
            assert env.metric("pdserve:requests_waiting_for_worker") == 0
            assert env.metric("pdserve:worker_wait_seconds_count") == 1
            assert env.metric("pdserve:worker_wait_seconds_sum") > 0.3
            assert env.metric("pdserve:worker_wait_timeouts_total") == 0
    run(main)


def test_wait_past_the_deadline_is_503_with_retry_after():
    async def main():
        async with cluster(("d0", "decode"), mode="colocated", worker_wait_s=0.6) as env:
            await env["d0"].stop()
            await until(lambda: not env.healthy("d0"))
            start = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="waited 0.[6-9]s for a worker") as err:
                await collect(env.backend, "r1")
            assert 0.6 <= time.monotonic() - start < 1.5
            assert err.value.headers == {"Retry-After": "1"}
            assert env.metric("pdserve:worker_wait_timeouts_total") == 1
            # an abort while waiting ends the request at once
            task = asyncio.create_task(collect(env.backend, "r2"))
            await until(lambda: env.metric("pdserve:requests_waiting_for_worker") == 1)
            await env.backend.abort("r2")
            outputs = await task
            assert [(o.finished, o.finish_reason) for o in outputs] == [(True, "abort")]
    run(main)


def test_hung_worker_is_detected_by_health_checks():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode", Script(step_delay_s=0.02)), ("d1", "decode")) as env:
            task = asyncio.create_task(collect(env.backend, "r1", max_tokens=40))
            await until(lambda: env["d0"].called("Decode") == ["r1"])
            await asyncio.sleep(0.1)
            env["d0"].script.hang = True  # alive but silent: no tokens, no Health answers
            start = time.monotonic()
            outputs = await task
            assert time.monotonic() - start < 2  # health_timeout_s=0.5 plus a poll interval
            check_complete(outputs, "r1", 40)
            assert env["d1"].called("Generate") == ["r1.1"]
            assert not env.healthy("d0")
    run(main)


# ---------------------------------------------------------------- abort, health, recovery


def test_abort_during_prefill_reaches_both_workers():
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_delay_s=5)), ("d0", "decode")) as env:
            task = asyncio.create_task(collect(env.backend, "r1"))
            await until(lambda: env["p0"].called("Prefill") == ["r1"])
            start = time.monotonic()
            await env.backend.abort("r1")
            outputs = await task
            assert time.monotonic() - start < 1
            assert [(o.finished, o.finish_reason) for o in outputs] == [(True, "abort")]
            assert env["p0"].aborts == ["r1"] and env["d0"].aborts == ["r1"]
            await env.backend.abort("r1")  # idempotent, unknown ids too
            await env.backend.abort("nope")
            assert env["d0"].aborts == ["r1"]
            assert env.healthy("p0") and env.healthy("d0")
    run(main)


def test_abort_mid_stream_stops_decode():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode", Script(step_delay_s=0.05))) as env:
            received: list[RequestOutput] = []
            async for output in env.backend.generate("r1", PROMPT, SamplingParams(max_tokens=100)):
                received.append(output)
                if len(received) == 3:
                    await env.backend.abort("r1")
            assert received[-1].finish_reason == "abort" and len(received) == 4
            assert "r1" in env["d0"].aborts
            await until(lambda: not env["d0"].live)
            assert env["d0"].called("Generate") == []  # an abort is not a failure: no migration
    run(main)


def test_closing_the_stream_early_aborts_the_workers():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode", Script(step_delay_s=0.02))) as env:
            stream = env.backend.generate("r1", PROMPT, SamplingParams(max_tokens=100))
            await anext(stream)
            await anext(stream)
            await stream.aclose()
            await until(lambda: "r1" in env["d0"].aborts and not env["d0"].live)
    run(main)


def test_no_healthy_workers_fails_fast():
    async def main():
        sick = Script(healthy=False)
        async with cluster(("p0", "prefill", sick), ("d0", "decode", sick), ("d1", "decode", sick)) as env:
            start = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="no healthy decode-capable worker"):
                await collect(env.backend, "r1")
            assert time.monotonic() - start < 0.5
            health = await env.backend.health()
            assert health["healthy"] is False and "no healthy decode-capable worker" in health["reason"]
            assert health["workers"]["d0"]["detail"] == "reports unhealthy: scripted unhealthy"
        async with cluster() as env:
            with pytest.raises(ServiceUnavailable):
                await collect(env.backend, "r1")
    run(main)


def test_worker_that_comes_back_is_used_again():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            port = env["p0"].port
            await env["p0"].stop()
            await until(lambda: not env.healthy("p0"))
            check_complete(await collect(env.backend, "r1"), "r1", 6)
            assert env["d0"].called("Generate") == ["r1"]  # local prefill while P is down
            await env["p0"].start(port)  # restarted at the same address
            await until(lambda: env.healthy("p0"))
            check_complete(await collect(env.backend, "r2"), "r2", 6)
            assert env["p0"].called("Prefill") == ["r2"]
            # a worker that reports unhealthy is avoided, and used again once it recovers
            env["p0"].script.healthy = False
            await until(lambda: not env.healthy("p0"))
            await collect(env.backend, "r3")
            env["p0"].script.healthy = True
            await until(lambda: env.healthy("p0"))
            await collect(env.backend, "r4")
            assert env["p0"].called("Prefill") == ["r2", "r4"]
    run(main)


def test_address_change_reconnects():
    async def main():
        async with cluster(("p0", "prefill"), ("d0", "decode")) as env:
            old = env["d0"]
            await old.stop()
            moved = await FakeWorker("d0", "decode", old.cluster).start()
            env.workers["d0"] = moved
            env.directory.update(moved.endpoint)
            await until(lambda: env.backend.pool.workers["d0"].endpoint.address == moved.address and env.healthy("d0"))
            check_complete(await collect(env.backend, "r1"), "r1", 6)
            assert moved.called("Decode") == ["r1"]
    run(main)


# ---------------------------------------------------------------- peers that must not pair


def test_workers_that_must_not_pair_get_a_clear_503_at_once():
    async def main():
        a, b = Script(kv_compat="model=m block_size=16 wire=v2"), Script(kv_compat="model=m block_size=32 wire=v2")
        async with cluster(("p0", "prefill", a), ("d0", "decode", b), worker_wait_s=10.0) as env:
            await until(lambda: env.backend.snapshot().worker("d0").kv_compat != "")
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="prefill p0 has model=m block_size=16.*decode d0 has "
                                                         "model=m block_size=32") as info:
                await collect(env.backend, "mismatch")
            assert time.monotonic() - started < 2.0  # no wait for a worker: none would help
            assert "Retry-After" in info.value.headers
            assert env["p0"].calls == [] and env["d0"].calls == []

    run(main)


def test_corrupt_kv_falls_back_to_prefill_on_the_decode_worker():
    async def main():
        async with cluster(("p0", "prefill", Script(prefill_error=grpc.StatusCode.DATA_LOSS)), ("d0", "decode")) as env:
            outputs = await collect(env.backend, "corrupt", max_tokens=5)
            check_complete(outputs, "corrupt", 5)
            assert env.metric("pdserve:request_recoveries_total", kind="local_fallback") == 1
            assert env.healthy("p0") and env.healthy("d0")  # nobody is blamed

    run(main)
