"""The hybrid cluster's split model (router.placement.policies.split) and network-aware placement on
mixed workers that move KV, with hand-checked numbers."""

from __future__ import annotations

import math

import pytest

from pdserve.router.placement.registry import make_policy
from pdserve.router.placement.policies.calibration import Factors
from pdserve.router.placement.policies.split import ArrivalWindow, Load, SplitChooser, decode_tpot, predict, slo_rate
from pdserve.router.placement.profiles import Profile
from tests.router.network_fixtures import PROFILE, req, snapshot, topology, w

# prefill 0.1 ms per token; a decode step 10 ms at any batch and context
FLAT = Profile(
    hardware="test GPU", device="cuda", model="random:llama-3.1-8b", dtype="bfloat16", num_layers=32,
    kv_bytes_per_token=128 * 1024, block_size=16, max_num_batched_tokens=512,
    prefill_tokens=(16, 4096), prefill_times=(0.0016, 0.4096),
    decode_batch_sizes=(1, 64), decode_contexts=(128, 8192), decode_times=((0.01, 0.01), (0.01, 0.01)),
)


def test_decode_tpot_fixed_point():
    # duty 0.5 halves the decode time: t = 0.01 / 0.5; Little: 2 req/s x 100 tokens x 0.02 s = 4
    assert decode_tpot(FLAT, 2.0, 100, 500, 0.5, 64) == pytest.approx((0.02, 4.0))
    # 100 req/s x 100 tokens x 0.01 s = 100 decoding > the batch limit of 64
    assert decode_tpot(FLAT, 100.0, 100, 500, 0.0, 64) == (math.inf, math.inf)
    assert decode_tpot(FLAT, 1.0, 100, 500, 1.0, 64) == (math.inf, math.inf)
    # PROFILE: step = 0.01 + 0.04 (B - 1) / 63; B = 1000 t at 1 req/s of 1000 tokens
    t, batch = decode_tpot(PROFILE, 1.0, 1000, 600, 0.0, 64)
    assert batch == pytest.approx(1000 * t)
    assert t == pytest.approx(0.01 + 0.04 * (math.ceil(batch) - 1) / 63, rel=1e-6)


def test_predict_by_hand():
    load = Load(rate=4.0, prompt_tokens=1000, output_tokens=100)
    local = predict(FLAT, load, 2, 0, kv_seconds=0.032, slo_ttft=1.0, slo_tpot=0.011, max_batch=64)
    # 2 req/s a worker, 0.1 s of prefill each: duty 0.2, TPOT 0.01 / 0.8; service 0.1 + 2 chunks x 0.01
    assert local.tpot_s == pytest.approx(0.0125)
    rho = 2 * 0.12
    assert local.ttft_s == pytest.approx(rho * 0.12 / (2 * (1 - rho)) + 0.12)
    split = predict(FLAT, load, 2, 1, kv_seconds=0.032, slo_ttft=1.0, slo_tpot=0.011, max_batch=64)
    # one prefill worker at 4 req/s (rho 0.4), the KV's last layer exposed (0.001 s) at link load 0.128
    exposed = (0.032 - 31 / 32 * 0.032) / (1 - 4 * 0.032)
    assert split.tpot_s == pytest.approx(0.01)
    assert split.ttft_s == pytest.approx(0.4 * 0.1 / (2 * 0.6) + 0.1 + exposed + 0.01)
    assert split.score == pytest.approx(0.01 / 0.011) and local.score == pytest.approx(0.0125 / 0.011)
    # a link too slow for the arrivals: the split cannot keep up
    assert not predict(FLAT, load, 2, 1, kv_seconds=0.3, slo_ttft=1.0, slo_tpot=0.011, max_batch=64).feasible
    with pytest.raises(ValueError, match="prefill_workers"):
        predict(FLAT, load, 2, 2, kv_seconds=0.0, slo_ttft=None, slo_tpot=None, max_batch=64)


def test_decode_heavy_load_stays_local():
    load = Load(rate=1.0, prompt_tokens=100, output_tokens=1000)
    local = predict(PROFILE, load, 2, 0, kv_seconds=0.003, slo_ttft=1.0, slo_tpot=0.02, max_batch=64)
    split = predict(PROFILE, load, 2, 1, kv_seconds=0.003, slo_ttft=1.0, slo_tpot=0.02, max_batch=64)
    assert local.tpot_s < 0.02 < split.tpot_s  # one decode GPU carries twice the batch


def test_arrival_window_rate_and_means():
    win = ArrivalWindow(tau_s=10.0, min_samples=8)
    for i in range(7):
        win.observe(i * 0.25, 1000, 100)
    assert win.estimate(1.75) is None  # too few to model
    for i in range(7, 400):
        win.observe(i * 0.25, 1000 if i % 2 else 3000, 100)
    est = win.estimate(400 * 0.25)
    assert est.rate == pytest.approx(4.0, rel=0.05)
    assert est.prompt_tokens == pytest.approx(2000, rel=0.05) and est.output_tokens == pytest.approx(100)


def test_arrival_window_sees_a_rise_fast_and_a_fall_slowly():
    # 6 req/s for 30 s, then 9 req/s: after 2 s of the step the estimate is past 8 req/s (the
    # 10 s window alone: 6 + 3 * (1 - e^-0.2) = 6.54); then a lull to 3 req/s: the slow window
    # holds the estimate near the earlier rate for a while
    win, slow = ArrivalWindow(tau_s=10.0, min_samples=8), ArrivalWindow(tau_s=10.0, min_samples=8, fast_tau_s=None)
    t = 0.0
    for rate, seconds in ((6.0, 30.0), (9.0, 2.0)):
        for _ in range(int(rate * seconds)):
            t += 1.0 / rate
            win.observe(t, 1000, 100)
            slow.observe(t, 1000, 100)
    assert win.estimate(t).rate > 8.0 and slow.estimate(t).rate < 7.0
    for _ in range(6):  # 2 s at 3 req/s
        t += 1.0 / 3.0
        win.observe(t, 1000, 100)
    assert win.estimate(t).rate > 5.5  # the slow window (the fast one alone: 5.06): the fall is not believed yet
    with pytest.raises(ValueError, match="fast_tau_s"):
        ArrivalWindow(tau_s=2.0, fast_tau_s=5.0)
    with pytest.raises(ValueError, match="fast_tau_s"):
        ArrivalWindow(fast_tau_s=0.0)


def test_chooser_hysteresis():
    chooser = SplitChooser(switch_margin=0.5, min_samples=1)
    chooser.window.observe(0.0, 1000, 100)
    chooser.window.observe(0.25, 1000, 100)
    # both meet a 20 ms TPOT SLO at the whole rate (SLO rates equal): split scores 0.5 against
    # local's 0.625, better but not by the margin of 50%
    k, why = chooser.choose(FLAT, 0.25, 2, kv_seconds=lambda p: 0.032, slo_ttft=1.0, slo_tpot=0.02)
    assert k == 0 and why.startswith("local")
    rate = chooser.window.estimate(0.25).rate  # ~8 req/s: two arrivals 0.25 s apart
    assert chooser.last_slo_rates[0] == chooser.last_slo_rates[1] == pytest.approx(rate)
    # at 11 ms local meets the SLOs only up to 1.82 req/s (TPOT 0.01 / (1 - lam / 2 x 0.1) <= 0.011)
    # and the split at all ~8: 4.4x the goodput, past the margin
    k, why = chooser.choose(FLAT, 0.25, 2, kv_seconds=lambda p: 0.032, slo_ttft=1.0, slo_tpot=0.011)
    assert k == 1 and chooser.last_slo_rates[0] == pytest.approx(1.0 / 0.55, rel=1e-4)
    assert f"within SLOs to {rate:.2f} req/s" in why and "within SLOs to 1.82 req/s" in why


def test_slo_rate_by_hand():
    load = Load(rate=6.0, prompt_tokens=1000, output_tokens=100)
    kw = dict(kv_seconds=0.004, slo_ttft=1.0, slo_tpot=0.011, max_batch=64)
    assert slo_rate(FLAT, load, 2, 0, **kw) == pytest.approx(1.0 / 0.55, rel=1e-4)  # the TPOT bound above
    assert slo_rate(FLAT, load, 2, 1, **kw) == pytest.approx(6.0)  # meets both at the whole rate
    # a split overloaded by the served prefill (2x: 0.2 s, rho 1.2) still meets the SLOs up to the
    # rate where its M/D/1 wait + 0.2 s + exposed KV + 10 ms reaches 1 s
    over = slo_rate(FLAT, load, 2, 1, factors=Factors(prefill=2.0), **kw)
    assert 4.0 < over < 5.0
    assert predict(FLAT, Load(over, 1000, 100), 2, 1, factors=Factors(prefill=2.0), **kw).ttft_s == \
        pytest.approx(1.0, rel=1e-3)
    assert slo_rate(FLAT, load, 2, 0, kv_seconds=0.004, slo_ttft=None, slo_tpot=None, max_batch=64) == 0.0
    # an SLO no configuration meets at any rate: 0 (the chooser then ranks by score)
    assert slo_rate(FLAT, load, 2, 1, kv_seconds=0.004, slo_ttft=1.0, slo_tpot=0.005, max_batch=64) == 0.0


def test_chooser_keeps_its_configuration_when_none_can_carry_the_load():
    chooser = SplitChooser(min_samples=1)
    for i in range(24):  # 6 req/s of 1000-token prompts (0.1 s prefills): local misses the TPOT SLO
        chooser.window.observe(i / 6, 1000, 100)
    kv = lambda p: 0.004  # noqa: E731
    k, _ = chooser.choose(FLAT, 4.0, 2, kv_seconds=kv, slo_ttft=1.0, slo_tpot=0.011)
    assert k == 1 and chooser.last[1].feasible
    for i in range(200):  # a burst past both configurations' capacity (>= 20 req/s)
        chooser.window.observe(4.0 + i * 0.005, 1000, 100)
    k, why = chooser.choose(FLAT, 5.0, 2, kv_seconds=kv, slo_ttft=1.0, slo_tpot=0.011)
    assert not any(p.feasible for p in chooser.last)
    assert k == 1 and "split 1P: overloaded" in why  # not the lowest k among equal infinite scores


def _hybrid_run(policy, prompt: int, output: int, n: int = 40, gap_s: float = 0.25):
    workers = (w("m0", "mixed", "n0"), w("m1", "mixed", "n0"))
    decisions = []
    for i in range(n):
        snap = snapshot(workers, topology(), now=100.0 + i * gap_s)
        decisions.append(policy.place(req(prompt, output), snap))
    return decisions


def test_network_aware_splits_a_hybrid_cluster_under_prefill_heavy_load_and_a_tight_tpot():
    policy = make_policy("network-aware", profile=FLAT, slo_ttft=1.0, slo_tpot=0.011)
    decisions = _hybrid_run(policy, 1000, 100)
    assert all(d.kind == "local" for d in decisions[:7])  # too few arrivals to model the load
    late = decisions[10:]
    assert all(d.kind == "disaggregated" for d in late)
    assert len({(d.prefill, d.decode) for d in late}) == 1  # one worker prefills, the other decodes
    assert "hybrid split 1P" in late[-1].reason


def test_network_aware_keeps_a_hybrid_cluster_local_when_decode_is_the_bound():
    policy = make_policy("network-aware", profile=PROFILE, slo_ttft=1.0, slo_tpot=0.02)
    decisions = _hybrid_run(policy, 100, 1000, gap_s=1.0)
    assert all(d.kind == "local" for d in decisions)
    assert "hybrid local" in decisions[-1].reason


def test_fixed_roles_keep_the_pair_choice():
    policy = make_policy("network-aware", profile=FLAT, slo_ttft=1.0, slo_tpot=0.011)
    workers = (w("p0", "prefill", "n0"), w("d0", "decode", "n0"))
    d = policy.place(req(1000, 100), snapshot(workers, topology(), now=1.0))
    assert d.kind == "disaggregated" and "hybrid" not in d.reason
    with pytest.raises(ValueError, match="max_batch"):
        make_policy("network-aware", profile=FLAT, max_batch=0)
