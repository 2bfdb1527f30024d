"""The autoscaling rule on its own: bounds, the bound pool, cooldown, hysteresis (a steady load
settles with at most one change and does not oscillate)."""

from __future__ import annotations

import math

import pytest

from pdserve.launcher.autoscale.rule import AutoscaleConfig, ClusterState, PoolState, RuleMemory, decide as _decide


def decide(*args):
    """The rule, its decision as (action, pool, code, reason) for short comparisons."""
    d, memory = _decide(*args)
    return d, memory


def act(*args):
    d, _ = _decide(*args)
    return (d.action, d.pool, d.code)

CONFIG = AutoscaleConfig(min_workers={"prefill": 1, "decode": 1}, max_workers={"prefill": 3, "decode": 3},
                         cooldown_s=20, interval_s=5, down_stable=3)


def state(now=100.0, p=1, d=1, attainment=1.0, ttft=None, tpot=None, finished=20, pw=0.0, dw=0.0, pbusy=0.5,
          dbusy=0.5, dfull=0.1, changing=False) -> ClusterState:
    return ClusterState(now=now, pools={"prefill": PoolState(p, waiting=pw, busy=pbusy),
                                        "decode": PoolState(d, waiting=dw, busy=dbusy, batch_full=dfull)},
                        finished=finished, attainment=attainment, ttft_attainment=attainment if ttft is None else ttft,
                        tpot_attainment=1.0 if tpot is None else tpot, changing=changing)


def test_prefill_bound_when_ttft_misses_with_the_prefill_queue_growing():
    decision, memory = decide(state(attainment=0.6, ttft=0.6, pw=4.0), CONFIG)
    assert (decision.action, decision.pool, decision.code) == ("add", "prefill", "ttft_miss_prefill_queue")
    assert "0.60 < 0.90" in decision.reason and "4.0 queued per prefill worker" in decision.reason
    assert memory.last_change_at == 100.0


def test_decode_bound_on_tpot_misses_or_full_batches():
    assert act(state(attainment=0.7, ttft=1.0, tpot=0.7), CONFIG) == ("add", "decode", "tpot_miss")
    assert act(state(attainment=0.7, ttft=0.7, dfull=0.95), CONFIG) == ("add", "decode", "decode_full")
    # TTFT misses with the queue at the decode workers (reservations wait), none at prefill
    assert act(state(attainment=0.7, ttft=0.7, pw=0.0, dw=3.0), CONFIG) == (
        "add", "decode", "ttft_miss_decode_queue")


def test_mixed_pool_scales_as_one():
    s = ClusterState(now=100, pools={"mixed": PoolState(2, busy=0.9)}, finished=10, attainment=0.5, ttft_attainment=0.5)
    assert act(s, CONFIG) == ("add", "mixed", "slo_miss")


def test_holds_at_max_during_cooldown_while_changing_and_with_too_few_requests():
    d, _ = decide(state(d=3, attainment=0.5, tpot=0.5), CONFIG)
    assert (d.action, d.code) == ("hold", "at_max") and "decode is at its max 3" in d.reason
    d, _ = decide(state(now=110, attainment=0.5, tpot=0.5), CONFIG, RuleMemory(last_change_at=100))
    assert (d.action, d.code) == ("hold", "cooldown")
    assert decide(state(now=121, attainment=0.5, tpot=0.5), CONFIG, RuleMemory(last_change_at=100))[0].action == "add"
    assert decide(state(attainment=0.5, tpot=0.5, changing=True), CONFIG)[0].code == "changing"
    assert decide(state(attainment=0.0, finished=4), CONFIG)[0].code == "steady"  # min_requests 5


def test_bounds_first():
    assert act(state(p=0), CONFIG) == ("add", "prefill", "below_min")
    assert act(state(d=5), CONFIG) == ("remove", "decode", "above_max")


def test_scale_down_needs_high_attainment_low_use_after_removal_and_several_intervals():
    memory = RuleMemory()
    actions = []
    for i in range(4):  # decode: 3 workers, 0.2 busy -> 0.3 with two
        d, memory = decide(state(now=100 + 5 * i, d=3, dbusy=0.2, pbusy=0.9), CONFIG, memory)
        actions.append((d.action, d.pool, d.code))
    assert actions == [("hold", None, "steady")] * 2 + [("remove", "decode", "idle"), ("hold", None, "cooldown")]
    # utilisation that would pass the threshold with one worker fewer: no removal
    memory = RuleMemory()
    for i in range(6):
        d, memory = decide(state(now=100 + 5 * i, d=2, dbusy=0.3, pbusy=0.9), CONFIG, memory)  # 0.6 with one
        assert d.action == "hold"
    # attainment between the thresholds (the dead band): neither way
    memory = RuleMemory()
    for i in range(6):
        d, memory = decide(state(now=100 + 5 * i, d=3, attainment=0.95, dbusy=0.1), CONFIG, memory)
        assert d.action == "hold"
    # at the minimum: never below it
    memory = RuleMemory()
    for i in range(6):
        d, memory = decide(state(now=100 + 5 * i, p=1, d=1, pbusy=0.0, dbusy=0.0), CONFIG, memory)
        assert d.action == "hold"


def test_a_steady_state_sequence_gives_at_most_one_change():
    """Replayed series: the same state every interval, whatever it is (in the dead band, idle at
    the minimum, a full but in-SLO pool): at most one change in 10 minutes."""
    for s in (state(attainment=0.95), state(d=2, attainment=0.99, dbusy=0.45), state(d=2, attainment=0.93, dfull=0.95),
              state(p=1, d=1, pbusy=0.0, dbusy=0.0)):
        memory, changes = RuleMemory(), 0
        for i in range(120):
            d, memory = decide(ClusterState(**{**s.__dict__, "now": 5.0 * i}), CONFIG, memory)
            changes += d.action != "hold"
        assert changes <= 1, s


def model(load: float, workers: dict[str, int]) -> tuple[float, float, float, float, float]:
    """A steady load on a closed loop: (attainment, TTFT attainment, TPOT attainment, prefill
    busy, decode busy). Each worker serves 1 unit; above 0.8 busy a pool misses its SLO in
    proportion: prefill the TTFT, decode the TPOT."""
    busy = {pool: min(1.0, load / n) for pool, n in workers.items()}
    miss = {pool: min(1.0, max(0.0, (load / n - 0.8) * 2)) for pool, n in workers.items()}
    ttft, tpot = 1 - miss["prefill"], 1 - miss["decode"]
    return ttft * tpot, ttft, tpot, busy["prefill"], busy["decode"]


@pytest.mark.parametrize("load", [0.3, 0.9, 1.5, 2.2])
def test_a_steady_load_settles_without_oscillating(load):
    """The rule in a loop with a model of the cluster: for a steady load it adds what the load
    needs, then holds; no worker is added and removed again."""
    workers = {"prefill": 1, "decode": 1}
    memory = RuleMemory()
    history = []
    for i in range(200):
        att, ttft, tpot, pb, db = model(load, workers)
        s = ClusterState(now=5.0 * i, pools={"prefill": PoolState(workers["prefill"], busy=pb, waiting=3 * (pb > 0.8)),
                                             "decode": PoolState(workers["decode"], busy=db)},
                         finished=20, attainment=att, ttft_attainment=ttft, tpot_attainment=tpot)
        d, memory = decide(s, CONFIG, memory)
        if d.action == "add":
            workers[d.pool] += 1
        elif d.action == "remove":
            workers[d.pool] -= 1
        history.append(d.action)
    assert "remove" not in history  # nothing taken back under a steady load
    assert model(load, workers)[0] >= CONFIG.target_attainment or workers == {"prefill": 3, "decode": 3}
    assert history.count("add") == sum(workers.values()) - 2
    assert history[-100:] == ["hold"] * 100


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match=r"autoscale.max_workers: decode 0 is below autoscale.min_workers 1"):
        AutoscaleConfig(max_workers={"decode": 0})
    with pytest.raises(ValueError, match=r"autoscale.down_attainment: must be >= autoscale.target_attainment"):
        AutoscaleConfig(target_attainment=0.95, down_attainment=0.9)
    with pytest.raises(ValueError, match=r"autoscale: unknown key 'cooldwn'"):
        AutoscaleConfig.from_mapping({"cooldwn": 3})
    with pytest.raises(ValueError, match=r"autoscale.min_workers: unknown pool 'gpu'"):
        AutoscaleConfig.from_mapping({"min": {"gpu": 1}})
    c = AutoscaleConfig.from_mapping({"min": {"decode": 2}, "max": {"decode": 5}, "cooldown": 7,
                                      "target-attainment": 0.8})
    assert (c.min_workers["decode"], c.max_workers["decode"], c.min_workers["prefill"], c.cooldown_s,
            c.target_attainment) == (2, 5, 1, 7, 0.8)
    assert AutoscaleConfig.from_mapping(True) == AutoscaleConfig()
    assert math.isinf(RuleMemory().last_change_at)


def test_a_growing_queue_adds_before_the_attainment_falls():
    """A step up: requests queue at the prefill worker; none has missed yet (too few finished
    since the last change), so the attainment says nothing; the queue, long and not falling for
    two intervals, adds a prefill worker."""
    memory = RuleMemory(last_change_at=0.0)
    d, memory = decide(state(now=100, finished=2, pw=3.0), CONFIG, memory)
    assert d.action == "hold" and memory.pressure == {"prefill": 1}
    d, memory = decide(state(now=105, finished=3, pw=5.0), CONFIG, memory)
    assert (d.action, d.pool, d.code) == ("add", "prefill", "queue_growing")
    assert "5.0 requests queued per worker" in d.reason and memory.pressure == {}


def test_a_queue_that_falls_or_meets_the_slo_adds_nothing():
    memory = RuleMemory(last_change_at=0.0)
    for i, pw in enumerate([6.0, 5.0, 4.0, 3.0]):  # draining on its own
        d, memory = decide(state(now=100 + 5 * i, finished=2, pw=pw), CONFIG, memory)
        assert d.action == "hold"
    memory = RuleMemory(last_change_at=0.0)
    for i in range(10):  # long but within the SLO for 99% of 20 requests: the dead band holds
        d, memory = decide(state(now=100 + 5 * i, attainment=0.99, dw=4.0), CONFIG, memory)
        assert d.action == "hold"
    off = AutoscaleConfig(min_workers={"prefill": 1, "decode": 1}, queue_up=0)
    memory = RuleMemory(last_change_at=0.0)
    for i in range(10):
        d, memory = decide(state(now=100 + 5 * i, finished=2, pw=9.0), off, memory)
        assert d.action == "hold"


def test_a_growing_queue_holds_in_the_cooldown_and_at_max():
    d, memory = decide(state(now=100, finished=2, pw=4.0), CONFIG, RuleMemory(last_change_at=90))
    d, memory = decide(state(now=105, finished=2, pw=4.0), CONFIG, memory)
    assert d.code == "cooldown" and memory.pressure == {"prefill": 2}  # counted through the cooldown
    d, memory = decide(state(now=111, finished=2, pw=4.0), CONFIG, memory)
    assert (d.action, d.code) == ("add", "queue_growing")  # at once when the cooldown ends
    memory = RuleMemory()
    for i in range(4):
        d, memory = decide(state(now=100 + 5 * i, p=3, finished=2, pw=12.0), CONFIG, memory)
        assert d.action == "hold"


LOADED = AutoscaleConfig(min_workers={"prefill": 1, "decode": 1}, max_workers={"prefill": 3, "decode": 3},
                         cooldown_s=20, interval_s=5, down_stable=3, up_load=3.0, up_utilisation=0.8, up_stable=2)


def loaded(now, d=1, dload=0.0, dbusy=0.5, pload=0.0, pbusy=0.2, attainment=1.0, finished=20, dd=0) -> ClusterState:
    return ClusterState(now=now, pools={"prefill": PoolState(1, busy=pbusy, load=pload),
                                        "decode": PoolState(d, draining=dd, busy=dbusy, load=dload)},
                        finished=finished, attainment=attainment, ttft_attainment=attainment, arrival_rate=0.8)


def test_a_rising_load_adds_before_any_miss():
    """The CPU step's figures: at 0.2-0.4 req/s the decode worker is busy 0.86 of the time with
    about 2 requests in flight (no add: busy alone says nothing for a batching worker); from the
    step up, 3 and more in flight, busy 1.0, all requests still within the SLO: it adds a decode
    worker after two intervals, before any miss."""
    memory = RuleMemory()
    for i, (dl, db) in enumerate([(1.6, 0.86), (1.9, 1.0), (2.0, 0.86), (1.7, 0.86)] * 3):
        d, memory = decide(loaded(5.0 * i, dload=dl, dbusy=db), LOADED, memory)
        assert d.action == "hold", (i, d)
    d, memory = decide(loaded(100, dload=3.1, dbusy=1.0, pload=0.3), LOADED, memory)
    assert d.action == "hold" and memory.loaded == {"decode": 1}
    d, memory = decide(loaded(105, dload=3.6, dbusy=1.0, pload=0.3), LOADED, memory)
    assert (d.action, d.pool, d.code) == ("add", "decode", "load_rising")
    assert "3.6 requests in flight per worker (>= 3)" in d.reason and "attainment 1.00" in d.reason
    assert memory.loaded == {} and memory.last_change_at == 105
    # busy but light, or loaded but mostly idle (a burst): no add
    for kw in ({"dload": 2.5, "dbusy": 1.0}, {"dload": 4.0, "dbusy": 0.6}):
        memory = RuleMemory()
        for i in range(6):
            d, memory = decide(loaded(100 + 5 * i, **kw), LOADED, memory)
            assert d.action == "hold", kw
    # off by default
    memory = RuleMemory()
    for i in range(6):
        d, memory = decide(loaded(100 + 5 * i, dload=9.0, dbusy=1.0), CONFIG, memory)
        assert d.action == "hold"


def test_a_load_that_falls_adds_nothing():
    memory = RuleMemory()
    for i, dl in enumerate([5.0, 4.5, 4.0, 3.5, 3.2, 3.0]):  # over up_load but the backlog drains
        d, memory = decide(loaded(100 + 5 * i, dload=dl, dbusy=1.0), LOADED, memory)
        assert d.action == "hold"


def test_the_load_trigger_respects_max_cooldown_and_changes():
    memory = RuleMemory()
    for i in range(6):  # at max
        d, memory = decide(loaded(100 + 5 * i, d=3, dload=6.0 + i, dbusy=1.0), LOADED, memory)
        assert d.action == "hold"
    memory = RuleMemory()
    for i in range(6):  # at max counting a worker still draining
        d, memory = decide(loaded(100 + 5 * i, d=2, dd=1, dload=6.0 + i, dbusy=1.0), LOADED, memory)
        assert d.action == "hold"
    d, memory = decide(loaded(100, dload=4.0, dbusy=1.0, ), LOADED, RuleMemory(last_change_at=90))
    d, memory = decide(loaded(105, dload=4.0, dbusy=1.0), LOADED, memory)
    assert d.code == "cooldown" and memory.loaded == {"decode": 2}  # counted through the cooldown
    d, memory = decide(loaded(110, dload=4.0, dbusy=1.0), LOADED, memory)
    assert (d.action, d.code) == ("add", "load_rising")  # at once when it ends
    d, memory = decide(ClusterState(**{**loaded(120, dload=5.0, dbusy=1.0).__dict__, "changing": True}), LOADED,
                       RuleMemory(loaded={"decode": 5}, load={"decode": 4.0}))
    assert d.code == "changing"


def test_a_removal_does_not_leave_a_load_that_adds_again():
    """The scale-down's hysteresis against the load trigger: it removes only when the load per
    worker with one fewer stays under up_load * down_utilisation (1.5 here), and busy under
    down_utilisation (< up_utilisation)."""
    memory = RuleMemory()
    for i in range(6):  # 2 decode, 1.0 in flight each: 2.0 with one, over 1.5: stays
        d, memory = decide(loaded(100 + 5 * i, d=2, dload=1.0, dbusy=0.2), LOADED, memory)
        assert d.action == "hold"
    memory = RuleMemory()
    codes = []
    for i in range(4):  # 0.5 each: 1.0 with one: removed after down_stable intervals
        d, memory = decide(loaded(100 + 5 * i, d=2, dload=0.5, dbusy=0.2), LOADED, memory)
        codes.append(d.code)
    assert codes == ["steady", "steady", "idle", "cooldown"]
    with pytest.raises(ValueError, match=r"autoscale.up_utilisation: must be > autoscale.down_utilisation"):
        AutoscaleConfig(up_utilisation=0.5, down_utilisation=0.5)
    with pytest.raises(ValueError, match=r"autoscale.up_load: must be a number >= 0"):
        AutoscaleConfig.from_mapping({"up-load": -1})
    with pytest.raises(ValueError, match=r"autoscale.up_stable: must be an integer >= 1"):
        AutoscaleConfig.from_mapping({"up_stable": 0})
    c = AutoscaleConfig.from_mapping({"up_load": 3, "up_utilisation": 0.9, "up_stable": 3})
    assert (c.up_load, c.up_utilisation, c.up_stable) == (3, 0.9, 3)


def test_with_the_load_trigger_on_a_busy_decode_pool_at_a_light_load_shrinks_and_a_prefill_pool_by_its_busy_share():
    """GPU step (run 13): three decode workers of eight-request batches, each with a request in
    its batch most of the time (busy 0.7) but 0.7 in flight per worker. Their load with one
    fewer (1.05) is under up_load * down_utilisation (1.5): one leaves, though the busy share
    with one fewer (1.05) is over down_utilisation. With the load trigger off the busy share
    rules and nothing leaves; a prefill pool is judged by its busy share either way."""
    def light(now, config, pool="decode"):
        pools = {"prefill": PoolState(1, busy=0.1, load=0.1), "decode": PoolState(1, busy=0.1, load=0.1)}
        pools[pool] = PoolState(3, busy=0.7, load=0.7)
        return decide(ClusterState(now=now, pools=pools, finished=20, attainment=1.0, ttft_attainment=1.0,
                                   arrival_rate=2.0), config, memory)

    memory, codes = RuleMemory(), []
    for i in range(4):
        d, memory = light(100 + 5 * i, LOADED)
        codes.append(d.code)
    assert codes == ["steady", "steady", "idle", "cooldown"]
    memory = RuleMemory()
    d, memory = light(100, LOADED)
    d, memory = light(105, LOADED)
    d, memory = light(110, LOADED)
    assert (d.action, d.pool, d.code) == ("remove", "decode", "idle")
    assert "0.70 in flight per worker over 3 workers (1.05 with one fewer, < 1.50" in d.reason
    for config, pool in ((CONFIG, "decode"), (LOADED, "prefill")):
        memory = RuleMemory()
        for i in range(6):
            d, memory = light(100 + 5 * i, config, pool)
            assert d.action == "hold", (config.up_load, pool, d)


def load_model(rate: float, workers: dict[str, int]) -> ClusterState:
    """A steady arrival rate on pools whose workers each hold 2.5 requests in flight per unit of
    rate (Little's law with a 2.5 s request; the prefill pool a fifth of that), busy as a Poisson
    pool would be; one worker of either pool serves 1.5 units within the SLO, beyond it the
    latency (so the load) and the misses grow."""
    pools = {}
    ttft = tpot = 1.0
    for pool, n in workers.items():
        per = rate / n
        load = 2.5 * per * (1 + max(0.0, per - 1.5))  # latency grows over capacity
        pools[pool] = PoolState(n, busy=1 - math.exp(-load), load=load if pool == "decode" else load / 5)
        miss = min(1.0, max(0.0, (per - 1.5) * 2))
        if pool == "decode":
            tpot = 1 - miss
        else:
            ttft = 1 - miss
    return ClusterState(now=0, pools=pools, finished=20, attainment=ttft * tpot, ttft_attainment=ttft,
                        tpot_attainment=tpot, arrival_rate=rate)


@pytest.mark.parametrize("rate", [0.2, 0.5, 1.3, 1.45, 1.9, 2.6, 4.0])
def test_a_steady_load_with_the_load_trigger_settles_without_oscillating(rate):
    workers = {"prefill": 1, "decode": 1}
    memory = RuleMemory()
    history = []
    for i in range(200):
        s = ClusterState(**{**load_model(rate, workers).__dict__, "now": 5.0 * i})
        d, memory = decide(s, LOADED, memory)
        if d.action == "add":
            workers[d.pool] += 1
        elif d.action == "remove":
            workers[d.pool] -= 1
        history.append((d.action, d.code))
    actions = [a for a, _ in history]
    assert "remove" not in actions, history  # nothing taken back
    assert actions[-100:] == ["hold"] * 100
    if rate <= 0.5:
        assert workers == {"prefill": 1, "decode": 1}  # light: no add at all
    else:  # the decode pool grows until its load is under up_load (or at max)
        assert workers["decode"] == 3 or load_model(rate, workers).pools["decode"].load < LOADED.up_load
        assert load_model(rate, workers).attainment >= LOADED.target_attainment or workers["prefill"] == 3
    if 1.2 <= rate <= 1.5:  # over up_load per worker, no miss yet: the load adds, not a miss
        assert history[0] == ("hold", "steady") and ("add", "load_rising") in history
        assert [c for a, c in history if a == "add"] == ["load_rising"]


def test_spares_setting():
    assert AutoscaleConfig().spares == {}
    assert AutoscaleConfig.from_mapping({"spares": 1}).spares == {"prefill": 1, "decode": 1, "mixed": 1}
    assert AutoscaleConfig.from_mapping({"spare": {"decode": 2}}).spares == {"decode": 2}
    with pytest.raises(ValueError, match="autoscale.spares"):
        AutoscaleConfig.from_mapping({"spares": {"gpu": 1}})
    with pytest.raises(ValueError, match="autoscale.spares"):
        AutoscaleConfig.from_mapping({"spares": {"decode": -1}})
    with pytest.raises(ValueError, match="autoscale.spares"):
        AutoscaleConfig.from_mapping({"spares": "two"})


def test_up_load_auto_from_the_batch_cap_and_the_profile():
    from pdserve.launcher.autoscale.loop import resolve_up_load
    from pdserve.launcher.autoscale.rule import auto_up_load

    value, why = auto_up_load(8)  # run 14's hand-set 6 of 8 slots
    assert value == 6.0 and "max_num_seqs 8" in why
    assert auto_up_load(1)[0] == 1.0  # at least one request
    # a decode step of 20 ms + 2 ms a request: within a TPOT SLO of 100 ms up to batch 40
    value, why = auto_up_load(256, 0.1, lambda b: 0.02 + 0.002 * b)
    assert value == 30.0 and "up to batch 40" in why
    value, why = auto_up_load(16, 0.1, lambda b: 0.02 + 0.002 * b)  # the cap binds first
    assert value == 12.0 and "stays within" in why
    assert auto_up_load(64, 0.01, lambda b: 0.02)[0] == 1.0  # no batch within the SLO: 1
    with pytest.raises(ValueError, match="max_num_seqs"):
        auto_up_load(0)

    config = AutoscaleConfig.from_mapping({"up_load": "Auto"})
    assert config.up_load == "auto"
    resolved, why = resolve_up_load(config, max_num_seqs=8, slo_tpot=0.05)
    assert resolved.up_load == 6.0 and why.startswith("up_load auto = 6")
    assert resolve_up_load(LOADED, max_num_seqs=8, slo_tpot=0.05) == (LOADED, None)
    with pytest.raises(ValueError, match=r"autoscale.up_load: must be a number >= 0 or 'auto'"):
        AutoscaleConfig.from_mapping({"up_load": "high"})


def test_up_load_auto_reads_the_profile_decode_steps():
    from pdserve.launcher.autoscale.loop import resolve_up_load
    from pdserve.router.placement.profiles import Profile

    profile = Profile.from_dict({
        "version": 1, "hardware": {"device": "cpu", "name": "test"}, "model": "m", "dtype": "float32",
        "num_layers": 2, "kv_bytes_per_token": 1024,
        "block_size": 16, "max_num_batched_tokens": 512,
        "prefill": {"tokens": [16, 256], "seconds": [0.01, 0.1]},
        "decode": {"batch_sizes": [1, 64], "contexts": [128, 1024], "seconds": [[0.02, 0.03], [0.15, 0.3]]}})
    # at the longest context (1024): 0.03 s at batch 1 to 0.3 s at 64; a 0.1 s SLO holds batch 17
    resolved, why = resolve_up_load(AutoscaleConfig(up_load="auto"), max_num_seqs=256, slo_tpot=0.1, profile=profile)
    assert "up to batch 17" in why and resolved.up_load == 12.75
