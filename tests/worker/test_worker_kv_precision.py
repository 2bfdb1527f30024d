"""KV precision per transfer, end to end: a prefill and a decode worker in separate processes,
KV over real UCX (loopback). The same pair sends one request's KV in full precision and the
next one's in FP8 (PrefillRequest.kv_precision); both decode, every block is free after.

Tolerance: the tiny random model's logits are nearly flat, so FP8's error (up to 1/16 of a
value's magnitude per element, e4m3) may flip a near tie late in a continuation; the first
token comes from the prefill worker's own KV and must be equal, and the test holds the FP8
run's greedy tokens equal to full precision's for the first 4 of 10 on every prompt (they were
all 10 equal when this was written) and the full-precision run equal to the single-process engine."""

from __future__ import annotations

import pytest

from pdserve.llm import LLM
from pdserve.proto import worker_pb2 as pb
from pdserve.proto.convert import params_to_proto
from tests.worker.test_worker_ucx import MODEL, PARAMS, ucx_workers  # noqa: F401 (the fixture)

EQUAL_PREFIX = 4
PROMPTS = [[(7 * i + 3 * j) % 480 + 1 for j in range(n)] for i, n in enumerate((5, 33, 70, 17))]


def _run(stubs, rid: str, prompt: list[int], precision: str) -> tuple[list[int], pb.PrefillResponse]:
    res = stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                    params=params_to_proto(PARAMS), deadline_s=20), timeout=20)
    pre = stubs["prefill"].Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(PARAMS), kv_address=res.kv_address,
        transfer_id=res.transfer_id, dst_block_ids=res.block_ids, wire_version=res.wire_version,
        layout=res.layout, deadline_s=20, kv_precision=precision), timeout=60)
    tokens = list(pre.first.token_ids)
    for chunk in stubs["decode"].Decode(pb.DecodeRequest(request_id=rid, first=pre.first), timeout=60):
        tokens.extend(chunk.token_ids)
    return tokens, pre


@pytest.mark.timeout(300)
def test_full_then_fp8_on_one_pair_decode_alike_and_free_every_block(ucx_workers):  # noqa: F811
    stubs, procs, backend = ucx_workers
    if backend != "ucx":
        pytest.skip(f"the {backend} backend moves the pool's bytes as they are (no FP8 on its wire yet)")
    expected = [o.token_ids
                for o in LLM(MODEL, device="cpu", dtype="float32", num_blocks=128).generate(PROMPTS, PARAMS)]
    # 2 layers x (K+V) x 2 kv heads x 16 dims per token; fp32 pools: 16 rows x 4 bytes per block and
    # head dim; FP8: 16 data rows + 4 rows of float32 scales (16 tokens x 4 bytes / 16 dims) + 1 row of
    # per-channel power-of-two exponents (one int8 a dim), 1 byte each (wire v4)
    full_block, fp8_block = 2 * 2 * 2 * 16 * 16 * 4, 2 * 2 * 2 * 21 * 16
    moved = 0
    for i, prompt in enumerate(PROMPTS):
        blocks = -(-len(prompt) // 16)
        full, pre_full = _run(stubs, f"full-{i}", prompt, "full")
        fp8, pre_fp8 = _run(stubs, f"fp8-{i}", prompt, "fp8")
        assert full == expected[i]
        assert fp8[:EQUAL_PREFIX] == full[:EQUAL_PREFIX], f"prompt {i}: {fp8} vs {full}"
        assert (pre_full.kv_precision, pre_full.kv_bytes, pre_full.kv_bytes_saved) == ("full", blocks * full_block, 0)
        # the first block (the attention sink's) goes at full precision (kvtransfer.layout.FP8_FULL_HEAD_BLOCKS)
        rest = blocks - 1
        assert (pre_fp8.kv_precision, pre_fp8.kv_bytes) == ("fp8" if rest else "full", full_block + rest * fp8_block)
        assert pre_fp8.kv_bytes_saved == rest * (full_block - fp8_block)
        moved += pre_full.kv_bytes + pre_fp8.kv_bytes
    with pytest.raises(Exception, match="kv_precision"):
        _run(stubs, "bad", PROMPTS[0], "fp4")
    assert stubs["decode"].Abort(pb.AbortRequest(request_id="bad"), timeout=20).found  # as the router does
    for role, (proc, conn, _) in procs.items():
        conn.send("stop")
        free, total, kv_bytes = conn.recv()
        assert free == total, role  # every block back
        assert kv_bytes == moved, role
        proc.join(30)
