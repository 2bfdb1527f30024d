"""A worker's per-request stream hands its consumer everything that arrived since the last
read as one delta (RequestOutput.merge): fewer gRPC messages when the consumer falls behind."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.sampling_params import RequestOutput, TokenLogprob
from pdserve.worker.servicer import _Stream


def out(token: int, finished: bool = False, **kw) -> RequestOutput:
    return RequestOutput("r", [token], f"<{token}>", finished, "length" if finished else None, 5, token, **kw)


def test_merge_keeps_order_and_takes_the_last_counters():
    a = out(1, first_token_times=(1.0, 2.0), logprobs=[TokenLogprob(1, -0.5)])
    b = out(2)
    c = out(3, finished=True, logprobs=[TokenLogprob(3, -0.1)])
    m = RequestOutput.merge([a, b, c])
    assert (m.new_token_ids, m.new_text) == ([1, 2, 3], "<1><2><3>")
    assert (m.finished, m.finish_reason, m.num_output_tokens) == (True, "length", 3)
    assert m.first_token_times == (1.0, 2.0)
    assert [lp.token_id for lp in m.logprobs] == [1, 3]
    assert RequestOutput.merge([b]) is b
    assert RequestOutput.merge([b, out(4)]).logprobs is None


def test_a_lagging_reader_gets_one_delta_and_an_error_after_the_outputs_before_it():
    async def main():
        stream = _Stream(asyncio.get_running_loop())
        for t in (1, 2, 3):
            stream.put_nowait(out(t))
        first = await stream.next()
        assert first.new_token_ids == [1, 2, 3]
        stream.put_nowait(out(4))
        stream.put_nowait(RuntimeError("worker is shutting down"))
        assert (await stream.next()).new_token_ids == [4]
        with pytest.raises(RuntimeError, match="shutting down"):
            await stream.next()
        # nothing is merged past a finished delta; a waiting reader wakes on the next output
        stream.put_nowait(out(5, finished=True))
        stream.put_nowait(out(6))
        assert (await stream.next()).new_token_ids == [5]
        assert (await stream.next()).new_token_ids == [6]
        reader = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0)
        assert not reader.done()
        stream(out(7))  # from another thread's side: call_soon_threadsafe
        assert (await asyncio.wait_for(reader, 2)).new_token_ids == [7]

    asyncio.run(main())


def test_a_reader_that_stops_reading_holds_a_bounded_number_of_items():
    # a slow client holds the gRPC stream back: one output per engine step must not pile up
    async def main():
        stream = _Stream(asyncio.get_running_loop())
        most = 0
        for t in range(1000):
            stream.put_nowait(out(t))
            most = max(most, len(stream))
        assert most == _Stream.MERGE_AT
        stream.put_nowait(out(1000, finished=True))
        tokens, delta = [], None
        while not tokens or not delta.finished:
            delta = await stream.next()
            tokens.extend(delta.new_token_ids)
        assert tokens == list(range(1001))  # all of them, in order
        assert delta.num_output_tokens == 1000 and delta.finish_reason == "length"

    asyncio.run(main())
