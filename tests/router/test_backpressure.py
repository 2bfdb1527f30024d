"""A client that disconnects mid-stream and one that reads slowly (issue 30, item 9).

A disconnect aborts the request on the workers and frees its KV blocks. A slow reader holds
the pipeline back instead of filling buffers: the router's FanOut keeps at most QUEUE_PER_JOB
deltas per choice (its pump waits, so the gRPC stream is read only as fast as the client takes
it), and the worker's per-request stream merges what waits (its items are bounded by
_Stream.MERGE_AT, its tokens by max_tokens).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.worker import servicer as worker_servicer
from pdserve.router.http import fanout as fanout_module
from pdserve.router.http.fanout import QUEUE_PER_JOB, FanOut, Job
from tests.router.conftest import wait_until
from tests.router.test_kv_burst import MODEL, assert_all_free, body, router, workers  # noqa: F401 (fixture)


class EndlessBackend:
    """Yields deltas as fast as it is asked for them, counting how many it produced."""

    def __init__(self) -> None:
        self.produced = 0
        self.aborted: list[str] = []

    async def generate(self, request_id: str, prompt: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        while True:
            self.produced += 1
            yield RequestOutput(request_id, [7], "x", False, None, len(prompt), self.produced)
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_the_fanout_holds_a_bounded_number_of_deltas_for_a_slow_reader():
    async def main():
        backend = EndlessBackend()
        jobs = [Job(i, f"r-{i}", [1, 2], SamplingParams(max_tokens=10_000)) for i in range(2)]
        fan = FanOut(backend, jobs)  # type: ignore[arg-type]
        fan.start()
        taken = 0
        for _ in range(5):  # a client taking one chunk at a time, slowly
            await asyncio.sleep(0.05)
            assert fan.num_buffered <= QUEUE_PER_JOB * len(jobs)
            await fan.next()
            taken += 1
        # the pumps wait for the reader: what was produced is what was taken plus the queue
        # (and one delta per pump held at its put)
        assert backend.produced <= taken + QUEUE_PER_JOB * len(jobs) + len(jobs)
        await fan.close()
        assert sorted(backend.aborted) == ["r-0", "r-1"]

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_client_that_disconnects_mid_stream_aborts_and_frees_the_blocks(workers, mode):  # noqa: F811
    with router(workers, mode) as (url, backend, _):
        request = {**body(0), "max_tokens": 70, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=10) as client:
            with client.stream("POST", url + "/v1/chat/completions", json=request) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # the stream runs; the client leaves
        assert wait_until(lambda: not backend._flights, timeout_s=5)
        assert backend.num_queued == 0
    assert_all_free(workers)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_slow_reader_gets_every_token_and_the_buffers_stay_bounded(workers, mode, monkeypatch):  # noqa: F811
    most = {"worker": 0, "router": 0}
    put_nowait, next_delta = worker_servicer._Stream.put_nowait, fanout_module.FanOut.next

    def counting_put(self, item):
        put_nowait(self, item)
        most["worker"] = max(most["worker"], len(self))

    async def counting_next(self):
        most["router"] = max(most["router"], self.num_buffered)
        return await next_delta(self)

    for server in workers.values():  # steps of a real model's pace, so the reader sees many chunks
        step = server.engine.step
        monkeypatch.setattr(server.engine, "step", lambda step=step: (time.sleep(0.005), step())[1])
    monkeypatch.setattr(worker_servicer._Stream, "put_nowait", counting_put)
    monkeypatch.setattr(fanout_module.FanOut, "next", counting_next)
    # logprobs: a tiny random model's tokens decode to no text, a chunk per delta carries them
    request = {**body(1), "max_tokens": 70, "ignore_eos": True, "logprobs": True}
    with router(workers, mode) as (url, _, _):
        whole = httpx.post(url + "/v1/chat/completions", json=request, timeout=30).json()
        expected = [c["token"] for c in whole["choices"][0]["logprobs"]["content"]]
        tokens, chunks, t0 = [], 0, time.monotonic()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**request, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                time.sleep(0.05)  # the engine makes tokens faster than this client reads them
                for choice in httpx.Response(200, content=line[len("data: "):]).json()["choices"]:
                    tokens += [c["token"] for c in (choice.get("logprobs") or {}).get("content") or ()]
    logging.getLogger(__name__).info("%s: %d chunks read slowly; most deltas held: router %d, worker %d",
                                     mode, chunks, most["router"], most["worker"])
    assert tokens == expected and len(tokens) == 70
    assert most["router"] <= QUEUE_PER_JOB
    assert most["worker"] <= worker_servicer._Stream.MERGE_AT
    assert chunks >= 5 and time.monotonic() - t0 < 30
    assert_all_free(workers)
