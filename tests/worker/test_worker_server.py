"""Workers in their roles over the real gRPC request plane; KV over the in-process fake
backend here (the UCX backend between processes is tested in test_worker_ucx.py)."""

from __future__ import annotations

import random

import grpc
import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.llm import LLM
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.convert import params_to_proto
from pdserve.sampling_params import SamplingParams
from pdserve.worker.server import WorkerConfig, WorkerServer

MODEL = "random:tiny-qwen2"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def engine_config(chunk: int = 16) -> EngineConfig:
    return EngineConfig(model=MODEL, device="cpu", dtype="float32",
                        cache=CacheConfig(block_size=4, num_blocks=64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=chunk))


@pytest.fixture(scope="module", params=["sync", "overlap", "graphs"])
def workers(request):
    """The three roles; "overlap": the decode-graph path forced on off CUDA (static buffers,
    eager replay), so decode steps take the overlapped path (pdserve/engine.py) under the
    worker's engine thread, with commits, aborts and hand-offs between steps; "graphs": that and
    the prefill graphs' segments (pdserve/piecewise_graphs.py) for every step with prefill rows,
    so the prefill worker pushes each layer's KV from the hook between segments."""
    started = []
    stubs = {}
    for role in ("prefill", "decode", "mixed"):
        server = WorkerServer(WorkerConfig(f"{role}-0", role, engine_config(chunk=7), kv_backend="fake"))
        server.engine.runner.use_cuda_graphs = request.param in ("overlap", "graphs")
        server.engine.runner.prefill_graph_max_tokens = 7 if request.param == "graphs" else 0
        address = server.start()
        started.append(server)
        stubs[role] = pb_grpc.WorkerStub(grpc.insecure_channel(address))
    yield stubs, {s.config.role: s for s in started}
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, device="cpu", dtype="float32", num_blocks=64, block_size=4)


def prompts(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 600) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def disaggregated(stubs, rid: str, prompt, params=GREEDY):
    reserve = stubs["decode"].Reserve(pb.ReserveRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params), deadline_s=10), timeout=10)
    prefill = stubs["prefill"].Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params), kv_address=reserve.kv_address,
        transfer_id=reserve.transfer_id, dst_block_ids=reserve.block_ids, wire_version=reserve.wire_version,
        layout=reserve.layout, deadline_s=10), timeout=20)
    tokens = list(prefill.first.token_ids)
    chunks = list(stubs["decode"].Decode(pb.DecodeRequest(request_id=rid, first=prefill.first), timeout=20))
    for c in chunks:
        tokens.extend(c.token_ids)
    return tokens, prefill, chunks


def assert_idle(servers):
    for server in servers.values():
        bm = server.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, server.config.role
        assert not server.engine.requests


def test_disaggregated_equals_single_engine_and_colocated(workers, reference):
    stubs, servers = workers
    batch = prompts(6, seed=1)
    expected = [o.token_ids for o in reference.generate(batch, GREEDY)]
    for i, prompt in enumerate(batch):
        tokens, prefill, chunks = disaggregated(stubs, f"pd-{i}", prompt)
        assert tokens == expected[i]
        assert prefill.kv_bytes > 0
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert chunks[-1].num_output_tokens == GREEDY.max_tokens
        colocated = [t for c in stubs["mixed"].Generate(pb.GenerateRequest(
            request_id=f"mixed-{i}", prompt_token_ids=prompt, params=params_to_proto(GREEDY)), timeout=20)
            for t in c.token_ids]
        assert colocated == expected[i]
    assert_idle(servers)
    for role in ("decode", "mixed"):  # the overlapped path ran where it was forced on
        engine = servers[role].engine
        assert (engine.num_steps_ahead > 0) == engine.runner.use_cuda_graphs, role
    for role in ("prefill", "mixed"):  # and the prefill graphs' segments where they were
        runner = servers[role].engine.runner
        ran = runner._piecewise.num_runs if runner._piecewise is not None else 0
        assert (ran > 0) == (runner.prefill_graph_max_tokens > 0), role
    # the engine thread's step counters: every step counted once, decode-only ones among them
    stats = stubs["mixed"].Stats(pb.StatsRequest(), timeout=5)
    assert stats.engine_steps >= len(batch) * GREEDY.max_tokens
    assert 0 < stats.engine_decode_only_steps < stats.engine_steps
    assert 0 < stats.engine_decode_only_seconds < stats.engine_step_seconds
    assert stats.engine_idle_seconds > 0
    assert 0 < stats.engine_cpu_seconds <= stats.process_cpu_seconds
    # the steps through the prefill graphs, where they were forced on (at most every step with
    # prefill rows: the warm-up's are not counted, it runs before the engine thread starts)
    mixed_runner = servers["mixed"].engine.runner
    if mixed_runner.prefill_graph_max_tokens:
        assert 0 < stats.engine_prefill_graph_steps <= stats.engine_steps - stats.engine_decode_only_steps
        assert 0 < stats.engine_prefill_graph_seconds < stats.engine_step_seconds
        assert stats.engine_prefill_graph_steps <= mixed_runner.num_prefill_graph_steps
    else:
        assert stats.engine_prefill_graph_steps == 0 and mixed_runner.num_prefill_graph_steps == 0


def test_migration_resumes_without_duplicates(workers, reference):
    stubs, servers = workers
    prompt = prompts(1, seed=2)[0]
    full = reference.generate([prompt], GREEDY)[0].token_ids
    chunks = list(stubs["decode"].Generate(pb.GenerateRequest(
        request_id="migrated", prompt_token_ids=prompt, params=params_to_proto(GREEDY),
        resumed_token_ids=full[:5]), timeout=20))
    rest = [t for c in chunks for t in c.token_ids]
    assert full[:5] + rest == full
    assert chunks[-1].num_output_tokens == GREEDY.max_tokens
    assert chunks[-1].num_prompt_tokens == len(prompt)
    assert_idle(servers)


def test_prefill_worker_stands_in_for_decode(workers, reference):
    """Degraded mode: a prefill worker runs whole requests (and resumes migrated ones) with the
    tokens of a single engine, then holds nothing."""
    stubs, servers = workers
    prompt = prompts(1, seed=6)[0]
    full = reference.generate([prompt], GREEDY)[0].token_ids
    chunks = list(stubs["prefill"].Generate(pb.GenerateRequest(
        request_id="standin", prompt_token_ids=prompt, params=params_to_proto(GREEDY)), timeout=20))
    assert [t for c in chunks for t in c.token_ids] == full
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    chunks = list(stubs["prefill"].Generate(pb.GenerateRequest(
        request_id="standin-resumed", prompt_token_ids=prompt, params=params_to_proto(GREEDY),
        resumed_token_ids=full[:4]), timeout=20))
    assert full[:4] + [t for c in chunks for t in c.token_ids] == full
    assert chunks[-1].num_output_tokens == GREEDY.max_tokens
    tokens, _, _ = disaggregated(stubs, "pd-after-standin", prompt)  # its prefill role is intact
    assert tokens == full
    assert_idle(servers)


def test_abort_frees_reservation_and_unknown_decode(workers):
    stubs, servers = workers
    prompt = prompts(1, seed=3)[0]
    stubs["decode"].Reserve(pb.ReserveRequest(request_id="r-abort", prompt_token_ids=prompt,
                                              params=params_to_proto(GREEDY), deadline_s=10), timeout=10)
    assert servers["decode"].engine.block_manager.num_free_blocks < 64
    assert stubs["decode"].Abort(pb.AbortRequest(request_id="r-abort"), timeout=10).found
    with pytest.raises(grpc.RpcError) as err:
        list(stubs["decode"].Decode(pb.DecodeRequest(request_id="r-abort", first=pb.TokenChunk(token_ids=[1])),
                                    timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_idle(servers)


def test_decode_deadline_missed_fails_cleanly(workers):
    stubs, servers = workers
    prompt = prompts(1, seed=4)[0]
    stubs["decode"].Reserve(pb.ReserveRequest(request_id="late", prompt_token_ids=prompt,
                                              params=params_to_proto(GREEDY), deadline_s=0.2), timeout=10)
    with pytest.raises(grpc.RpcError) as err:  # no prefill ever pushes: the deadline passes
        list(stubs["decode"].Decode(pb.DecodeRequest(request_id="late", first=pb.TokenChunk(token_ids=[1])),
                                    timeout=10))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(servers)


def test_bad_requests_and_roles(workers):
    stubs, servers = workers
    bad = SamplingParams(max_tokens=4)
    msg = params_to_proto(bad)
    msg.top_p = 1.5
    with pytest.raises(grpc.RpcError) as err:
        list(stubs["mixed"].Generate(pb.GenerateRequest(request_id="bad", prompt_token_ids=[1, 2],
                                                        params=msg), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stubs["mixed"].Generate(pb.GenerateRequest(request_id="long", prompt_token_ids=[1] * 5000,
                                                        params=params_to_proto(bad)), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stubs["prefill"].Reserve(pb.ReserveRequest(request_id="x", prompt_token_ids=[1],
                                                   params=params_to_proto(bad)), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stats = stubs["decode"].Stats(pb.StatsRequest(), timeout=5)
    assert stats.role == "decode" and stats.num_blocks == 64 and stats.kv_address
    assert stubs["prefill"].Health(pb.HealthRequest(), timeout=5).healthy
    assert_idle(servers)


def test_cancelled_stream_frees_blocks(workers):
    stubs, servers = workers
    call = stubs["mixed"].Generate(pb.GenerateRequest(
        request_id="cancel-me", prompt_token_ids=prompts(1, seed=5)[0],
        params=params_to_proto(SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))), timeout=20)
    next(iter(call))
    call.cancel()
    import time

    deadline = time.monotonic() + 10
    while servers["mixed"].engine.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_idle(servers)


def test_hybrid_mixed_workers_hand_kv_both_ways_beside_local_runs(reference):
    """Two mixed workers with KV transfers: each prefills for the other and decodes for the
    other while it also runs whole requests; every result equals the single engine's."""
    servers = [WorkerServer(WorkerConfig(f"mixed-{i}", "mixed", engine_config(chunk=7), kv_backend="fake",
                                         moves_kv=True)) for i in range(2)]
    plain = WorkerServer(WorkerConfig("mixed-plain", "mixed", engine_config(chunk=7), kv_backend="fake"))
    try:
        stubs = [pb_grpc.WorkerStub(grpc.insecure_channel(s.start())) for s in servers]
        plain_stub = pb_grpc.WorkerStub(grpc.insecure_channel(plain.start()))
        batch = prompts(4, seed=5)
        expected = [o.token_ids for o in reference.generate(batch, GREEDY)]
        for i, prompt in enumerate(batch):
            a, b = stubs[i % 2], stubs[1 - i % 2]
            local = b.Generate(pb.GenerateRequest(request_id=f"local-{i}", prompt_token_ids=prompt,
                                                  params=params_to_proto(GREEDY)), timeout=20)
            tokens, prefill, _ = disaggregated({"prefill": a, "decode": b}, f"hy-{i}", prompt)
            assert tokens == expected[i]
            assert prefill.kv_bytes > 0
            assert [t for c in local for t in c.token_ids] == expected[i]
        assert all(s.engine.layer_hook is not None and s.receiver is not None for s in servers)
        assert_idle({s.config.worker_id: s for s in servers})
        for rpc, request in (("Reserve", pb.ReserveRequest(request_id="x", prompt_token_ids=[1],
                                                          params=params_to_proto(GREEDY))),
                             ("Prefill", pb.PrefillRequest(request_id="y", prompt_token_ids=[1],
                                                           params=params_to_proto(GREEDY)))):
            with pytest.raises(grpc.RpcError) as err:
                getattr(plain_stub, rpc)(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "without KV transfers" in err.value.details()
    finally:
        for s in (*servers, plain):
            s.stop()
    with pytest.raises(ValueError, match="moves_kv applies to mixed"):
        WorkerConfig("p", "prefill", moves_kv=True)


def test_the_workers_config_switches_the_kv_trace(monkeypatch):
    """The KV plane's settings come with the worker's config (kvtransfer.settings): its trace is on
    with them, off without; a config without settings takes the process's environment at start."""
    from pdserve.kvtransfer import settings, trace
    from pdserve.kvtransfer.settings import KVSettings

    monkeypatch.delenv("PDSERVE_KV_TRACE", raising=False)
    try:
        traced = WorkerServer(WorkerConfig("mixed-t", "mixed", engine_config(), kv_backend="fake",
                                           kv_settings=KVSettings(trace=True, recv_slots=3)))
        assert trace.ENABLED and settings.current().recv_slots == 3
        traced.stop()
        WorkerServer(WorkerConfig("mixed-u", "mixed", engine_config(), kv_backend="fake",
                                  kv_settings=KVSettings())).stop()
        assert not trace.ENABLED and settings.current() == KVSettings()
        monkeypatch.setenv("PDSERVE_KV_TRACE", "1")
        WorkerServer(WorkerConfig("mixed-v", "mixed", engine_config(), kv_backend="fake")).stop()
        assert trace.ENABLED
    finally:
        settings.configure(KVSettings())


def test_generate_reports_the_workers_part_of_the_first_token(workers):
    """The chunk with a Generate call's first token says where the worker's time to it went
    (queue, prefill, hand-off); no other chunk does, nor any chunk of a Decode stream."""
    stubs, servers = workers
    prompt = prompts(1, seed=7)[0] + [5] * 20  # several 7-token chunks: a prefill over steps
    chunks = list(stubs["mixed"].Generate(pb.GenerateRequest(
        request_id="timed", prompt_token_ids=prompt, params=params_to_proto(GREEDY)), timeout=20))
    first = chunks[0]
    assert first.token_ids and first.prefill_seconds > 0
    assert first.queue_seconds >= 0 and first.handoff_seconds >= 0
    assert first.queue_seconds + first.prefill_seconds < 20
    for c in chunks[1:]:
        assert (c.queue_seconds, c.prefill_seconds, c.handoff_seconds) == (0, 0, 0)
    _, prefill, decode_chunks = disaggregated(stubs, "timed-pd", prompt)
    assert prefill.first.prefill_seconds == 0
    for c in decode_chunks:
        assert (c.queue_seconds, c.prefill_seconds, c.handoff_seconds) == (0, 0, 0)
    assert_idle(servers)
