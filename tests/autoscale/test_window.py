"""The request window: attainment from each request's TTFT/TPOT against the SLOs, failures as
misses, client aborts not counted; the arrival rate; and `ObservedBackend` recording a backend's
requests as the HTTP app sees them."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.launcher.autoscale.window import ObservedBackend, RequestWindow
from pdserve.sampling_params import RequestOutput


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_attainment_counts_both_slos_and_failures():
    clock = Clock()
    w = RequestWindow(slo_ttft=1.0, slo_tpot=0.1, clock=clock)
    for ttft, tpot in ((0.5, 0.05), (2.0, 0.05), (0.5, 0.2), (0.9, None)):
        w.finish(ttft, tpot)
    w.finish(None, None, failed=True)
    a = w.attainment(0.0)
    assert (a.finished, a.attainment, a.ttft, a.tpot) == (5, 2 / 5, 3 / 5, 3 / 5)
    clock.t += 10
    w.finish(0.1, 0.01)
    assert w.attainment(clock.t).finished == 1 and w.attainment(clock.t).attainment == 1.0
    assert RequestWindow(None, None, clock=clock).attainment(0).attainment == 1.0  # nothing yet


def test_arrival_rate_and_horizon():
    clock = Clock()
    w = RequestWindow(1.0, None, horizon_s=60, clock=clock)
    for _ in range(30):
        w.arrive()
        clock.t += 1.0
    assert w.arrival_rate(clock.t - 10) == pytest.approx(1.0)
    clock.t += 100  # all beyond the horizon
    w.arrive()
    assert len(w.arrivals) == 1


class FakeBackend:
    model_name = "m"

    def __init__(self, clock: Clock, fail_after: int | None = None, finish_reason: str = "length") -> None:
        self.clock, self.fail_after, self.finish_reason = clock, fail_after, finish_reason

    async def generate(self, request_id, prompt, params):
        for i in range(4):
            self.clock.t += 0.5 if i == 0 else 0.1
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError("no worker")
            yield RequestOutput(request_id=request_id, new_token_ids=[i], new_text="x", finished=i == 3,
                                finish_reason=self.finish_reason if i == 3 else None, num_prompt_tokens=1,
                                num_output_tokens=i + 1)


def run(backend, window) -> list:
    async def go():
        return [o async for o in ObservedBackend(backend, window).generate("r", [1], None)]

    return asyncio.run(go())


def test_observed_backend_records_ttft_tpot_and_failures():
    clock = Clock()
    window = RequestWindow(slo_ttft=0.6, slo_tpot=0.11, clock=clock)
    outputs = run(FakeBackend(clock), window)
    assert len(outputs) == 4 and ObservedBackend(FakeBackend(clock), window).model_name == "m"
    (f,) = window.finished
    assert f.ttft_s == pytest.approx(0.5) and f.tpot_s == pytest.approx(0.1) and not f.failed
    with pytest.raises(RuntimeError):
        run(FakeBackend(clock, fail_after=2), window)
    assert window.finished[-1].failed and window.failures == 1
    run(FakeBackend(clock, finish_reason="abort"), window)  # the client went away: not counted
    assert len(window.finished) == 2 and len(window.arrivals) == 3
    assert window.attainment(0).attainment == pytest.approx(0.5) and not window.live


def test_running_requests_count_once_they_have_missed():
    clock = Clock()
    w = RequestWindow(slo_ttft=1.0, slo_tpot=0.1, clock=clock)
    from pdserve.launcher.autoscale.window import Live

    w.live[1] = Live(arrived=clock.t)  # no first token yet
    w.live[2] = Live(arrived=clock.t, first=clock.t + 0.2, last=clock.t + 1.0, tokens=5)  # 0.2 s per token
    w.live[3] = Live(arrived=clock.t, first=clock.t + 0.2, last=clock.t + 0.4, tokens=5)  # on time
    clock.t += 0.5
    a = w.attainment(0)
    assert (a.finished, a.attainment, a.tpot) == (1, 0.0, 0.0)  # only the slow decode so far
    clock.t += 1.0  # request 1 is now past the TTFT SLO without a first token
    a = w.attainment(0)
    assert (a.finished, a.attainment, a.ttft, a.tpot) == (2, 0.0, 0.5, 0.5)
    assert w.attainment(clock.t).finished == 0  # arrived before `since`: not counted
