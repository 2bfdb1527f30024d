import pytest

from pdserve.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import Scheduler
from pdserve.sequence import Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, budget=8, max_seqs=4, role="mixed"):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, role=role), bm), bm


def seq(rid, n, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=4))


def run_step(s, batch, sampled=7):
    s.postprocess(batch)
    for i, q in enumerate(batch.seqs):
        if q.num_computed_tokens == q.num_tokens:
            q.output_token_ids.append(sampled)


def test_chunked_prefill_under_token_budget_with_decodes():
    s, bm = make(budget=8)
    a, b = seq("a", 5), seq("b", 13, start=100)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["a", "b"]
    assert batch.num_new_tokens == [5, 3]  # a fully, b's first chunk
    assert batch.samples(0) and not batch.samples(1)
    run_step(s, batch)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 7]  # a decodes, b continues its prefill
    run_step(s, batch)
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 3]
    assert batch.samples(1)
    for q in (a, b):
        s.finish(q, "stop")
    assert bm.num_free_blocks == bm.num_blocks


def test_running_cap():
    s, bm = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add(seq(str(i), 3, start=10 * i))
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preemption_by_recompute_when_blocks_run_out():
    s, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 8), seq("b", 7, start=50)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert bm.num_free_blocks == 0  # 2 + 2 blocks
    run_step(s, batch)
    # a now has 9 tokens -> needs a third block: b (the last admitted) is preempted
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["a"]
    assert [q.request_id for q in batch.preempted] == ["b"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # generated tokens kept for recompute
    assert s.waiting[0] is b
    s.finish(a, "stop")
    batch = s.schedule()
    # prompt + its generated token = 8; its first block survived in the prefix cache
    assert batch.seqs == [b] and batch.num_new_tokens == [4] and b.num_computed_tokens == 4
    s.finish(b, "stop")
    assert bm.num_free_blocks == 4


def test_single_request_preempts_itself_without_deadlock():
    s, bm = make(num_blocks=2, block_size=2, budget=64)
    a = seq("a", 4)
    s.add(a)
    run_step(s, s.schedule())
    batch = s.schedule()  # needs a third block; nobody else to evict
    assert batch.seqs == [] and batch.preempted == [a]
    assert bm.num_free_blocks == 2


def test_decode_role_reserve_and_commit():
    s, bm = make(role="decode")
    a = seq("a", 6)
    ids = s.reserve(a, 6)
    assert ids == [0, 1]
    assert s.schedule().seqs == []  # KV not landed yet
    a.output_token_ids.append(3)
    s.commit("a")
    batch = s.schedule()
    assert batch.seqs == [a] and batch.num_new_tokens == [1]
    s.finish(a, "stop")
    assert bm.num_free_blocks == bm.num_blocks


def test_scheduler_sizes_resolve_for_the_device():
    """Not given (None): the device's defaults, GPU-sized on CUDA; given: kept."""
    from pdserve.config import resolve_scheduler

    cfg, line = resolve_scheduler(SchedulerConfig(), "cuda")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 256)
    assert line == "max_num_batched_tokens=8192 max_num_seqs=256 (defaults for cuda)"
    cfg, line = resolve_scheduler(SchedulerConfig(role="decode"), "cpu")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.role) == (512, 64, "decode")
    assert line.endswith("(defaults for cpu)")
    cfg, line = resolve_scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8), "cuda:1")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (1024, 8) and line.endswith("(given)")
    cfg, line = resolve_scheduler(SchedulerConfig(max_num_seqs=8), "cuda")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 8)
    assert line.endswith("(max_num_batched_tokens the default for cuda, the other given)")
    with pytest.raises(ValueError, match="no default sizes for device 'mps'"):
        resolve_scheduler(SchedulerConfig(), "mps")
    with pytest.raises(ValueError, match="max_num_seqs must be > 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="resolve_scheduler"):
        Scheduler(SchedulerConfig(), BlockManager(8, 4))


def test_engine_resolves_and_logs_its_sizes(caplog):
    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.engine import LLMEngine

    with caplog.at_level("INFO", logger="pdserve.engine"):
        engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", cache=CacheConfig(num_blocks=16)))
    assert (engine.config.scheduler.max_num_batched_tokens, engine.config.scheduler.max_num_seqs) == (512, 64)
    assert engine.scheduler.config is engine.config.scheduler
    assert "engine: max_num_batched_tokens=512 max_num_seqs=64 (defaults for cpu)" in caplog.text


def test_waiting_reservations_are_granted_in_arrival_order_with_room_for_running_growth():
    s, bm = make(num_blocks=8, role="decode")
    a, b, c = seq("a", 16), seq("b", 8, start=100), seq("c", 8, start=200)
    assert s.can_reserve(a, 16)
    s.reserve(a, 16)  # 4 of 8 blocks
    s.commit("a")
    assert s.can_reserve(b, 8)
    s.queue_reservation(b)
    s.queue_reservation(c)
    assert [q.request_id for q in s.grant_reservations()] == ["b"]  # 2 blocks; 2 left
    assert not s.can_reserve(c, 8)  # 2 needed, 2 free, but a (running) keeps one for its growth
    assert s.pending_reservations[0] is c and c.block_ids == []
    s.finish(c, "abort")  # a waiting reservation that is aborted leaves the line
    assert not s.pending_reservations and s.has_work()  # a is running
    d, e = seq("d", 8, start=300), seq("e", 4, start=400)
    s.queue_reservation(d)
    s.queue_reservation(e)
    assert not s.can_reserve(e, 4)  # not before d, even though e alone would fit
    s.finish(a, "stop")
    assert [q.request_id for q in s.grant_reservations()] == ["d", "e"]
    assert d.status is SequenceStatus.AWAITING_KV and s.awaiting_kv.keys() == {"b", "d", "e"}
    for rid in ("b", "d", "e"):
        s.finish(s.awaiting_kv[rid], "abort")
    assert bm.num_free_blocks == bm.num_blocks
