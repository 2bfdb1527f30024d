"""The two-H200 fidelity script's link fit and serving calibration, on hand-made points."""

from __future__ import annotations

import pytest

from experiments.sim_fidelity_two_gpu import PROFILE, fit_link, served_calibration
from pdserve.router.placement.profiles import load_profile

BENCH = (71.1, 2.85)


def test_a_line_with_a_positive_latency_is_kept():
    # 1e8 B in 12 ms, 3e8 B in 32 ms: 1e8 B per 10 ms = 10 GB/s, latency 2 ms
    gbytes_s, latency_ms, how = fit_link([(1e8, 0.012), (3e8, 0.032)], fallback=BENCH)
    assert (gbytes_s, latency_ms, how) == (pytest.approx(10.0), pytest.approx(2.0), "fitted")


def test_a_negative_latency_is_clamped_never_returned():
    # 67 MB in 13 ms, 264 MB in 67 ms: the line's latency is negative (-5.4 ms); through the
    # origin, least squares: slope = sum(b t) / sum(b^2)
    points = [(67.1e6, 0.013), (264.2e6, 0.067)]
    gbytes_s, latency_ms, how = fit_link(points, fallback=BENCH)
    slope = sum(b * t for b, t in points) / sum(b * b for b, _ in points)
    assert latency_ms == 0.0 and how.startswith("clamped")
    assert gbytes_s == pytest.approx(1 / slope / 1e9)


def test_no_usable_point_falls_back_to_the_benchmark():
    assert fit_link([], fallback=BENCH) == (71.1, 2.85, "fallback: benchmark")


def _record(sent, ttft, e2e, prompt, tokens, prefill, queue=0.002, tail=0.010):
    return {"status": 200, "sent_s": sent, "ttft_s": ttft, "e2e_s": e2e, "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "server_timing": {"placement": "disaggregated", "prefill": prefill, "queue": queue, "kv_tail": tail}}


def test_served_calibration_by_hand():
    # two requests that never overlap, 2048 tokens each: served prefill = 1.2 x P(2048); TTFT =
    # 0.030 + queue + prefill + tail: front 30 ms; each decodes alone at exactly twice the
    # profile's step for one request at its mean context (2048 + 50): decode factor 2.0
    profile = load_profile(str(PROFILE))
    p = profile.prefill_seconds(2048)
    step = profile.decode_step_seconds(1, 2048 + 50)
    records = []
    for sent in (0.0, 10.0):
        ttft = 0.030 + 0.002 + 1.2 * p + 0.010
        records.append(_record(sent, ttft, ttft + 99 * 2 * step, 2048, 100, 1.2 * p))
    cal = served_calibration(records)
    assert cal["prefill_factor"] == pytest.approx(1.2)
    assert cal["front_s"] == pytest.approx(0.030)
    assert cal["tail_ms"] == pytest.approx(10.0)
    assert cal["decode_factor"] == pytest.approx(2.0)
    assert cal["num_requests"] == 2
