"""The simulator's pieces on small cases whose answers are worked out by hand in the comments."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Link, Topology
from pdserve.sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from pdserve.sim.events import EventLoop
from pdserve.sim.fluid import Flow, FluidResource
from pdserve.sim.run import Arrival, simulate, to_record
from pdserve.sim.worker import FINISHED, WAITING, SimRequest, SimWorker, StepCosts


def flat_profile(prefill_s: float = 0.1, decode_s: float = 0.01, *, kv_bytes_per_token: int = 1024,
                 prefill_tokens=(1, 2), prefill_times=None, block_size: int = 4) -> Profile:
    return Profile(
        hardware="test", device="cpu", model="test", dtype="float32", num_layers=4,
        kv_bytes_per_token=kv_bytes_per_token, block_size=block_size, max_num_batched_tokens=16,
        prefill_tokens=tuple(prefill_tokens), prefill_times=tuple(prefill_times or (prefill_s,) * len(prefill_tokens)),
        decode_batch_sizes=(1, 2), decode_contexts=(1, 2), decode_times=((decode_s, decode_s), (decode_s, decode_s)),
    )


# ---------------------------------------------------------------- links


def test_one_link_two_flows_share_it_fairly():
    # 8 Gbit/s = 1e9 B/s. A (1e9 B) starts at 0 alone: 0.25e9 B sent by 0.25, when B (0.5e9 B)
    # joins; both get 0.5e9 B/s, so B ends at 0.25 + 1.0 = 1.25 having sent 0.5e9; A has
    # 1e9 - 0.25e9 - 0.5e9 = 0.25e9 left at the full 1e9 B/s: it ends at 1.5.
    loop = EventLoop()
    link = FluidResource(loop, 8e9 / 8, "a->b")
    ends: dict[str, float] = {}
    a = Flow(1e9, lambda f: ends.__setitem__("a", loop.now))
    b = Flow(0.5e9, lambda f: ends.__setitem__("b", loop.now))
    loop.at(0.0, lambda _: link.add(a))
    loop.at(0.25, lambda _: link.add(b))
    loop.at(0.5, lambda _: ends.__setitem__("rates_at_0.5", (a.rate, b.rate)))
    loop.run()
    assert ends["rates_at_0.5"] == (0.5e9, 0.5e9)
    assert ends["b"] == pytest.approx(1.25, abs=1e-12)
    assert ends["a"] == pytest.approx(1.5, abs=1e-12)
    assert link.peak_flows == 2 and not link.flows


def test_a_capped_flow_leaves_its_unused_share_to_the_other():
    # 1e9 B/s; a flow capped at 0.2e9 B/s (a prefill producing KV that slowly) and an uncapped one:
    # water-filling gives 0.2e9 and 0.8e9. The uncapped 0.8e9 B ends at 1.0; the capped one then
    # is alone but still capped: its 0.5e9 B take 0.5e9 / 0.2e9 = 2.5 s in all.
    loop = EventLoop()
    link = FluidResource(loop, 1e9)
    ends = {}
    capped = Flow(0.5e9, lambda f: ends.__setitem__("capped", loop.now), cap=0.2e9)
    free = Flow(0.8e9, lambda f: ends.__setitem__("free", loop.now))
    link.add(capped)
    link.add(free)
    assert (capped.rate, free.rate) == (0.2e9, 0.8e9)
    loop.run()
    assert ends["free"] == pytest.approx(1.0, abs=1e-12)
    assert ends["capped"] == pytest.approx(2.5, abs=1e-12)


def test_a_host_with_fewer_cores_than_busy_workers_stretches_every_step():
    # 2 cores, 4 one-thread steps of 1 core-second each: each gets half a core, all end at 2.0.
    loop = EventLoop()
    host = FluidResource(loop, 2.0)
    ends = []
    for _ in range(4):
        host.add(Flow(1.0, lambda f: ends.append(loop.now), cap=1.0))
    loop.run()
    assert ends == pytest.approx([2.0] * 4)


def test_a_fluid_resource_rejects_a_zero_capacity():
    with pytest.raises(ValueError, match="capacity must be > 0"):
        FluidResource(EventLoop(), 0.0, "slow")


# ---------------------------------------------------------------- a worker that must preempt


def test_a_worker_that_runs_out_of_blocks_preempts_the_last_admitted_request():
    # block_size 4, 4 blocks (16 tokens), budget 16. A and B: 4-token prompts, max_tokens 8.
    # Step 1: both prefilled (1 block each), chunk cost 0.1 each -> ends 0.2; each samples 1 token.
    # Steps k = 2..: each decode needs blocks for k + 3 tokens: 2 blocks from step 2 (both fit:
    # 4 of 4 used), 3 blocks at step 6 for A: nothing free, so B (admitted last) is preempted
    # (its 2 blocks freed, 5 tokens generated so far kept) and A takes one; B's 9 tokens need
    # 3 blocks, only 1 is free: it waits. Steps of 0.01 s: A's tokens at 0.20 .. 0.27, A ends at
    # step 8 (0.27) and frees 3 blocks; step 9 recomputes B's 9 tokens (one chunk, 0.1 s ->
    # 0.37, token 6), steps 10, 11 -> 0.38, 0.39.
    loop = EventLoop()
    worker = SimWorker(loop, "w", "mixed", num_blocks=4, block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=8, costs=StepCosts(flat_profile()))
    times: dict[str, list[float]] = {"a": [], "b": []}
    worker.on_token = lambda w, r, now: times[r.request_id].append(now)
    a = SimRequest(0, 0.0, 4, 8, request_id="a")
    b = SimRequest(1, 0.0, 4, 8, request_id="b")
    worker.add(a)
    worker.add(b)
    loop.run()
    assert times["a"] == pytest.approx([0.20, 0.21, 0.22, 0.23, 0.24, 0.25, 0.26, 0.27])
    assert times["b"] == pytest.approx([0.20, 0.21, 0.22, 0.23, 0.24, 0.37, 0.38, 0.39])
    assert (a.num_preemptions, b.num_preemptions, worker.num_preemptions) == (0, 1, 1)
    assert a.status == b.status == FINISHED and worker.num_free_blocks == 4
    assert worker.num_steps == 11


def test_a_request_preempting_itself_ends_the_pass():
    # One 4-token request alone with 1 block: after its first token it needs a second block,
    # preempts itself (the last admitted) and goes back to waiting, where 5 tokens never fit.
    loop = EventLoop()
    worker = SimWorker(loop, "w", "mixed", num_blocks=1, block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=8, costs=StepCosts(flat_profile()))
    r = SimRequest(0, 0.0, 4, 3)
    worker.add(r)
    loop.run()
    assert r.num_output_tokens == 1 and r.status == WAITING and r.num_preemptions == 1
    assert worker.num_free_blocks == 1 and not worker.running


def test_chunked_prefill_respects_the_token_budget():
    # budget 16, a 40-token prompt: chunks of 16, 16, 8; with prefill P(n) = n / 100 s
    # (the profile (1, 0.01), (100, 1.0): linear through the origin), the chunks cost P(16), P(32) - P(16),
    # P(40) - P(32):
    # 0.16 + 0.16 + 0.08 = 0.40 s to the first token.
    loop = EventLoop()
    profile = flat_profile(prefill_tokens=(1, 100), prefill_times=(0.01, 1.0))
    batches = []

    class Spy(SimWorker):
        def schedule(self, ahead=0):
            batch, preempted = super().schedule(ahead)
            batches.append([(n, round(self.step_seconds(batch), 9)) for _, n in batch])
            return batch, preempted

    worker = Spy(loop, "w", "mixed", num_blocks=64, block_size=4, max_num_batched_tokens=16,
                 max_num_seqs=8, costs=StepCosts(profile))
    tokens = []
    worker.on_token = lambda w, req, now: tokens.append(now)
    worker.add(SimRequest(0, 0.0, 40, 1))
    loop.run()
    assert batches == [[(16, 0.16)], [(16, 0.16)], [(8, 0.08)]]
    assert tokens == pytest.approx([0.40])


# ---------------------------------------------------------------- end to end


def _pd_config(gbps: float, *, latency_ms: float = 0.0, rpc_s: float = 0.0, decode_s: float = 0.1) -> ClusterConfig:
    # prefill P(n) = n / 100 s; KV 1e6 B per token; decode steps 0.1 s
    profile = flat_profile(prefill_tokens=(100, 200), prefill_times=(1.0, 2.0), decode_s=decode_s,
                           kv_bytes_per_token=1_000_000)
    topology = Topology(links=(Link("np", "nd", gbps, latency_ms),))
    return ClusterConfig(
        profile=profile, topology=topology,
        workers=(WorkerConfig("p0", "prefill", "np"), WorkerConfig("d0", "decode", "nd")),
        engine=EngineLimits(num_blocks=1000, block_size=16, max_num_batched_tokens=512, max_num_seqs=8),
        router=RouterConfig(stats_interval_s=0.5, rpc_s=rpc_s),
    )


def test_one_request_over_a_slow_link_waits_for_its_kv():
    # 100-token prompt = 1e8 B of KV. Prefill 1.0 s produces KV at 1e8 B/s; the 0.4 Gbit/s link
    # carries 5e7 B/s, so by 1.0 s half is sent and the other half takes 1.0 s more: TTFT 2.0.
    # Then D's decode steps: tokens 2 and 3 at 2.1 and 2.2; TPOT (2.2 - 2.0) / 2 = 0.1.
    run = simulate(_pd_config(0.4), "round-robin", [Arrival(0.0, 100, 3)])
    [record] = [to_record(r) for r in run.requests]
    assert record.ok
    assert record.ttft_s == pytest.approx(2.0)
    assert record.token_times_s == pytest.approx([2.0, 2.1, 2.2])
    assert record.e2e_s == pytest.approx(2.2)
    assert record.kv_bytes == 1e8 and record.kv_seconds == pytest.approx(2.0)
    assert run.decisions == {"p0->d0": 1}


def test_layer_wise_streaming_hides_a_fast_link_behind_the_prefill():
    # 8 Gbit/s = 1e9 B/s, faster than the 1e8 B/s the prefill produces: the flow keeps up with
    # the compute and ends with it at 1.0 s; the link latency (2 ms) and two RPC legs
    # (reserve, prefill call: 5 ms each before the prefill starts; the answer: 5 ms) are added:
    # TTFT = 0.010 + 1.0 + 0.002 + 0.005 = 1.017; D's commit is one more leg (5 ms), then 0.1 s steps.
    run = simulate(_pd_config(8.0, latency_ms=2.0, rpc_s=0.005), "round-robin", [Arrival(0.0, 100, 2)])
    [record] = [to_record(r) for r in run.requests]
    assert record.ttft_s == pytest.approx(1.017)
    assert record.token_times_s == pytest.approx([1.017, 1.122])


def test_front_s_delays_the_placement_and_adds_to_ttft_only():
    # front_s = 0.03: the request is placed at 0.03 instead of 0, so every token is 0.03 later
    # than in the layer-wise streaming case above (TTFT 1.017 + 0.03); the client's send time,
    # and so the TPOT, are unchanged; a local (colocated) request is delayed the same way.
    config = _pd_config(8.0, latency_ms=2.0, rpc_s=0.005)
    config = replace(config, router=replace(config.router, front_s=0.03))
    [record] = [to_record(r) for r in simulate(config, "round-robin", [Arrival(0.0, 100, 2)]).requests]
    assert record.sent_s == 0.0
    assert record.token_times_s == pytest.approx([1.047, 1.152])
    colocated = ClusterConfig(profile=config.profile, workers=(WorkerConfig("m0", "mixed", "np"),),
                              mode="colocated", engine=config.engine, router=RouterConfig(front_s=0.03))
    plain = replace(colocated, router=RouterConfig())
    late, early = ([to_record(r) for r in simulate(c, "round-robin", [Arrival(0.0, 100, 2)]).requests][0]
                   for c in (colocated, plain))
    assert late.ttft_s == pytest.approx(early.ttft_s + 0.03)
    assert late.e2e_s - late.ttft_s == pytest.approx(early.e2e_s - early.ttft_s)


def test_two_requests_on_one_pair_queue_at_the_prefill_worker_and_share_the_link():
    # Both 100-token prompts arrive at 0 on one P: P's budget (512) batches them into one step
    # of two chunks, 2 x 1.0 s = 2.0 s. Both KV flows start with the step, each capped at its
    # production rate 1e8 B / 2.0 s = 5e7 B/s; the 0.8 Gbit/s link (1e8 B/s) carries both at
    # their caps: both finish with the compute at 2.0 (TTFT 2.0 each). On D both join one
    # decode batch: tokens at 2.1 (max_tokens 2).
    run = simulate(_pd_config(0.8), "round-robin", [Arrival(0.0, 100, 2), Arrival(0.0, 100, 2)])
    records = [to_record(r) for r in run.requests]
    assert [r.ttft_s for r in records] == pytest.approx([2.0, 2.0])
    assert [r.e2e_s for r in records] == pytest.approx([2.1, 2.1])


def test_network_aware_avoids_the_slow_pair_and_round_robin_does_not():
    # p0 -> d0 at 10 Gbit/s, p1 -> d0 at 0.01 Gbit/s (1e8 B take 80 s). Requests one at a time,
    # 100 s apart: round-robin alternates p0, p1; network-aware (the real policy, this profile)
    # always prices p1's transfer far above p0's and sends everything to p0.
    profile = flat_profile(prefill_tokens=(100, 200), prefill_times=(1.0, 2.0), kv_bytes_per_token=1_000_000)
    topology = Topology(links=(Link("n0", "nd", 10.0), Link("n1", "nd", 0.01)))
    config = ClusterConfig(
        profile=profile, topology=topology,
        workers=(WorkerConfig("p0", "prefill", "n0"), WorkerConfig("p1", "prefill", "n1"),
                 WorkerConfig("d0", "decode", "nd")),
        engine=EngineLimits(num_blocks=1000, block_size=16, max_num_batched_tokens=512, max_num_seqs=8),
    )
    arrivals = [Arrival(100.0 * i, 100, 2) for i in range(4)]
    rr = simulate(config, "round-robin", arrivals)
    na = simulate(config, "network-aware", arrivals)
    assert rr.decisions == {"p0->d0": 2, "p1->d0": 2}
    assert na.decisions == {"p0->d0": 4}
    slow = [to_record(r).ttft_s for r in rr.requests if r.decision.prefill == "p1"]
    assert slow == pytest.approx([80.0, 80.0])  # the whole transfer at 0.01 Gbit/s: 8e8 bit / 1e7 bit/s
    assert max(to_record(r).ttft_s for r in na.requests) == pytest.approx(1.0)


def test_a_bounded_run_records_unfinished_requests_as_cancelled():
    # the first request ends at 2.2 (above); the second, sent at 2.3, is still prefilling at 2.5
    run = simulate(_pd_config(0.4), "round-robin", [Arrival(0.0, 100, 3), Arrival(2.3, 100, 3)], max_run_time_s=2.5)
    records = [to_record(r) for r in run.requests]
    assert [r.ok for r in records] == [True, False]
    assert records[1].error == "cancelled"


def test_no_decode_worker_runs_degraded_on_the_prefill_worker():
    """As the real router does (router.placement.base rule 4): with no decode-capable worker up, a
    prefill worker runs the whole request; its tokens are all generated there."""
    config = ClusterConfig(profile=flat_profile(), workers=(WorkerConfig("p0", "prefill"),))
    result = simulate(config, "least-loaded", [Arrival(0.0, 10, 2)])
    [request] = result.requests
    assert request.decision.degraded and request.decision.decode == "p0"
    record = to_record(request)
    assert record.ok and record.num_output_tokens == 2


def test_simulation_is_deterministic():
    config = _pd_config(0.4)
    arrivals = [Arrival(0.3 * i, 50 + 7 * i, 4) for i in range(30)]
    a = [to_record(r) for r in simulate(config, "least-loaded", arrivals).requests]
    b = [to_record(r) for r in simulate(config, "least-loaded", arrivals).requests]
    assert a == b and all(r.ok for r in a)
    assert not math.isnan(sum(r.e2e_s for r in a))


def test_every_block_comes_back_after_disaggregated_and_local_runs():
    # P's blocks (freed when the KV is handed off) and D's reservation (taken over at commit)
    # are separate: a run of many requests, some local (network-aware on a slow link), ends
    # with every block of every worker free.
    config = _pd_config(0.4)
    arrivals = [Arrival(0.2 * i, 40 + 13 * (i % 7), 1 + i % 5) for i in range(40)]
    for policy in ("round-robin", "network-aware"):
        run = simulate(config, policy, arrivals)
        assert all(to_record(r).ok for r in run.requests)
        assert run.free_blocks == {"p0": (1000, 1000), "d0": (1000, 1000)}


def _hybrid_config(gbps: float) -> ClusterConfig:
    # two mixed workers that also move KV (a hybrid cluster: router mode disaggregated, every
    # worker mixed); the profile and the link of `_pd_config`, in both directions
    profile = flat_profile(prefill_tokens=(100, 200), prefill_times=(1.0, 2.0), decode_s=0.1,
                           kv_bytes_per_token=1_000_000)
    topology = Topology(links=(Link("n0", "n1", gbps), Link("n1", "n0", gbps)))
    return ClusterConfig(
        profile=profile, topology=topology,
        workers=(WorkerConfig("w0", "mixed", "n0"), WorkerConfig("w1", "mixed", "n1")),
        engine=EngineLimits(num_blocks=1000, block_size=16, max_num_batched_tokens=512, max_num_seqs=8),
    )


def test_a_mixed_worker_prefilling_for_another_hands_the_kv_off():
    # Round-robin pairs two mixed workers as (P, D) = (w1, w0), then (w0, w1). A request split
    # over them runs as on a prefill and a decode worker (the first test above): P's prefill
    # 1.0 s streams half of the 1e8 B over the 0.4 Gbit/s link by then, the rest takes 1.0 s
    # more: TTFT 2.0; D decodes tokens 2 and 3 at 2.1 and 2.2. P samples none of them. The
    # second request, sent at 10, goes the other way with the same times.
    config = _hybrid_config(0.4)
    run = simulate(config, "round-robin", [Arrival(0.0, 100, 3), Arrival(10.0, 100, 3)])
    records = [to_record(r) for r in run.requests]
    assert run.decisions == {"w1->w0": 1, "w0->w1": 1}
    assert [r.ok for r in records] == [True, True]
    assert [r.ttft_s for r in records] == pytest.approx([2.0, 2.0])
    assert [r.token_times_s for r in records] == [pytest.approx([2.0, 2.1, 2.2])] * 2
    assert [r.num_output_tokens for r in records] == [3, 3]
    assert [r.kv_seconds for r in records] == pytest.approx([2.0, 2.0])
    assert run.free_blocks == {"w0": (1000, 1000), "w1": (1000, 1000)}


def test_network_aware_in_a_hybrid_cluster_models_the_load_from_the_simulated_clock():
    # The hybrid model (router.placement.policies.split) estimates the arrival rate from the snapshots'
    # `now`: 20 requests 2 s apart are 0.5 req/s on the simulated clock (0.58 as its window
    # estimates it). The first 7 arrivals give no estimate (local). Then, at 0.5 req/s: all local, each worker
    # prefills 1.0 s at
    # 0.25 req/s (duty 0.25), TPOT 0.1 / 0.75 = 0.133 s against the SLO's 0.15 (score 0.89);
    # split, the decode worker's TPOT is 0.1 s (score 0.67, TTFT ~1.6 s of the 5 s allowed),
    # better by more than the 10% hysteresis: one worker prefills, the other decodes. Each split
    # request: the 8 Gbit/s link outruns the KV the 1.0 s prefill produces, so the transfer
    # ends with the compute (TTFT 1.0) and D decodes tokens 2 and 3 at 1.1 and 1.2.
    config = replace(_hybrid_config(8.0), router=RouterConfig(policy_options={
        "network-aware": {"slo_ttft": 5.0, "slo_tpot": 0.15}}))
    run = simulate(config, "network-aware", [Arrival(2.0 * i, 100, 3) for i in range(20)])
    assert all(to_record(r).ok for r in run.requests)
    kinds = [r.decision.kind for r in run.requests]
    assert kinds == ["local"] * 7 + ["disaggregated"] * 13
    assert run.decisions == {"local": 7, "w0->w1": 13}  # the prefilling worker stays while k does
    split = [to_record(r) for r in run.requests[7:]]
    assert all(r.token_times_s == pytest.approx([1.0, 1.1, 1.2]) for r in split)
    assert run.free_blocks == {"w0": (1000, 1000), "w1": (1000, 1000)}


def test_a_repeated_prompt_hits_the_prefix_cache_of_the_worker_that_computed_it():
    # One mixed worker, P(n) = n / 100 s, decode steps 0.01 s, blocks of 16. A 200-token prompt
    # computes in one step of 2.0 s (TTFT 2.0). The same prompt (key "a") again at 10: its 12
    # full blocks are cached, but 200 = 12.5 blocks, so 192 tokens hit and 8 are computed:
    # max(P(200) - P(192), D(1, 200)) = max(0.08, 0.01) = 0.08 s. Another prompt (key "b") at
    # 20 misses: 2.0 s again. A request without a key is never cached (at 30: 2.0 s).
    profile = flat_profile(prefill_tokens=(100, 200), prefill_times=(1.0, 2.0), decode_s=0.01)
    config = ClusterConfig(profile=profile, workers=(WorkerConfig("w0", "mixed"),), mode="colocated",
                           engine=EngineLimits(num_blocks=1000, block_size=16, max_num_batched_tokens=512))
    arrivals = [Arrival(0.0, 200, 2, prefix_key="a"), Arrival(10.0, 200, 2, prefix_key="a"),
                Arrival(20.0, 200, 2, prefix_key="b"), Arrival(30.0, 200, 2), Arrival(40.0, 200, 2)]
    run = simulate(config, "round-robin", arrivals)
    assert [to_record(r).ttft_s for r in run.requests] == pytest.approx([2.0, 0.08, 2.0, 2.0, 2.0])
    assert run.free_blocks == {"w0": (1000, 1000)}


def test_a_prefill_worker_with_a_cached_prompt_still_sends_all_of_its_kv():
    # `_pd_config(0.4)`: the 100-token prompt's 1e8 B of KV over a 5e7 B/s link. Uncached, as in
    # the first end-to-end test: TTFT 2.0. Cached on P (96 tokens hit, 4 computed in one step of
    # max(P(100) - P(96), D(1, 100)) = 0.1 s): the whole 1e8 B is ready with that step and the
    # link carries it in 2.0 s: TTFT 2.0 again. A 0.8 Gbit/s link (1e8 B/s) halves it: 1.0.
    for gbps, ttfts in ((0.4, [2.0, 2.0]), (0.8, [1.0, 1.0])):
        run = simulate(_pd_config(gbps), "round-robin",
                       [Arrival(0.0, 100, 2, prefix_key="a"), Arrival(10.0, 100, 2, prefix_key="a")])
        assert [to_record(r).ttft_s for r in run.requests] == pytest.approx(ttfts)
    # with a 8 Gbit/s link the compute bounds it: uncached the 1.0 s prefill; cached the 0.1 s step
    run = simulate(_pd_config(8.0), "round-robin",
                   [Arrival(0.0, 100, 2, prefix_key="a"), Arrival(10.0, 100, 2, prefix_key="a")])
    assert [to_record(r).ttft_s for r in run.requests] == pytest.approx([1.0, 0.1])


def test_the_prefix_cache_evicts_the_least_recently_used_prompt_beyond_the_workers_blocks():
    # 20 blocks of 16; each 200-token prompt caches 12 full blocks. "a" then "b" make 24 > 20:
    # "a" is evicted. "b" again hits (0.08 s, as above), "a" again misses (2.0 s).
    profile = flat_profile(prefill_tokens=(100, 200), prefill_times=(1.0, 2.0), decode_s=0.01)
    config = ClusterConfig(profile=profile, workers=(WorkerConfig("w0", "mixed"),), mode="colocated",
                           engine=EngineLimits(num_blocks=20, block_size=16, max_num_batched_tokens=512))
    keys = ["a", "b", "b", "a"]
    run = simulate(config, "round-robin", [Arrival(10.0 * i, 200, 2, prefix_key=k) for i, k in enumerate(keys)])
    assert [to_record(r).ttft_s for r in run.requests] == pytest.approx([2.0, 2.0, 0.08, 2.0])


def test_the_simulator_feeds_outcomes_to_the_policy(monkeypatch):
    # The run of the test above, with its policy kept: each finished request reaches
    # observe_outcome, as in the real router. The simulated serving path is the profile's
    # (one 1.0 s chunk, no overhead): the prefill factor learned from the split requests is 1,
    # and the TPOT of the split ones is the 0.1 s decode step the model predicted. The request
    # that switched the cluster to the split is placed before the local ones drain: not learned
    # from (19 of 20); the TTFT residuals learn once the prefill factor is in use (4 samples).
    import pdserve.sim.run as sim_run

    policies = []
    build = sim_run.build_sim_policy
    monkeypatch.setattr(sim_run, "build_sim_policy", lambda *a, **kw: policies.append(build(*a, **kw)) or policies[-1])
    config = replace(_hybrid_config(8.0), router=RouterConfig(policy_options={
        "network-aware": {"slo_ttft": 5.0, "slo_tpot": 0.15}}))
    simulate(config, "network-aware", [Arrival(2.0 * i, 100, 3) for i in range(20)])
    [policy] = policies
    cal = policy.calibration
    assert cal.num_outcomes == 19 and cal.num_pending == 0 and cal.epoch == 1
    assert cal.ratios["prefill"].samples == 12 and cal.factor("prefill") == pytest.approx(1.0)
    assert cal.ratios["tpot.disaggregated"].samples == 12 and cal.factor("tpot.disaggregated") == pytest.approx(1.0)
    assert cal.ratios["split.ttft.split"].samples == 8 and cal.ratios["ttft.local"].samples == 7
