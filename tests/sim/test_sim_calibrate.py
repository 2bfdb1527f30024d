"""pdserve.sim.calibrate: a run's host speed from the decode steps of its isolated requests (hand-checked)."""

from __future__ import annotations

import pytest

from pdserve.sim.calibrate import host_factor, isolated_gaps
from tests.router.network_fixtures import PROFILE  # a decode step of one request: 0.01 s at any context


def rec(sent, times, prompt=10, status=200):
    return {"sent_s": sent, "token_times_s": times, "prompt_tokens": prompt, "status": status}


RECORDS = [
    rec(0.0, [1.0, 1.5, 2.25]),           # decodes 1.0-2.25, overlapped by the next: not isolated
    rec(0.0, [2.0, 3.0]),                 # 2.0-3.0
    rec(5.0, [0.0, 0.5, 1.0], prompt=7),  # 5.0-6.0 alone: gaps 0.5 (context 8), 0.5 (9)
    rec(5.5, [0.75], prompt=7),           # one token: no decode span, overlaps nothing
    rec(5.2, [0.1, 0.3], status=500),     # failed: ignored
    rec(10.0, [0.0, 0.25], prompt=3),     # alone: 0.25 (context 4)
]


def test_isolated_gaps_are_those_of_requests_that_decoded_alone():
    assert isolated_gaps(RECORDS) == [(0.5, 8), (0.5, 9), (0.25, 4)]


def test_host_factor_is_the_mean_isolated_step_over_the_profiles():
    factor, n = host_factor(PROFILE, RECORDS, min_gaps=3)
    assert n == 3 and factor == pytest.approx((0.5 + 0.5 + 0.25) / 3 / 0.01)
    with pytest.raises(ValueError, match="only 3 isolated decode gaps"):
        host_factor(PROFILE, RECORDS, min_gaps=4)
