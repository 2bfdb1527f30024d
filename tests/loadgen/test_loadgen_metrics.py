import math

import pytest

from pdserve.loadgen.metrics import (SLO, distribution, itls, max_rate_meeting_slo, meets_slo, slo_attainment,
                                     summarize, tpot)
from pdserve.loadgen.records import RequestRecord


def rec(index, ttft, e2e, n, sent=0.0, status=200, error=None, token_times=None):
    times = token_times if token_times is not None else (
        [ttft + i * (e2e - ttft) / max(n - 1, 1) for i in range(n)] if ttft is not None else [])
    return RequestRecord(index=index, request_id=f"r{index}", scheduled_s=sent, sent_s=sent, ttft_s=ttft,
                         e2e_s=e2e, token_times_s=times, completion_tokens=n, prompt_tokens=10,
                         status=status, error=error)


def test_tpot_formula_and_single_token():
    assert tpot(rec(0, 0.5, 2.5, 5)) == pytest.approx((2.5 - 0.5) / 4)
    assert tpot(rec(1, 0.5, 0.5, 1)) is None
    assert tpot(rec(2, None, None, 0, status=500, error="HTTP 500")) is None


def test_itls_are_gaps_between_chunks():
    r = rec(0, 0.1, 0.6, 3, token_times=[0.1, 0.3, 0.6])
    assert itls(r) == pytest.approx([0.2, 0.3])


def test_exact_percentiles():
    d = distribution([float(v) for v in range(1, 101)], "x")
    assert d["x_mean"] == 50.5
    assert d["x_p50"] == pytest.approx(50.5)
    assert d["x_p90"] == pytest.approx(90.1)
    assert d["x_p99"] == pytest.approx(99.01)
    assert distribution([1.0, 2.0, 3.0, 4.0], "y")["y_p50"] == 2.5
    assert distribution([], "z") == {"z_mean": None, "z_p50": None, "z_p90": None, "z_p99": None}


def test_summary_attainment_and_goodput():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        rec(0, 0.5, 1.4, 10),             # tpot 0.1 -> meets (boundary)
        rec(1, 0.9, 1.8, 10),             # tpot 0.1 -> meets
        rec(2, 1.5, 2.4, 10),             # ttft too high
        rec(3, 0.2, 3.2, 11),             # tpot 0.3 too high
        rec(4, 0.3, 0.3, 1),              # one token: judged on TTFT only -> meets
        rec(5, None, None, 0, status=503, error="HTTP 503: busy"),  # failed -> miss
    ]
    assert [meets_slo(r, slo) for r in records] == [True, True, False, False, True, False]
    assert slo_attainment(records, slo) == pytest.approx(3 / 6)
    s = summarize(records, duration_s=2.0, slo=slo)
    assert s["num_requests"] == 6 and s["num_ok"] == 5 and s["num_errors"] == 1
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["goodput"] == pytest.approx(1.5)
    assert s["request_throughput"] == pytest.approx(2.5)
    assert s["output_token_throughput"] == pytest.approx((10 + 10 + 10 + 11 + 1) / 2.0)
    assert s["ttft_p50"] == pytest.approx(0.5)
    assert s["tpot_mean"] == pytest.approx((0.1 + 0.1 + 0.1 + 0.3) / 4)


def test_summary_duration_from_records():
    records = [rec(0, 0.1, 1.0, 2, sent=0.5), rec(1, 0.1, 2.0, 2, sent=1.0)]
    assert summarize(records)["duration_s"] == pytest.approx(3.0 - 0.5)


def test_slo_rejects_bad_values():
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(0, 0.1)


def test_max_rate_search_finds_the_knee():
    knee = 7.3
    calls = []

    def run(rate):  # attainment falls off a cliff above the knee
        calls.append(rate)
        return 0.99 if rate <= knee else 0.5

    result = max_rate_meeting_slo(run, SLO(1, 1), target=0.9, lo=1, hi=32, max_probes=12, rel_tol=0.01)
    assert result.rate <= knee
    assert result.rate == pytest.approx(knee, rel=0.02)
    assert len(calls) <= 12
    assert [p[0] for p in result.probes] == calls


def test_max_rate_search_smooth_function_and_bounds():
    # attainment = 1 - rate/20: meets 0.9 up to rate 2.0
    result = max_rate_meeting_slo(lambda r: {"slo_attainment": 1 - r / 20}, SLO(1, 1), lo=0.5, hi=16,
                                  max_probes=10, rel_tol=0.01)
    assert result.rate == pytest.approx(2.0, rel=0.02)
    assert max_rate_meeting_slo(lambda r: 1.0, SLO(1, 1), lo=1, hi=8).rate == 8
    none = max_rate_meeting_slo(lambda r: 0.0, SLO(1, 1), lo=1, hi=8)
    assert none.rate is None and len(none.probes) == 1


def test_max_rate_search_takes_records():
    slo = SLO(ttft_s=1.0, tpot_s=1.0)

    def run(rate):
        return [rec(i, 0.5 if rate < 4 else 2.0, 1.0, 2) for i in range(10)]

    result = max_rate_meeting_slo(run, slo, lo=1, hi=16, max_probes=8)
    assert 3 <= result.rate < 4
    assert len(result.probes) <= 8
    assert not math.isnan(result.rate)
