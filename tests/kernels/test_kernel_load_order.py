"""Each Triton entry point works when it is the first kernel launched in a fresh process.

Triton functions are bound lazily (kernels._jit); a helper shared between kernel modules once
made the result depend on which module launched first (the fused RoPE + KV write failed in
every fresh GPU worker). One test process cannot see that, since whatever ran earlier in it
has already bound everything, so each case runs in a new interpreter under TRITON_INTERPRET=1
and compares the kernel with its torch reference there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.kernels.dispatch import triton_available

ROOT = Path(__file__).resolve().parents[2]

_SETUP = """
import torch
torch.manual_seed(0)
def paged(num_blocks=6, block_size=16, kv_heads=2, head_dim=32):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape), torch.randn(shape)
def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
"""

CASES = {
    "silu_and_mul": """
from pdserve.kernels.activation import silu_and_mul_triton, silu_and_mul_ref
x = torch.randn(5, 64)
close(silu_and_mul_triton(x), silu_and_mul_ref(x))
""",
    "write_kv_cache": """
from pdserve.kernels.cache import write_kv_cache_triton, write_kv_cache_ref
k, v = torch.randn(7, 2, 32), torch.randn(7, 2, 32)
slots = torch.tensor([3, 17, 40, -1, 5, 90, 64])
kc, vc = paged(); kr, vr = kc.clone(), vc.clone()
write_kv_cache_triton(k, v, kc, vc, slots); write_kv_cache_ref(k, v, kr, vr, slots)
close(kc, kr); close(vc, vr)
""",
    "rms_norm": """
from pdserve.kernels.norm import rms_norm_triton, rms_norm_ref
x, w = torch.randn(5, 64), torch.randn(64)
close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
""",
    "apply_rope": """
from pdserve.kernels.rope import apply_rope_triton, apply_rope_ref, rope_cos_sin_cache
q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
pos = torch.tensor([0, 3, 9, 1, 30]); cs = rope_cos_sin_cache(32, 64, 10000.0)
for a, b in zip(apply_rope_triton(q, k, pos, cs), apply_rope_ref(q, k, pos, cs)):
    close(a, b)
""",
    "rope_write_kv": """
from pdserve.kernels.rope import rope_cos_sin_cache
from pdserve.kernels.rope_cache import rope_write_kv_triton, rope_write_kv_ref
q, k, v = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32)
pos = torch.tensor([0, 3, 9, 1, 30]); cs = rope_cos_sin_cache(32, 64, 10000.0)
slots = torch.tensor([3, 17, -1, 5, 90])
kc, vc = paged(); kr, vr = kc.clone(), vc.clone()
close(rope_write_kv_triton(q, k, v, pos, cs, kc, vc, slots),
      rope_write_kv_ref(q, k, v, pos, cs, kr, vr, slots))
close(kc, kr); close(vc, vr)
""",
    "decode_attention": """
from pdserve.kernels.decode_attention import decode_attention_triton, decode_attention_ref
kc, vc = paged()
q = torch.randn(2, 4, 32)
tables = torch.tensor([[4, 1, -1], [0, 5, 2]], dtype=torch.int32)
lens = torch.tensor([20, 40], dtype=torch.int32)
close(decode_attention_triton(q, kc, vc, tables, lens, 0.17),
      decode_attention_ref(q, kc, vc, tables, lens, 0.17))
""",
    "prefill_attention": """
from pdserve.kernels.prefill_attention import prefill_attention_triton, prefill_attention_ref
kc, vc = paged()
q = torch.randn(9, 4, 32)
tables = torch.tensor([[4, 1, -1], [0, 5, 2]], dtype=torch.int32)
cu = torch.tensor([0, 4, 9], dtype=torch.int32)
lens = torch.tensor([20, 40], dtype=torch.int32)
close(prefill_attention_triton(q, kc, vc, tables, cu, lens, 0.17),
      prefill_attention_ref(q, kc, vc, tables, cu, lens, 0.17))
""",
    "dense_prefill_attention": """
from pdserve.kernels.prefill_attention_dense import dense_prefill_attention_triton, dense_prefill_attention_ref
qkv = torch.randn(9, 8 * 32)
q, k, v = qkv[:, :128].reshape(9, 4, 32).contiguous(), qkv[:, 128:192].view(9, 2, 32), qkv[:, 192:].view(9, 2, 32)
cu = torch.tensor([0, 4, 9], dtype=torch.int32)
close(dense_prefill_attention_triton(q, k, v, cu, 0.17), dense_prefill_attention_ref(q, k, v, cu, 0.17))
""",
    "kv_copy": """
from pdserve.kernels.kv_copy import gather_blocks, gather_blocks_ref
from pdserve.kernels.dispatch import force_backend
pools = torch.randn(4, 6, 40)
index = torch.tensor([5, 1, 2])
got, want = torch.empty(4, 3, 40), torch.empty(4, 3, 40)
with force_backend("triton"):
    gather_blocks(pools, index, got)
gather_blocks_ref(pools, index, want)
close(got, want)
""",
    "fused_moe": """
from pdserve.kernels.dispatch import force_backend
from pdserve.kernels.fused_moe import fused_moe, fused_moe_ref, moe_route
x, w13, w2 = torch.randn(5, 32), torch.randn(4, 96, 32) / 6, torch.randn(4, 32, 48) / 7
weights, ids = moe_route(torch.randn(5, 4), 2, True)
ids[2, 1] = -1
with force_backend("triton"):
    got = fused_moe(x, w13, w2, weights, ids)
close(got, fused_moe_ref(x, w13, w2, weights, ids))
""",
    # the FP8 wire codec's kernels use kernels.cache's `_e4m3_bits`
    "kv_wire_codec": """
from pdserve.kernels.dispatch import force_backend
from pdserve.kernels.kv_codec import pack_blocks, unpack_blocks
from pdserve.kernels.kv_quant import pack_blocks_ref, unpack_blocks_ref
x = torch.randn(2, 16, 2, 32)
with force_backend("triton"):
    raw = pack_blocks(x)
    back = unpack_blocks(raw, torch.float32)
assert torch.equal(raw, pack_blocks_ref(x))
assert torch.equal(back, unpack_blocks_ref(raw, torch.float32))
""",
    # The engine's forward: whichever kernel the model reaches first binds everything it needs.
    "engine_forward": """
from pdserve.kernels.dispatch import force_backend
from pdserve import LLM, SamplingParams
params = SamplingParams(max_tokens=4, temperature=0)
llm = LLM("random:tiny-llama")
with force_backend("triton"):
    triton_tokens = llm.generate([[1, 2, 3, 4, 5, 6, 7]], params)[0].token_ids
with force_backend("torch"):
    torch_tokens = llm.generate([[1, 2, 3, 4, 5, 6, 7]], params)[0].token_ids
assert triton_tokens == torch_tokens, (triton_tokens, torch_tokens)
""",
}


_PARALLEL = 2  # fresh interpreters at a time: each spends its seconds importing torch and triton


@pytest.fixture(scope="module")
def fresh_runs():
    """Every case's fresh interpreter, started `_PARALLEL` at a time as the module begins; each
    test waits for its own. ``{case: (returncode, stdout, stderr)}`` filled as they end."""
    if not triton_available():
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("PDSERVE_KERNEL_BACKEND", None)

    def run(case: str):
        code = textwrap.dedent(_SETUP) + textwrap.dedent(CASES[case]) + "\nprint('ok')\n"
        try:
            proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=240)
        except subprocess.TimeoutExpired:
            return None, "", "timed out after 240 s"
        return proc.returncode, proc.stdout, proc.stderr

    with ThreadPoolExecutor(_PARALLEL) as pool:
        yield {case: pool.submit(run, case) for case in sorted(CASES)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_entry_point_first_in_fresh_process(case: str, fresh_runs) -> None:
    returncode, stdout, stderr = fresh_runs[case].result(timeout=600)
    assert returncode == 0 and stdout.strip().endswith("ok"), (
        f"{case} failed as the first kernel of a fresh process:\n{stderr[-3000:]}")
