"""Fixtures for the kernel tests: Triton interpreter mode on CPU, paged KV builders, naive refs.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1. Triton reads that
variable when a kernel is first launched (kernels._jit wraps functions with triton.jit lazily),
so an autouse fixture sets it around this folder's tests only; other test folders never see
it, even if they imported `kernels` first. With CUDA present it is left alone, so the gpu
tests compile for real.
"""

import os

import pytest
import torch

from pdserve.kernels.dispatch import triton_available



@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter_without_cuda():
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
        yield


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKV:
    """Unpaged per-sequence K/V plus the same data scattered into a shuffled paged cache."""

    def __init__(self, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                 stale: float = float("nan")) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        max_blocks = max(blocks_per_seq) + 1
        order = torch.randperm(num_blocks, generator=gen)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Slots nobody owns hold `stale` (NaN by default): kernels must never read them.
        self.k_cache = torch.full(shape, stale, dtype=dtype)
        self.v_cache = torch.full(shape, stale, dtype=dtype)
        self.block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
        self.keys, self.values = [], []
        next_block = 0
        for b, n in enumerate(seq_lens):
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            ids = order[next_block:next_block + blocks_per_seq[b]]
            next_block += blocks_per_seq[b]
            self.block_tables[b, :len(ids)] = ids.to(torch.int32)
            for j, block in enumerate(ids.tolist()):
                rows = slice(j * block_size, min((j + 1) * block_size, n))
                self.k_cache[block, :rows.stop - rows.start] = k[rows]
                self.v_cache[block, :rows.stop - rows.start] = v[rows]
            self.keys.append(k)
            self.values.append(v)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        for name in ("k_cache", "v_cache", "block_tables", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q[L, Hq, D] at the last L positions of k/v[S, Hkv, D]; causal; float64 math."""
    q_len, hq, _ = q.shape
    seq_len, hk, _ = k.shape
    group = hq // hk
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q_len):
        pos = seq_len - q_len + i
        for h in range(hq):
            kk = k[:pos + 1, h // group].double()
            vv = v[:pos + 1, h // group].double()
            w = torch.softmax(kk @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ vv
    return out


@pytest.fixture
def needs_triton() -> None:
    """Skip unless Triton kernels can run on CPU tensors here, i.e. under the interpreter.

    With CUDA present the kernels compile for the GPU (test_kernels_gpu.py covers them), so
    these CPU comparisons skip unless TRITON_INTERPRET=1 was set for the whole run.
    """
    if not triton_available():
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU triton comparisons need TRITON_INTERPRET=1 (CUDA present: see test_kernels_gpu.py)")


@pytest.fixture
def paged_kv() -> type[PagedKV]:
    return PagedKV


@pytest.fixture(name="naive_attention")
def naive_attention_fixture():
    return naive_attention
