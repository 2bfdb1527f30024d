"""Overlapped decode steps in the simulated worker (EngineLimits.overlap_steps), hand-checked:
a request arriving during a decode-only step launched with nothing waiting waits for the step
launched behind it too, as on the engine (pdserve/engine.py, `_can_launch_ahead`)."""

from __future__ import annotations

import pytest

from pdserve.router.placement.profiles import Profile
from pdserve.sim.events import EventLoop
from pdserve.sim.worker import SimRequest, SimWorker, StepCosts

# prefill P(n) = n / 100 s; decode steps 0.01 s at any batch and context
PROFILE = Profile(
    hardware="test", device="cpu", model="test", dtype="float32", num_layers=4, kv_bytes_per_token=1024,
    block_size=4, max_num_batched_tokens=16, prefill_tokens=(1, 100), prefill_times=(0.01, 1.0),
    decode_batch_sizes=(1, 2), decode_contexts=(1, 2), decode_times=((0.01, 0.01), (0.01, 0.01)),
)


def run(overlap: bool, a_max_tokens: int = 10, b_at: float = 0.045) -> tuple[list[list[int]], dict[str, list[float]]]:
    """A (4-token prompt) at 0, B (8-token prompt, 2 tokens) at `b_at`: each step's new tokens
    and each request's token times."""
    loop = EventLoop()
    steps: list[list[int]] = []

    class Spy(SimWorker):
        def schedule(self, ahead=0):
            batch, preempted = super().schedule(ahead)
            steps.append([n for _, n in batch])
            return batch, preempted

    worker = Spy(loop, "w", "mixed", num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                 costs=StepCosts(PROFILE), overlap_steps=overlap)
    times: dict[str, list[float]] = {"a": [], "b": []}
    worker.on_token = lambda w, r, now: times[r.request_id].append(now)
    worker.add(SimRequest(0, 0.0, 4, a_max_tokens, request_id="a"))
    loop.at(b_at, lambda _: worker.add(SimRequest(1, b_at, 8, 2, request_id="b")))
    loop.run()
    return steps, times


def test_an_arrival_waits_for_the_step_launched_ahead():
    # A's prefill 0 -> 0.04 (P(4)); decode-only steps of A from 0.04, 0.01 each. B arrives at
    # 0.045, during the step 0.04 -> 0.05, which started with nothing waiting:
    # - without overlap B joins the next step, 0.05 -> 0.05 + P(8) + D = 0.05 + 0.08 + 0.01 = 0.14;
    # - with it the step 0.05 -> 0.06 was launched behind, A alone, and B joins the one after:
    #   0.06 -> 0.15, one decode step (0.01) later.
    steps, times = run(overlap=False)
    assert steps[:3] == [[4], [1], [1, 8]]
    assert times["b"][0] == pytest.approx(0.14)
    steps, times = run(overlap=True)
    assert steps[:4] == [[4], [1], [1], [1, 8]]
    assert times["b"][0] == pytest.approx(0.15)
    # A's tokens are unchanged by the overlap up to B's arrival: 0.04, 0.05, 0.06
    assert times["a"][:3] == pytest.approx([0.04, 0.05, 0.06])


def test_no_step_is_launched_ahead_of_one_that_ends_a_request_by_length():
    # A has 2 tokens: its first at 0.04, its last at 0.05 from the step 0.04 -> 0.05, which ends
    # it by length, so nothing is launched behind it: B (at 0.045) starts at 0.05 either way,
    # alone: P(8) = 0.08 -> first token at 0.13
    for overlap in (False, True):
        steps, times = run(overlap=overlap, a_max_tokens=2)
        assert steps[:3] == [[4], [1], [8]], overlap
        assert times["b"][0] == pytest.approx(0.13)


def test_a_step_with_a_chunk_launches_nothing_ahead():
    # B arrives during A's prefill (0 -> 0.04): that step is not decode-only, so B joins the next
    # step with or without overlap: 0.04 -> 0.04 + P(8) + D = 0.13
    for overlap in (False, True):
        steps, times = run(overlap=overlap, b_at=0.02)
        assert steps[:2] == [[4], [1, 8]], overlap
        assert times["b"][0] == pytest.approx(0.13)
