"""Helpers shared by the kernel tests: paged KV builders and naive references."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.dispatch import triton_available


def require_triton() -> None:
    if not triton_available():
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os_interpret() != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1: triton kernels cannot run")


def os_interpret() -> str:
    import os

    return os.environ.get("TRITON_INTERPRET", "")


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
            for p in range(n):
                self.k_cache[ids[p // block_size], p % block_size] = k[p]
                self.v_cache[ids[p // block_size], p % block_size] = v[p]
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


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
