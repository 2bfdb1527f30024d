"""KV between workers of different tensor-parallel degrees (kvtransfer.shards, worker.kv_routes):
P TP=1 -> D TP=2 splits the heads, P TP=2 -> D TP=1 gathers them, equal TP goes rank to rank,
replicated KV heads cross once and are copied on the decode worker. In-process workers over the
real gRPC request plane and the fake KV backend (the followers are processes; rank 0 holds every
rank's pools; one tensor-parallel engine per process, so P TP=2 + D TP=2 is tested through
`pdserve up` in test_tp_cluster.py). Every answer equals the TP=1 single engine's greedy tokens, every block is free
after."""

from __future__ import annotations

import itertools

import grpc
import pytest
import torch

from pdserve.kvtransfer import KVLayout, KVTransferError, create_receiver, create_sender
from pdserve.kvtransfer.shards import HeadPiece, HeadShards, RankHeads, encode_routes, parse_routes, pieces_for
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.llm import LLM
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.sampling_params import SamplingParams
from pdserve.worker.server import WorkerConfig, WorkerServer
from tests.worker.test_worker_server import assert_idle, disaggregated, prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# 6 KV heads (split 3+3 at TP 2) and 1 KV head (replicated on both ranks at TP 2)
MODELS = ["random:tiny-llama-tp", "random:tiny-qwen2-tp"]


def engine_config(model: str, tp: int) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", warmup=False, tensor_parallel_size=tp,
                        cache=CacheConfig(block_size=4, num_blocks=48),
                        scheduler=SchedulerConfig(max_num_batched_tokens=7))


@pytest.fixture(scope="module", params=list(itertools.product(MODELS, [(1, 2), (2, 1)])), ids=str)
def pair(request):
    model, (p_tp, d_tp) = request.param
    servers, stubs = {}, {}
    try:
        for role, tp in (("prefill", p_tp), ("decode", d_tp)):
            server = WorkerServer(WorkerConfig(f"{role}-tp{tp}", role, engine_config(model, tp), kv_backend="fake"))
            servers[role] = server
            stubs[role] = pb_grpc.WorkerStub(grpc.insecure_channel(server.start()))
        yield model, servers, stubs
    finally:
        for server in servers.values():
            server.stop()


def test_disaggregated_across_tp_degrees_equals_tp1(pair):
    model, servers, stubs = pair
    batch = [[t % 500 + 1 for t in p] for p in prompts(3, seed=len(model))]
    expected = [o.token_ids for o in LLM(model, device="cpu", dtype="float32", num_blocks=48,
                                         block_size=4).generate(batch, GREEDY)]
    for i, prompt in enumerate(batch):
        tokens, prefill, _ = disaggregated(stubs, f"r{i}", prompt, GREEDY)
        assert tokens == expected[i]
        assert prefill.kv_bytes > 0
    assert_idle(servers)
    # the TP=2 side's followers hold their blocks' KV too: every rank's pools are the engine's
    tp2 = servers["prefill"] if servers["prefill"].engine.tp_group else servers["decode"]
    assert len(tp2.engine.rank_kv_caches) == 2


def test_routed_address_and_replicas(pair):
    model, servers, _ = pair
    decode = servers["decode"]
    if decode.engine.tp_group is None:
        assert "|" not in decode.kv_address  # a TP=1 decode worker keeps its plain address
        return
    routes = parse_routes(decode.kv_address, decode.engine.model_config.num_kv_heads)
    if model == "random:tiny-qwen2-tp":  # one KV head on both ranks: one receiver, sent once
        assert [(f, c) for f, c, _ in routes] == [(0, 1)]
        assert len(decode.receiver._groups[0][4]) == 1  # one replica copied on the node
    else:
        assert [(f, c) for f, c, _ in routes] == [(0, 3), (3, 3)]
    assert parse_routes("ucx://h:1", 6) == [(0, 6, "ucx://h:1")]
    with pytest.raises(ValueError, match="decode worker's model has 2 KV heads, this one 6"):
        parse_routes(encode_routes(2, [(0, 2, "a")]), 6)
    with pytest.raises(ValueError, match="does not cover KV heads"):
        parse_routes(encode_routes(6, [(0, 3, "a")]), 6)


def _pools(num_layers=2, heads=6, fill=None):
    caches = []
    for layer in range(num_layers):
        k = torch.arange(8 * 4 * heads * 2, dtype=torch.float32).view(8, 4, heads, 2) + 1000 * layer
        caches.append((k, -k.clone()))
    return caches


def test_head_shards_gather_the_pieces():
    a, b = _pools(heads=3), _pools(heads=3)
    for layer in range(2):
        b[layer][0].add_(0.5)
        b[layer][1].add_(0.5)
    ranks = [RankHeads(a, 0, 3), RankHeads(b, 3, 3)]
    pieces = pieces_for(ranks, 2, 3)  # head 2 of rank 0, heads 3-4 of rank 1
    assert [(p.start, p.count) for p in pieces] == [(2, 1), (0, 2)]
    layout = KVLayout(2, 4, 3, 2, "float32", 2, 6)
    shards = HeadShards(pieces, layout)
    assert not shards.whole and KVLayout.from_caches(shards) == layout
    staged = shards.gather_layer(1, torch.tensor([5, 1]))
    assert torch.equal(staged[0, :, :, 0], a[1][0][[5, 1], :, 2])
    assert torch.equal(staged[1, :, :, 1:], b[1][1][[5, 1], :, 0:2])


def test_mismatched_head_ranges_refuse_to_pair():
    """A sender gathering heads [0, 3) of 6 and a receiver holding [3, 6): the handshake fails
    with an error that names both ranges (the layout fingerprint includes the TP layout)."""
    full = _pools(heads=6)
    sender_caches = HeadShards([HeadPiece(full, 0, 3)], KVLayout(2, 4, 3, 2, "float32", 0, 6))
    receiver_caches = HeadShards([HeadPiece(_pools(heads=3), 0, 3)], KVLayout(2, 4, 3, 2, "float32", 3, 6))
    assert sender_caches.layout.fingerprint != receiver_caches.layout.fingerprint
    receiver = create_receiver("fake", receiver_caches)
    sender = create_sender("fake", sender_caches)
    try:
        receiver.expect("t", [0], 2, 5.0)
        sender.send_layer(receiver.address(), "t", 0, [1], [0])
        with pytest.raises(KVTransferError, match=r"tensor-parallel layout mismatch: peer holds KV heads \[3, 6\) "
                                                  r"of 6, this side \[0, 3\) of 6"):
            sender.finish("t", timeout=5)
    finally:
        sender.close()
        receiver.close()
