"""The server's per-request timing (usage.pdserve_timing) in records and summaries."""

import asyncio
import json

import httpx
import pytest

from pdserve.loadgen.client import ClientConfig, StreamingClient
from pdserve.loadgen.datasets import RequestSpec
from pdserve.loadgen.metrics import server_breakdown, summarize
from pdserve.loadgen.records import RequestRecord

TIMING = {"index": 0, "placement": "disaggregated", "prefill_worker": "p0", "decode_worker": "d1", "queue": 0.01,
          "prefill": 0.05, "kv": 0.4, "kv_wire": 0.3, "kv_wait": 0.05, "kv_tail": 0.35, "first_decode": 0.02,
          "kv_gbps": 1.2}


def _serve(usage_extra, seen=None):
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        chunks = [{"id": "x", "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b")]
        chunks.append({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        chunks.append({"id": "x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                           "total_tokens": 6} | usage_extra})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def go():
        cfg = ClientConfig(base_url="http://test", endpoint="completions")
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            record = RequestRecord(index=0, request_id="r0", scheduled_s=0.0)
            await StreamingClient(cfg, http, "m").fill(record, RequestSpec("hello", 1, 2), t0=0.0)
            return record

    return asyncio.run(go())


def test_requests_ask_for_the_timing_in_a_header():
    """A header, not a body field: a server that does not know it ignores it (a body field
    could be refused as unknown)."""
    seen = []
    _serve({}, seen)
    assert seen[0].headers["x-pdserve-timing"] == "1"
    assert "pdserve_timing" not in json.loads(seen[0].content)


def test_record_takes_choice_zero_timing():
    record = _serve({"pdserve_timing": [TIMING | {"index": 1, "kv": 9.0}, TIMING]})
    assert record.ok and record.server_timing == {k: v for k, v in TIMING.items() if k != "index"}
    back = RequestRecord.from_dict(json.loads(record.to_json()))
    assert back.server_timing == record.server_timing


@pytest.mark.parametrize("extra", [{}, {"pdserve_timing": "garbage"}, {"pdserve_timing": [3]}])
def test_servers_without_timing_leave_it_missing(extra):
    record = _serve(extra)
    assert record.ok and record.server_timing is None
    assert server_breakdown([record]) == {}


def test_breakdown_percentiles():
    records = []
    for i, kv in enumerate((0.1, 0.2, 0.6)):
        records.append(RequestRecord(index=i, request_id=f"r{i}", scheduled_s=0, sent_s=0, ttft_s=0.5, e2e_s=1.0,
                                     token_times_s=[0.5, 1.0], status=200,
                                     server_timing={k: v for k, v in TIMING.items() if k != "index"} | {"kv": kv}))
    records[2].server_timing = {"placement": "local", "decode_worker": "d0", "first_decode": None}
    out = server_breakdown(records)
    assert out["srv_timed"] == 3 and out["srv_local"] == 1
    assert out["srv_kv_p50"] == pytest.approx(0.15) and out["srv_kv_mean"] == pytest.approx(0.15)
    assert out["srv_queue_p50"] == pytest.approx(0.01) and out["srv_reserve_p50"] is None
    assert summarize(records)["srv_kv_gbps_p50"] == pytest.approx(1.2)
