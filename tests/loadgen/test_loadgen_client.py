import asyncio
import json

import httpx
import pytest

from pdserve.loadgen.client import ClientConfig, StreamingClient, list_models
from pdserve.loadgen.datasets import DatasetConfig, LengthDist, RequestSpec
from pdserve.loadgen.errors import ServerUnreachable
from pdserve.loadgen.records import RequestRecord, read_jsonl
from pdserve.loadgen.runner import LoadConfig, run_load, write_run_outputs

TTFT, ITL, N = 0.2, 0.02, 10


def load(url, endpoint="chat", **kw):
    client = ClientConfig(base_url=url, endpoint=endpoint, request_timeout_s=kw.pop("timeout", 10))
    args = dict(rate=50.0, arrival="constant", num_requests=4,
                dataset=DatasetConfig(input=LengthDist("fixed", value=13), output=LengthDist("fixed", value=N)))
    args.update(kw)
    return LoadConfig(client=client, **args)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streaming_times_and_counts(fake_server, endpoint):
    url = fake_server(ttft_s=TTFT, itl_s=ITL)
    result = run_load(load(url, endpoint), progress=False)
    assert len(result.records) == 4 and result.model == "fake-model"
    for r in result.records:
        assert r.ok, r.error
        assert TTFT <= r.ttft_s < TTFT + 0.15
        assert len(r.token_times_s) == N
        gaps = [b - a for a, b in zip(r.token_times_s, r.token_times_s[1:])]
        assert sum(gaps) / len(gaps) == pytest.approx(ITL, abs=0.015)
        assert r.e2e_s >= r.token_times_s[-1]
        assert (r.completion_tokens, r.prompt_tokens, r.token_count_source) == (N, 10, "usage")
        assert r.kv_bytes == 10 * 1000 and r.kv_seconds == pytest.approx(TTFT)
        assert r.server_request_id.startswith("chatcmpl-" if endpoint == "chat" else "cmpl-")
    s = result.summary
    assert s["num_ok"] == 4 and s["ttft_p50"] == pytest.approx(TTFT, abs=0.1)
    assert s["tpot_mean"] == pytest.approx(ITL, abs=0.015)
    assert s["kv_transfer_bytes"] == 4 * 10 * 1000 and s["kv_transfer_count"] == 4
    assert s["kv_transfer_gbps"] == pytest.approx(4e4 * 8 / (4 * TTFT) / 1e9)


def test_concurrency_bound_serializes(fake_server):
    url = fake_server(ttft_s=0.05, itl_s=0.0)
    result = run_load(load(url, num_requests=4, rate=float("inf"), concurrency=1), progress=False)
    sent = sorted(r.sent_s for r in result.records)
    assert all(b - a >= 0.045 for a, b in zip(sent, sent[1:]))
    assert all(r.ok for r in result.records)


def test_server_error_status_recorded(fake_server):
    url = fake_server(fail_status=503)
    result = run_load(load(url, num_requests=2), progress=False)
    for r in result.records:
        assert r.status == 503 and not r.ok
        assert r.error == "HTTP 503: injected failure"
    assert result.summary["num_errors"] == 2


def test_unreachable_server_is_one_clear_error(closed_port):
    url = f"http://127.0.0.1:{closed_port}"
    with pytest.raises(ServerUnreachable) as info:
        run_load(load(url), progress=False)
    assert str(info.value) == f"cannot reach {url}: connection refused"


def test_request_timeout_and_run_time_bound(fake_server):
    url = fake_server(ttft_s=0.0, itl_s=0.5)
    timed = run_load(load(url, num_requests=2, timeout=0.3), progress=False)
    assert all(r.error == "timeout after 0.3s" for r in timed.records)
    assert all(len(r.token_times_s) >= 1 for r in timed.records)
    bounded = run_load(load(url, num_requests=50, rate=20.0, max_run_time_s=0.4), progress=False)
    assert 1 <= len(bounded.records) <= 10
    assert all(r.error == "cancelled" for r in bounded.records)


def test_outputs(fake_server, tmp_path):
    url = fake_server(ttft_s=0.01, itl_s=0.001)
    result = run_load(load(url), progress=False)
    write_run_outputs(tmp_path, result, {"rate": 50.0})
    back = read_jsonl(tmp_path / "records.jsonl")
    assert [r.index for r in back] == [0, 1, 2, 3] and back[0].token_times_s == result.records[0].token_times_s
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rate"] == 50.0 and summary["num_ok"] == 4
    assert (tmp_path / "summary.csv").read_text().startswith("rate,model,interrupted,num_requests")


def test_chunk_count_fallback_without_usage():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
        chunks = [{"id": "x", "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b", "c")]
        chunks.append({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def go():
        cfg = ClientConfig(base_url="http://test", endpoint="completions", ignore_eos=True)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            client = StreamingClient(cfg, http, "m")
            record = RequestRecord(index=0, request_id="r0", scheduled_s=0.0)
            await client.fill(record, RequestSpec("hello", 1, 3), t0=0.0)
            return record

    record = asyncio.run(go())
    assert record.ok and record.completion_tokens == 3 and record.token_count_source == "chunks"
    assert record.prompt_tokens is None and len(record.token_times_s) == 3


def test_list_models(fake_server):
    url = fake_server()

    async def go():
        async with httpx.AsyncClient() as http:
            return await list_models(http, ClientConfig(base_url=url + "/v1/"))

    assert asyncio.run(go()) == ["fake-model"]
