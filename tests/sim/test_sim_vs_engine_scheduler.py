"""The simulated worker schedules exactly what the engine's scheduler schedules.

`pdserve.scheduler.Scheduler` and `pdserve.block_manager.BlockManager` (pure Python; the
simulator re-implements them on counters and never imports them) and `pdserve.sim.worker.SimWorker`
get the same random arrivals; every step must batch the same requests with the same numbers
of new tokens and preempt the same ones, down to tight memory where preemption is frequent.
"""

from __future__ import annotations

import random

import pytest

from pdserve.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import Scheduler
from pdserve.sequence import Sequence
from pdserve.router.placement.profiles import Profile
from pdserve.sim.events import EventLoop
from pdserve.sim.worker import SimRequest, SimWorker, StepCosts

PROFILE = Profile(
    hardware="test", device="cpu", model="test", dtype="float32", num_layers=2, kv_bytes_per_token=1,
    block_size=4, max_num_batched_tokens=32, prefill_tokens=(1,), prefill_times=(0.1,),
    decode_batch_sizes=(1,), decode_contexts=(1,), decode_times=((0.01,),),
)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [6, 12, 40])
def test_same_batches_and_preemptions_as_the_engine_scheduler(seed, num_blocks):
    rng = random.Random(seed * 100 + num_blocks)
    block_size, budget, max_seqs = 4, 32, 5
    engine = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, role="mixed"),
                       BlockManager(num_blocks, block_size, enable_prefix_caching=False))
    worker = SimWorker(EventLoop(), "w", "mixed", num_blocks=num_blocks, block_size=block_size,
                       max_num_batched_tokens=budget, max_num_seqs=max_seqs, costs=StepCosts(PROFILE))
    seqs: dict[str, Sequence] = {}
    sims: dict[str, SimRequest] = {}
    next_token = 1
    steps_with_preemption = 0
    for step in range(400):
        if len(seqs) < 40 and rng.random() < 0.3:
            rid = f"r{len(seqs)}"
            prompt = rng.randint(1, min(20, (num_blocks - 1) * block_size))
            max_tokens = rng.randint(1, 12)
            seqs[rid] = Sequence(rid, list(range(next_token, next_token + prompt)),
                                 SamplingParams(max_tokens=max_tokens))
            next_token += prompt
            engine.add(seqs[rid])
            sims[rid] = SimRequest(len(sims), 0.0, prompt, max_tokens, request_id=rid)
            worker.waiting.append(sims[rid])

        batch = engine.schedule()
        sim_batch, sim_preempted = worker.schedule()
        assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == \
            [(r.request_id, n) for r, n in sim_batch], f"step {step}"
        assert [s.request_id for s in batch.preempted] == [r.request_id for r in sim_preempted], f"step {step}"
        assert engine.block_manager.num_free_blocks == worker.num_free_blocks, f"step {step}"
        steps_with_preemption += bool(batch.preempted)

        engine.postprocess(batch)
        for i, seq in enumerate(batch.seqs):
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(0)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    engine.finish(seq, "length")
        for request, num_new in sim_batch:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                worker._sample(request, 0.0)
        assert [s.request_id for s in engine.running] == [r.request_id for r in worker.running]
        assert [s.request_id for s in engine.waiting] == [r.request_id for r in worker.waiting]
    if num_blocks == 6:
        assert steps_with_preemption > 0  # the tight case does exercise preemption
