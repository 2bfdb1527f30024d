"""The rule's role shifts: hybrid workers change duty toward the bound phase instead of a new process."""

from __future__ import annotations

import pytest

from pdserve.launcher.autoscale.rule import AutoscaleConfig, ClusterState, PoolState, RuleMemory, decide

CONFIG = AutoscaleConfig(min_workers={"mixed": 1}, max_workers={"mixed": 4}, cooldown_s=20, interval_s=5)


def hybrid(duties, *, now=100.0, attainment=0.6, ttft=1.0, tpot=1.0, full=0.1, finished=20) -> ClusterState:
    n = sum(duties.values())
    return ClusterState(now=now, pools={"mixed": PoolState(n, busy=0.9, batch_full=full)}, finished=finished,
                        attainment=attainment, ttft_attainment=ttft, tpot_attainment=tpot, duties=duties)


def shift(state, memory=None):
    d, m = decide(state, CONFIG, memory)
    return (d.action, d.source, d.pool, d.code), d, m


def test_tpot_misses_shift_a_mixed_worker_to_decode_duty_instead_of_adding_one():
    got, d, memory = shift(hybrid({"mixed": 3}, tpot=0.6))
    assert got == ("shift", "mixed", "decode", "shift_to_decode")
    assert "TPOT misses" in d.reason and "from mixed to decode duty" in d.reason and "mixed 3" in d.reason
    assert memory.last_change_at == 100.0  # a change: the cooldown follows it
    assert decide(hybrid({"mixed": 2, "decode": 1}, now=110, tpot=0.6), CONFIG, memory)[0].code == "cooldown"


def test_full_decode_batches_count_as_decode_bound():
    assert shift(hybrid({"mixed": 2}, ttft=0.6, full=0.95))[0] == ("shift", "mixed", "decode", "shift_to_decode")


def test_ttft_misses_move_the_far_specialist_back_to_mixed_first():
    # one step along the ladder prefill - mixed - decode: a decode-duty worker returns to mixed
    assert shift(hybrid({"decode": 2, "mixed": 1}, ttft=0.6))[0] == ("shift", "decode", "mixed", "shift_to_prefill")
    assert shift(hybrid({"mixed": 2}, ttft=0.6))[0] == ("shift", "mixed", "prefill", "shift_to_prefill")
    assert shift(hybrid({"prefill": 2, "decode": 1}, tpot=0.6))[0] == ("shift", "prefill", "mixed", "shift_to_decode")


def test_no_shift_that_leaves_the_other_phase_without_a_worker_then_a_process_is_added():
    # the last prefill-capable worker is mixed: it cannot take decode duty, so a mixed worker is added
    d, _ = decide(hybrid({"mixed": 1, "decode": 2}, tpot=0.6), CONFIG)
    assert (d.action, d.pool) == ("add", "mixed")
    d, _ = decide(hybrid({"mixed": 1, "prefill": 1}, ttft=0.6), CONFIG)
    assert (d.action, d.pool) == ("add", "mixed")
    # a prefill specialist may go back to mixed: it still prefills
    assert shift(hybrid({"prefill": 1, "decode": 1}, tpot=0.6))[0] == ("shift", "prefill", "mixed", "shift_to_decode")
    # one worker alone cannot be split into phases
    assert decide(hybrid({"mixed": 1}, tpot=0.6), CONFIG)[0].action == "add"


def test_no_shift_without_hybrid_workers_or_when_the_slo_is_met():
    s = ClusterState(now=100, pools={"mixed": PoolState(3, busy=0.9)}, finished=20, attainment=0.6,
                     ttft_attainment=0.6)  # colocated: no duties
    assert decide(s, CONFIG)[0].action == "add"
    assert decide(hybrid({"mixed": 3}, attainment=0.95), CONFIG)[0].action == "hold"
    assert decide(hybrid({"mixed": 3}, tpot=0.6, finished=3), CONFIG)[0].action == "hold"  # too few requests


def test_a_steady_overload_walks_the_ladder_and_stops_it_does_not_oscillate():
    """Under a TPOT-bound load that shifting does not fix, duties move toward decode until no
    shift is left (one prefill-capable worker stays), then a process is added (it joins as
    mixed) and shifts on, up to the max; never a shift back."""
    duties = {"prefill": 0, "mixed": 2, "decode": 0}
    memory = RuleMemory()
    actions = []
    for i in range(200):  # 1,000 s at one decision every 5 s
        d, memory = decide(hybrid(dict(duties), now=100.0 + 5 * i, tpot=0.6), CONFIG, memory)
        if d.action == "shift":
            duties[d.source] -= 1
            duties[d.pool] += 1
        elif d.action == "add":
            duties["mixed"] += 1
        if d.action != "hold":
            actions.append((d.action, d.source, d.pool))
    assert actions == [("shift", "mixed", "decode"), ("add", None, "mixed"), ("shift", "mixed", "decode"),
                       ("add", None, "mixed"), ("shift", "mixed", "decode")]
    assert duties == {"prefill": 0, "mixed": 1, "decode": 3}


# ---------------------------------------------------------------- duties back to mixed (relax)


def light(duties, *, now, busy=0.2, load=0.0, attainment=1.0, finished=20) -> ClusterState:
    n = sum(duties.values())
    return ClusterState(now=now, pools={"mixed": PoolState(n, busy=busy, load=load)}, finished=finished,
                        attainment=attainment, duties=duties)


def run(states, config=CONFIG, memory=None):
    """The decisions for `states`, in order, with one memory."""
    memory = memory or RuleMemory()
    out = []
    for s in states:
        d, memory = decide(s, config, memory)
        out.append(d)
    return out, memory


def test_a_specialist_relaxes_to_mixed_once_the_load_falls():
    # 2 workers 0.2 busy: 0.4 with one fewer (< 0.5), attainment 1.0; the pool is at its minimum
    # (min 2) so no process could leave, the duty relaxes all the same after down_stable intervals
    config = AutoscaleConfig(min_workers={"mixed": 2}, max_workers={"mixed": 4}, cooldown_s=20, interval_s=5)
    got, memory = run([light({"mixed": 1, "decode": 1}, now=100 + 5 * i) for i in range(3)], config)
    assert [d.code for d in got] == ["steady", "steady", "relax_to_mixed"]
    d = got[-1]
    assert (d.action, d.source, d.pool) == ("shift", "decode", "mixed")
    assert "from decode back to mixed duty" in d.reason and "decode 1" in d.reason
    assert memory.last_change_at == 110 and memory.quiet == 0  # a change: the cooldown follows, the count restarts
    # a relaxed worker is not shifted back at once: misses within the cooldown hold
    assert decide(hybrid({"mixed": 2}, now=120, tpot=0.6), config, memory)[0].code == "cooldown"
    # the far specialist with more workers first; decode on a tie (at the minimum: relaxed)
    at_min = AutoscaleConfig(min_workers={"mixed": 3}, max_workers={"mixed": 4}, cooldown_s=20, interval_s=5)
    d = run([light({"prefill": 2, "decode": 1}, now=5 * i) for i in range(3)], at_min)[0][-1]
    assert (d.code, d.source) == ("relax_to_mixed", "prefill")
    d = run([light({"prefill": 1, "mixed": 1, "decode": 1}, now=5 * i) for i in range(3)], at_min)[0][-1]
    assert (d.code, d.source) == ("relax_to_mixed", "decode")


def test_above_its_minimum_the_pool_loses_the_specialist_itself():
    # min 1: the same light loads remove a specialist in one change instead of relaxing it
    d = run([light({"prefill": 2, "decode": 1}, now=5 * i) for i in range(3)])[0][-1]
    assert (d.action, d.pool, d.source, d.code) == ("remove", "mixed", "prefill", "idle_specialist")
    assert "a hybrid worker of prefill duty leaves" in d.reason
    d = run([light({"prefill": 1, "mixed": 1, "decode": 1}, now=5 * i) for i in range(3)])[0][-1]
    assert (d.action, d.source, d.code) == ("remove", "decode", "idle_specialist")
    # not one whose removal leaves a phase without a worker: then the duty relaxes
    d = run([light({"prefill": 1, "decode": 1}, now=5 * i) for i in range(3)])[0][-1]
    assert (d.action, d.source, d.code) == ("shift", "decode", "relax_to_mixed")


def test_no_relax_while_the_load_holds():
    """The conditions a shift toward decode came from keep its duty: each of them alone blocks
    the relax for 10 minutes (attainment in the dead band, a busy pool, a load per worker the
    load trigger would read as rising, a draining worker, no specialist)."""
    loaded_config = AutoscaleConfig(min_workers={"mixed": 1}, max_workers={"mixed": 4}, cooldown_s=20, interval_s=5,
                                    up_load=4.0)
    cases = [(CONFIG, {"attainment": 0.95}),  # met, but not comfortably (under down_attainment 0.97)
             (CONFIG, {"busy": 0.3}),  # 0.6 busy with one worker fewer
             (loaded_config, {"load": 1.5}),  # 3 in flight per worker with one fewer (>= 4 * 0.5)
             ]
    for config, kw in cases:
        got, _ = run([light({"mixed": 1, "decode": 1}, now=5.0 * i, **kw) for i in range(120)], config)
        assert {d.action for d in got} == {"hold"}, kw
    s = light({"mixed": 1, "decode": 1}, now=0)
    draining = ClusterState(**{**s.__dict__, "pools": {"mixed": PoolState(2, draining=1, busy=0.2)}})
    assert {d.action for d in run([ClusterState(**{**draining.__dict__, "now": 5.0 * i}) for i in range(120)])[0]} \
        == {"hold"}
    # all mixed: nothing to relax, the scale-down goes on as before
    assert run([light({"mixed": 3}, now=5.0 * i) for i in range(3)])[0][-1].code == "idle"


def test_specialists_leave_before_any_mixed_worker():
    """Down from a past peak (1 mixed, 2 decode-duty, 1 prefill-duty) at a light steady load:
    the specialists leave first, one per decision (one change each, not a relax and a removal),
    then mixed workers to the minimum; no phase is left without a worker on the way."""
    duties = {"prefill": 1, "mixed": 1, "decode": 2}
    memory = RuleMemory()
    changes = []
    for i in range(200):
        n = sum(duties.values())
        d, memory = decide(light(dict(duties), now=5.0 * i, busy=0.3 / n), CONFIG, memory)
        if d.action == "shift":
            duties[d.source] -= 1
            duties[d.pool] += 1
        elif d.action == "remove":
            duties[d.source or "mixed"] -= 1
        assert duties["prefill"] + duties["mixed"] > 0 and duties["decode"] + duties["mixed"] > 0
        if d.action != "hold":
            changes.append((d.action, d.source, d.code, 5.0 * i))
    assert [c[:3] for c in changes] == [("remove", "decode", "idle_specialist"),
                                        ("remove", "decode", "idle_specialist"),
                                        ("remove", "prefill", "idle_specialist")]
    assert duties == {"prefill": 0, "mixed": 1, "decode": 0}
    gaps = [b[3] - a[3] for a, b in zip(changes, changes[1:])]
    assert min(gaps) >= CONFIG.cooldown_s  # one change per decision, the cooldown after each


def hybrid_model(load: float, duties: dict[str, int]) -> ClusterState:
    """A steady decode-heavy load (70% of the work decode) on hybrid workers: each serves 1
    unit; a mixed worker gives half to each phase. Above 0.8 of its capacity a phase misses its
    SLO in proportion (prefill the TTFT, decode the TPOT); the pool is busy load / workers."""
    n = sum(duties.values())
    cap = {"prefill": duties.get("prefill", 0) + duties.get("mixed", 0) / 2,
           "decode": duties.get("decode", 0) + duties.get("mixed", 0) / 2}
    demand = {"prefill": 0.3 * load, "decode": 0.7 * load}
    miss = {p: min(1.0, max(0.0, (demand[p] / cap[p] - 0.8) * 2)) if cap[p] else 1.0 for p in cap}
    ttft, tpot = 1 - miss["prefill"], 1 - miss["decode"]
    return ttft, tpot, ClusterState(now=0, pools={"mixed": PoolState(n, busy=min(1.0, load / n))}, finished=20,
                                    attainment=ttft * tpot, ttft_attainment=ttft, tpot_attainment=tpot,
                                    duties=dict(duties))


@pytest.mark.parametrize("load", [0.4, 1.4, 2.0, 3.0])
@pytest.mark.parametrize("start", [{"mixed": 2}, {"prefill": 1, "mixed": 1, "decode": 2}])
def test_a_steady_load_on_hybrid_workers_settles(load, start):
    """The rule in a loop with the model: from two mixed workers, or from a past peak's duties,
    a steady load shifts, relaxes, adds or removes what it needs and then holds; no change is
    undone (a shift toward a phase is never followed by a relax of that duty, nor a relax by a
    shift back)."""
    duties = {"prefill": 0, "mixed": 0, "decode": 0, **start}
    memory = RuleMemory()
    history = []
    for i in range(300):  # 25 minutes
        _, _, s = hybrid_model(load, duties)
        d, memory = decide(ClusterState(**{**s.__dict__, "now": 5.0 * i}), CONFIG, memory)
        if d.action == "shift":
            duties[d.source] -= 1
            duties[d.pool] += 1
        elif d.action == "add":
            duties["mixed"] += 1
        elif d.action == "remove":
            duties[d.source or "mixed"] -= 1
        history.append((d.action, d.code))
    changes = [h for h in history if h[0] != "hold"]
    assert history[-100:] == [("hold", history[-1][1])] * 100, changes  # settled
    codes = [c for _, c in changes]
    towards = [c for c in codes if c.startswith("shift_to")]
    # never both ways: shifts toward a phase and relaxes (or removals) do not alternate
    assert not (towards and ("relax_to_mixed" in codes or "idle" in codes)) or start != {"mixed": 2}, changes
    if "relax_to_mixed" in codes and towards:  # from a past peak: relax first, then shift as the load needs, once
        last_relax = max(i for i, c in enumerate(codes) if c == "relax_to_mixed")
        assert all(i > last_relax for i, c in enumerate(codes) if c.startswith("shift_to")), changes
    ttft, tpot, _ = hybrid_model(load, duties)
    assert ttft * tpot >= CONFIG.target_attainment or sum(duties.values()) == CONFIG.max_workers["mixed"], duties
    if "idle" in codes:  # mixed workers leave only once no specialist is left
        first_remove = codes.index("idle")
        assert not {"relax_to_mixed", "idle_specialist"} & set(codes[first_remove:]), changes


def test_a_shift_is_not_undone_by_the_next_one_a_process_is_added_instead():
    # the last change shifted a worker to decode; now the TTFT misses: the workers are too few
    # for both phases, so a mixed worker is added rather than the duty swapped back
    _, memory = decide(hybrid({"mixed": 2, "decode": 1}, now=100, tpot=0.6), CONFIG)
    assert memory.shifted_to == "decode"
    d, memory = decide(hybrid({"mixed": 1, "decode": 2}, now=130, ttft=0.6), CONFIG, memory)
    assert (d.action, d.pool) == ("add", "mixed") and memory.shifted_to is None
    # after another change (the addition), shifts toward either phase are open again
    d, _ = decide(hybrid({"mixed": 2, "decode": 2}, now=160, ttft=0.6), CONFIG, memory)
    assert (d.action, d.source, d.pool) == ("shift", "decode", "mixed")
