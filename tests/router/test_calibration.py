"""Network-aware's online calibration (router.placement.policies.calibration): the factors, the split
model with them, the policy learning them from outcomes, with hand-checked numbers."""

from __future__ import annotations

import math

import pytest

from pdserve.router.placement.base import Outcome, RequestInfo
from pdserve.router.placement.registry import make_policy
from pdserve.router.placement.policies.calibration import NEUTRAL, Calibration, Factors, Prediction, Ratio
from pdserve.router.placement.policies.split import Load, SplitChooser, predict
from tests.router.network_fixtures import snapshot, topology, w
from tests.router.test_split import FLAT


def outcome(request_id: str, placement: str = "disaggregated", prefill: str | None = "p0", decode: str = "d0",
            **kw) -> Outcome:
    fields = dict(prompt_tokens=1000, output_tokens=100, ttft_s=None, tpot_s=None)
    fields.update(kw)
    return Outcome(request_id=request_id, placement=placement, prefill_worker=prefill,  # type: ignore[arg-type]
                   decode_worker=decode, **fields)


def pair_prediction(**kw) -> Prediction:
    fields = dict(kind="disaggregated", prefill="p0", decode="d0", ttft_s=0.2, tpot_s=0.01, prefill_s=0.1)
    fields.update(kw)
    return Prediction(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the factors


def test_ratio_is_an_ewma_of_clamped_ratios_used_after_min_samples():
    r = Ratio(alpha=0.2, lo=0.5, hi=4.0, min_samples=3)
    assert r.observe(2.0, 1.0) and r.factor == 1.0  # one sample: not used yet
    assert r.observe(1.0, 1.0)  # 2 + 0.2 (1 - 2)
    assert r.value == pytest.approx(1.8) and r.factor == 1.0
    assert r.observe(50.0, 1.0)  # clamped to 4: 1.8 + 0.2 (4 - 1.8)
    assert r.factor == pytest.approx(2.24)
    assert not r.observe(1.0, 0.0) and not r.observe(math.inf, 1.0) and not r.observe(1.0, math.inf)
    assert r.samples == 3
    low = Ratio(alpha=0.2, lo=0.5, hi=4.0, min_samples=1)
    low.observe(0.01, 1.0)
    assert low.factor == 0.5


def test_calibration_learns_from_outcomes_that_match_their_prediction():
    cal = Calibration(min_samples=2)
    for i in range(2):
        cal.expect(f"r{i}", pair_prediction(split_k=1, split_ttft_s=0.1, split_tpot_s=0.02))
        assert cal.observe(outcome(f"r{i}", ttft_s=0.3, tpot_s=0.012, prefill_s=0.16))
    f = cal.factors()
    assert f["prefill"] == pytest.approx(1.6) and f["ttft.disaggregated"] == pytest.approx(1.5)
    assert f["tpot.disaggregated"] == pytest.approx(1.2)
    assert f["split.ttft.split"] == pytest.approx(3.0) and f["split.tpot.split"] == pytest.approx(0.6)
    assert f["ttft.local"] == f["split.ttft.local"] == 1.0
    assert cal.estimate_factors("disaggregated") == Factors(prefill=pytest.approx(1.6), ttft=pytest.approx(1.5),
                                                             tpot=pytest.approx(1.2))
    assert cal.estimate_factors("local") == NEUTRAL  # local runs have no prefill factor
    assert cal.split_factors(1).prefill == pytest.approx(1.6) and cal.split_factors(0) == NEUTRAL
    assert cal.describe() == ("prefill x1.60, ttft.disaggregated x1.50, tpot.disaggregated x1.20, "
                              "split.ttft.split x3.00, split.tpot.split x0.60")


def test_a_backlogged_prefill_is_compared_with_its_span_over_shared_steps():
    # FLAT, n = 1000 uncached tokens, B = 512: idle prefill(1000) = 0.1 s; backlogged, its
    # tokens touch 1000/512 + 1 full steps of prefill(512) = 0.0512 s: 0.1 + 0.0512 = 0.1512 s
    cal = Calibration(min_samples=1)
    step = FLAT.prefill_seconds(512)
    busy = (1000 / 512 + 1) * step
    assert busy == pytest.approx(0.1512)
    prediction = pair_prediction(prefill_s=0.1, prefill_busy_s=busy, prefill_step_s=step)
    cal.expect("r0", prediction)
    cal.observe(outcome("r0", prefill_s=0.3, prefill_queue_s=1.0))  # waited >= one step: backlogged
    assert cal.factor("prefill") == pytest.approx(0.3 / busy)
    cal.expect("r1", prediction)
    cal.observe(outcome("r1", prefill_s=0.3, prefill_queue_s=0.01))  # found P (almost) idle
    assert cal.factor("prefill") == pytest.approx(0.3 / busy + 0.2 * (3.0 - 0.3 / busy))


def test_transients_teach_the_prefill_factor_not_the_residuals():
    cal = Calibration(min_samples=1)
    # predicted before the prefill factor was in use: the TTFT is the factor's error
    cal.expect("a", pair_prediction(prefill_in_use=False))
    cal.observe(outcome("a", ttft_s=2.0, tpot_s=0.02, prefill_s=0.2))
    assert (cal.factor("prefill"), cal.factor("ttft.disaggregated"), cal.factor("tpot.disaggregated")) == \
        (pytest.approx(2.0), 1.0, pytest.approx(2.0))
    # the configuration changed while it ran: neither residual learns, the prefill factor does
    cal.expect("b", pair_prediction())
    cal.new_epoch()
    cal.observe(outcome("b", ttft_s=2.0, tpot_s=0.04, prefill_s=0.3))
    assert cal.ratios["ttft.disaggregated"].samples == 0 and cal.ratios["tpot.disaggregated"].samples == 1
    assert cal.ratios["prefill"].samples == 2
    # placed while the previous configuration's requests drained: nothing is learned
    cal.expect("c", pair_prediction(settled=False, epoch=cal.epoch))
    assert not cal.observe(outcome("c", ttft_s=2.0, tpot_s=0.04, prefill_s=0.3))
    assert cal.ratios["prefill"].samples == 2


def test_calibration_ignores_outcomes_it_cannot_compare():
    cal = Calibration(min_samples=1, max_pending=2)
    assert not cal.observe(outcome("unknown", ttft_s=1.0, prefill_s=1.0))  # never placed
    cal.expect("a", pair_prediction())
    cal.expect("b", pair_prediction())
    cal.expect("c", pair_prediction())  # bounded: the oldest ("a", e.g. a request that failed) goes
    assert cal.num_pending == 2 and not cal.observe(outcome("a", prefill_s=1.0))
    assert not cal.observe(outcome("b", placement="local", prefill=None, ttft_s=1.0))  # fell back to local
    assert not cal.observe(outcome("c", prefill_s=1.0, attempts=2))  # a recovery's times are not the model's
    assert cal.num_pending == 0 and cal.describe() == "" and set(cal.factors().values()) == {1.0}


# ---------------------------------------------------------------- the split model with factors


SIX = Load(rate=6.0, prompt_tokens=1000, output_tokens=100)  # 6 req/s of 1000-token prompts (0.1 s prefills)
KV = 0.032


def _predict(k: int, factors: Factors = NEUTRAL):
    return predict(FLAT, SIX, 2, k, kv_seconds=KV, slo_ttft=1.0, slo_tpot=0.011, max_batch=64, factors=factors)


def test_neutral_factors_change_nothing():
    for k in (0, 1):
        assert _predict(k) == predict(FLAT, SIX, 2, k, kv_seconds=KV, slo_ttft=1.0, slo_tpot=0.011, max_batch=64)


def test_the_prefill_factor_acts_on_the_splits_capacity():
    # uncorrected: local 3 req/s a worker, duty 0.3: TPOT 0.01 / 0.7 (score 1.299); the split's one
    # prefill worker at rho 0.6, TPOT 0.01 (score 0.909): the model splits
    local, split = _predict(0), _predict(1)
    assert local.score == pytest.approx(0.01 / 0.7 / 0.011)
    exposed = (KV - 31 / 32 * KV) / (1 - 6 * KV)
    assert split.ttft_s == pytest.approx(0.6 * 0.1 / (2 * 0.4) + 0.1 + exposed + 0.01)
    assert split.score == pytest.approx(0.01 / 0.011) and split.score < local.score
    # served prefill 1.6x the profile: rho 0.96, the M/D/1 wait 0.96 x 0.16 / (2 x 0.04) = 1.92 s
    slow = _predict(1, Factors(prefill=1.6))
    assert slow.ttft_s == pytest.approx(1.92 + 0.16 + exposed + 0.01)
    assert slow.score == pytest.approx(slow.ttft_s) and slow.score > local.score  # local now wins
    # 2x: rho 1.2, the split cannot carry 6 req/s at all
    assert not _predict(1, Factors(prefill=2.0)).feasible


def test_residual_factors_scale_a_configurations_ttft_and_tpot():
    base, scaled = _predict(0), _predict(0, Factors(ttft=1.5, tpot=1.2))
    assert scaled.ttft_s == pytest.approx(1.5 * base.ttft_s) and scaled.tpot_s == pytest.approx(1.2 * base.tpot_s)
    assert scaled.score == pytest.approx(1.2 * 0.01 / 0.7 / 0.011)
    assert "TPOT 17.1ms" in scaled.describe()


def test_the_chooser_weighs_an_overloaded_split_by_what_it_serves_within_the_slos():
    chooser = SplitChooser(min_samples=1)
    for i in range(24):
        chooser.window.observe(i / 6, 1000, 100)
    k, _ = chooser.choose(FLAT, 4.0, 2, kv_seconds=lambda p: KV, slo_ttft=1.0, slo_tpot=0.011)
    assert k == 1
    # served prefills 2x the profile's: the split (rho 1.2) is overloaded, but within the SLOs it
    # still serves 4.44 req/s, local (TPOT 14.3 ms > 11 ms at this load) only 1.82: it stays
    factors = lambda k: Factors(prefill=2.0) if k else NEUTRAL  # noqa: E731
    k, why = chooser.choose(FLAT, 4.0, 2, kv_seconds=lambda p: KV, slo_ttft=1.0, slo_tpot=0.011, factors=factors)
    assert k == 1 and "split 1P: overloaded, within SLOs to 4.44 req/s" in why and not chooser.last[1].feasible
    assert chooser.last_slo_rates[0] == pytest.approx(1.82, abs=0.01)
    # a looser TPOT SLO (20 ms) that local meets at all 6 req/s: local serves more, the cluster goes local
    k, why = chooser.choose(FLAT, 4.0, 2, kv_seconds=lambda p: KV, slo_ttft=1.0, slo_tpot=0.02, factors=factors)
    assert k == 0 and "split 1P: overloaded" in why


# ---------------------------------------------------------------- the policy learns


def _req(request_id: str, prompt: int = 1000, output: int = 100) -> RequestInfo:
    return RequestInfo(request_id=request_id, num_prompt_tokens=prompt, max_tokens=output)


def test_a_profile_that_underestimates_prefill_2x_learns_it_and_prefers_local():
    """1P + 1D on one node (200 Gbps, no latency), both idle; FLAT: a 1000-token prefill 0.1 s.

    Pair: 0.1 + kv 0.00524 - 31/32 x 0.00524 (hidden) + admit 0 = 0.10016 s; local: 0.1 s, not
    20% better: the pair. Served prefills take 0.2 s: with the factor 2 learned the pair is
    0.20016 s and local (0.1 < 0.8 x 0.20016) wins."""
    policy = make_policy("network-aware", profile=FLAT, slo_ttft=1.0)
    workers = (w("p0", "prefill", "n0"), w("d0", "decode", "n0"))
    snap = snapshot(workers, topology(), now=1.0)
    kv = 1000 * 128 * 1024 * 8 / 200e9
    profile_prefill = FLAT.prefill_seconds(1000)
    for i in range(4):
        d = policy.place(_req(f"r{i}"), snap)
        assert (d.kind, d.prefill, d.decode) == ("disaggregated", "p0", "d0")
        assert d.reason.startswith(f"TTFT {profile_prefill + kv / 32:.3f}s p0->d0") and "calibrated" not in d.reason
        assert policy.calibration_factors()["prefill"] == 1.0  # 3 samples are not enough yet
        policy.observe_outcome(outcome(f"r{i}", prefill_s=2 * profile_prefill))
    assert policy.calibration_factors()["prefill"] == 2.0
    d = policy.place(_req("r4"), snap)
    assert (d.kind, d.decode) == ("local", "d0")
    assert "local beats every pair by > 20%" in d.reason and "best pair 0.200s" in d.reason
    assert d.reason.endswith("; calibrated: prefill x2.00")
    # the local run's prediction waits for its outcome; the pair's residuals are untouched
    assert policy.calibration.num_pending == 1 and policy.calibration_factors()["ttft.disaggregated"] == 1.0


def test_a_ttft_residual_learned_on_pairs_is_applied_to_pairs_only():
    policy = make_policy("network-aware", profile=FLAT, slo_ttft=1.0)
    snap = snapshot((w("p0", "prefill", "n0"), w("d0", "decode", "n0")), topology(), now=1.0)
    for i in range(4):
        policy.place(_req(f"r{i}"), snap)
        predicted = policy.calibration._pending[f"r{i}"].ttft_s
        policy.observe_outcome(outcome(f"r{i}", ttft_s=1.5 * predicted))
    assert policy.calibration_factors()["ttft.disaggregated"] == pytest.approx(1.5)
    d = policy.place(_req("r4"), snap)
    # pair 1.5 x 0.10016 = 0.150 against local 0.1 < 0.8 x 0.150: local
    assert d.kind == "local" and "(x1.50 (" not in d.reason.split(";")[0] and "best pair 0.150s" in d.reason


def test_a_hybrid_cluster_leaves_a_split_its_served_prefill_cannot_carry():
    """Two mixed workers, 6 req/s of 1000-token prompts, SLOs 1 s / 20 ms: the model splits (the
    split scores 0.5, local 0.7). Outcomes report 0.2 s prefills: the split needs 6 x 0.2 = 1.2 of
    its prefill worker and meets the SLOs only up to 4.44 req/s, while local meets them at all 6
    (TPOT 14.3 ms): the cluster goes local. (At an 11 ms TPOT SLO local would serve only 1.82 req/s
    within it and the overloaded split stays: test_the_chooser_weighs_an_overloaded_split...)"""
    policy = make_policy("network-aware", profile=FLAT, slo_ttft=1.0, slo_tpot=0.02)
    workers = (w("m0", "mixed", "n0"), w("m1", "mixed", "n0"))
    profile_prefill = FLAT.prefill_seconds(1000)
    decisions = []
    for i in range(40):
        d = policy.place(_req(f"r{i}"), snapshot(workers, topology(), now=100.0 + i / 6))
        decisions.append(d)
        if i >= 20 and d.kind == "disaggregated":
            pending = policy.calibration._pending[f"r{i}"]
            assert pending.split_k == 1 and pending.prefill_s == profile_prefill
            policy.observe_outcome(outcome(f"r{i}", prefill=d.prefill, decode=d.decode,
                                           prefill_s=2 * profile_prefill))
    assert all(d.kind == "disaggregated" for d in decisions[12:24])
    assert policy.calibration_factors()["prefill"] == 2.0
    assert all(d.kind == "local" for d in decisions[24:])
    assert "hybrid local" in decisions[-1].reason and "split 1P: overloaded" in decisions[-1].reason
    assert decisions[-1].reason.endswith("; calibrated: prefill x2.00")
    # without outcomes the same arrivals keep the split
    plain = make_policy("network-aware", profile=FLAT, slo_ttft=1.0, slo_tpot=0.02)
    late = [plain.place(_req(f"r{i}"), snapshot(workers, topology(), now=100.0 + i / 6)) for i in range(40)][24:]
    assert all(d.kind == "disaggregated" for d in late)

def _calibrated(policy, **factors: float):
    for name, value in factors.items():
        ratio = policy.calibration.ratios[name.replace("_", ".")]
        ratio.value, ratio.samples = value, ratio.min_samples
    return policy


@pytest.mark.parametrize("seed", range(20))
def test_calibrated_search_chooses_what_pricing_every_option_chooses(seed):
    """The prefill factor scales the profile the search bounds with; the residuals apply after
    it: on random clusters the search and its oracle still decide alike."""
    import random

    from pdserve.router.placement.base import SLOUnattainable
    from pdserve.router.placement.policies.network_aware import NetworkAware
    from tests.router.network_fixtures import PROFILE
    from pdserve.router.placement.policies.oracle import OracleNetworkAware
    from tests.router.test_search import random_cluster

    rng = random.Random(5000 + seed)
    snap = random_cluster(rng)
    factors = dict(prefill=rng.choice([0.5, 1.7, 3.0]), ttft_disaggregated=rng.choice([0.8, 1.3]),
                   tpot_disaggregated=rng.choice([1.0, 1.9]), ttft_local=1.2, tpot_local=rng.choice([0.7, 1.5]))
    options = rng.choice([{}, {"slo_tpot": 0.02}, {"slo_ttft": 0.3, "slo_tpot": 0.02, "admission_control": True}])
    policies = [_calibrated(cls(profile=PROFILE, **options), **factors) for cls in (NetworkAware, OracleNetworkAware)]
    for i in range(8):
        request = RequestInfo(request_id=f"r{i}", num_prompt_tokens=rng.randint(16, 2000),
                              max_tokens=rng.choice([1, 64]))
        decisions = []
        for policy in policies:
            try:
                decisions.append(policy.place(request, snap))
            except SLOUnattainable as exc:
                decisions.append(str(exc))
        assert decisions[0] == decisions[1]


def test_calibrate_false_keeps_the_offline_model():
    policy = make_policy("network-aware", profile=FLAT, calibrate=False)
    snap = snapshot((w("p0", "prefill", "n0"), w("d0", "decode", "n0")), topology(), now=1.0)
    for i in range(6):
        assert policy.place(_req(f"r{i}"), snap).kind == "disaggregated"
        policy.observe_outcome(outcome(f"r{i}", prefill_s=1.0, ttft_s=5.0))
    assert policy.calibration.num_pending == 0 and set(policy.calibration_factors().values()) == {1.0}
    with pytest.raises(ValueError, match="calibrate"):
        make_policy("network-aware", profile=FLAT, calibrate="yes")


def test_build_policy_passes_calibrate(tmp_path):
    from pdserve.router.placement.registry import build_policy
    from pdserve.router.placement.profiles import save_profile

    path = tmp_path / "profile.json"
    save_profile(FLAT, str(path))
    assert build_policy("network-aware", profile_path=str(path)).calibrate is True
    assert build_policy("network-aware", profile_path=str(path), calibrate=False).calibrate is False
    with pytest.raises(ValueError, match=r"--no-calibration: only the network-aware policy uses it"):
        build_policy("least-loaded", calibrate=False)
