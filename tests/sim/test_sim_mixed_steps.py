"""Simulated steps that carry decodes and prefill chunks together: priced by the profile's mixed
table when it has one, as chunk + decode sums otherwise. Every figure is worked out in the comments."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.router.placement.profiles import Profile
from pdserve.sim.config import scale_profile
from pdserve.sim.events import EventLoop
from pdserve.sim.worker import SimRequest, SimWorker, StepCosts

# prefill P(n) = n / 100 s (linear through the origin); decode steps 0.01 s at any batch and context
BASE = Profile(
    hardware="test", device="cpu", model="test", dtype="float32", num_layers=4, kv_bytes_per_token=1024,
    block_size=4, max_num_batched_tokens=16, prefill_tokens=(1, 100), prefill_times=(0.01, 1.0),
    decode_batch_sizes=(1, 2), decode_contexts=(1, 2), decode_times=((0.01, 0.01), (0.01, 0.01)),
)
# one decode + a chunk of 8 tokens: 0.05 s, of 16 tokens: 0.09 s (0.005 s a token between)
MIXED = replace(BASE, mixed_context=4, mixed_batch_sizes=(1,), mixed_chunk_tokens=(8, 16), mixed_times=((0.05, 0.09),))


def run_two(profile: Profile) -> tuple[list[tuple[list[int], float]], dict[str, list[float]]]:
    """A (4-token prompt, 4 tokens) and B (40-token prompt, 2 tokens) arrive together on a worker
    with a 16-token budget: (new tokens, seconds) of each step, and each request's token times."""
    loop = EventLoop()
    steps = []

    class Spy(SimWorker):
        def schedule(self, ahead=0):
            batch, preempted = super().schedule(ahead)
            steps.append(([n for _, n in batch], round(self.step_seconds(batch), 9)))
            return batch, preempted

    worker = Spy(loop, "w", "mixed", num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                 costs=StepCosts(profile))
    times: dict[str, list[float]] = {"a": [], "b": []}
    worker.on_token = lambda w, r, now: times[r.request_id].append(now)
    worker.add(SimRequest(0, 0.0, 4, 4, request_id="a"))
    worker.add(SimRequest(1, 0.0, 40, 2, request_id="b"))
    loop.run()
    return steps, times


def test_a_step_with_decodes_and_a_chunk_costs_what_the_mixed_table_says():
    # step 1: A's 4-token prompt + B's first 12 tokens, no decode: chunks as before, P(4) + P(12)
    #   = 0.04 + 0.12 = 0.16 (A's first token at 0.16);
    # step 2: A decodes + 15 tokens of B: the table at chunk 15, 0.05 + 7 x 0.005 = 0.085 (-> 0.245);
    # step 3: A decodes + B's last 13 tokens: 0.05 + 5 x 0.005 = 0.075 (-> 0.32, B's first token);
    # step 4: two decodes, 0.01 (-> 0.33: A's 4th token, B's 2nd; both finish).
    # (A's context is 5 and 6, the table's 4: the flat decode table adds 0 for the difference.)
    steps, times = run_two(MIXED)
    assert steps == [([4, 12], 0.16), ([1, 15], 0.085), ([1, 13], 0.075), ([1, 1], 0.01)]
    assert times["a"] == pytest.approx([0.16, 0.245, 0.32, 0.33])
    assert times["b"] == pytest.approx([0.32, 0.33])


def test_without_the_table_a_mixed_step_is_chunk_plus_decode_as_before():
    # step 2: chunk(12, 15) = P(27) - P(12) = 0.15, + D(1, 5) = 0.01: 0.16; step 3: P(40) - P(27)
    # = 0.13 + 0.01 = 0.14
    steps, times = run_two(BASE)
    assert steps == [([4, 12], 0.16), ([1, 15], 0.16), ([1, 13], 0.14), ([1, 1], 0.01)]
    assert times["a"] == pytest.approx([0.16, 0.32, 0.46, 0.47])


def _worker(profile: Profile) -> SimWorker:
    return SimWorker(EventLoop(), "w", "mixed", num_blocks=64, block_size=16, max_num_batched_tokens=512,
                     max_num_seqs=8, costs=StepCosts(profile))


def _seq(index: int, computed: int) -> SimRequest:
    seq = SimRequest(index, 0.0, max(computed, 1), 100)
    seq.num_computed_tokens = computed
    return seq


def test_the_step_passes_the_decodes_mean_context_and_the_chunks_total_tokens():
    # D(b, c) = 0.01 + 1e-4 (c - 100) at b = 1 and 2 for c in [100, 300]; the table is at context
    # 100: M(1, 40) = 0.03, M(2, 40) = 0.05. Two decodes at contexts 101 and 301 (mean 201) and
    # chunks of 24 and 16 tokens (40 in all): M(2, 40) + D(2, 201) - D(2, 100) = 0.05 + 0.0101
    decode = ((0.01, 0.03), (0.01, 0.03))
    profile = replace(BASE, decode_contexts=(100, 300), decode_times=decode, mixed_context=100,
                      mixed_batch_sizes=(1, 2), mixed_chunk_tokens=(40,), mixed_times=((0.03,), (0.05,)))
    worker = _worker(profile)
    batch = [(_seq(0, 100), 1), (_seq(1, 300), 1), (_seq(2, 0), 24), (_seq(3, 8), 16)]
    assert worker.step_seconds(batch) == pytest.approx(0.05 + 0.0101)
    # decodes only, chunks only: the old tables (0.01 + 1e-4 x 101 = 0.0201; P(24) + P(24) - P(8) = 0.40)
    assert worker.step_seconds(batch[:2]) == pytest.approx(0.0201)
    assert worker.step_seconds(batch[2:]) == pytest.approx(0.24 + 0.16)


def test_scale_profile_scales_the_mixed_table():
    # every step x2; prefill and decode factors leave it (time_factor 1); its own factor
    scaled = scale_profile(MIXED, time_factor=2.0)
    assert list(scaled.mixed_times[0]) == pytest.approx([0.1, 0.18]) and scaled.mixed_context == 4
    assert scale_profile(MIXED, prefill_factor=1.5, decode_factor=0.5).mixed_times == MIXED.mixed_times
    assert list(scale_profile(MIXED, mixed_factor=3.0).mixed_times[0]) == pytest.approx([0.15, 0.27])
    assert not scale_profile(BASE, time_factor=2.0).has_mixed
