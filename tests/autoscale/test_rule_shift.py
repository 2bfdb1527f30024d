"""The rule's role shifts: hybrid workers change duty toward the bound phase instead of a new process."""

from __future__ import annotations

from launcher.autoscale.rule import AutoscaleConfig, ClusterState, PoolState, RuleMemory, decide

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
