"""The FP8 wire codec's fast paths (float32 division, a table of the 256 FP8 values, a table of
powers of two) give the bytes and values of the plain formulas (division in float64, torch's
FP8 conversion, torch.ldexp), bit for bit; and the codec benchmark's CPU path runs."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

from kernels import kv_quant
from kernels.kv_quant import FP8_DTYPE, FP8_MAX, fp8_block_rows, pack_blocks, split_pool, unpack_blocks


def reference_pack(x: torch.Tensor) -> torch.Tensor:
    n, bs, hk, d = x.shape
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    _, e = torch.frexp(amax)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-127, 127).to(torch.int8)
    y = torch.ldexp(xf, -e[:, None].to(torch.int32))
    scale = (y.abs().amax(dim=-1).double() / FP8_MAX).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (y.double() / scale[..., None].double()).float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    rows = fp8_block_rows(bs, d)
    out = torch.zeros(n, rows, hk, d, dtype=torch.uint8)
    data, scales = split_pool(out[:, :rows - 1].view(FP8_DTYPE))
    data.view(torch.uint8).copy_(q.view(torch.uint8))
    scales.copy_(scale)
    out[:, rows - 1].copy_(e.view(torch.uint8))
    return out


def reference_unpack(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = raw.shape[1]
    data, scales = split_pool(raw[:, :rows - 1].view(FP8_DTYPE))
    e = raw[:, rows - 1].view(torch.int8).to(torch.int32)
    return torch.ldexp(data.float() * scales[..., None], e[:, None]).to(dtype)


def test_fast_codec_matches_the_plain_formulas_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    # magnitudes from 1e-30 to 1e30 (subnormal scales and large exponents), zeros, a whole zero channel
    x = torch.randn(24, 16, 3, 64, generator=gen) * torch.pow(10.0, torch.randint(-30, 31, (24, 1, 3, 1), generator=gen).float())
    x[0, :, 1, 5] = 0.0
    x[1, 3] = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = x.to(dtype) if dtype == torch.float32 else (x / x.abs().amax().clamp_min(1)).to(dtype)
        raw = pack_blocks(xs)
        assert torch.equal(raw, reference_pack(xs)), dtype
        got, want = unpack_blocks(raw, dtype), reference_unpack(raw, dtype)
        assert torch.equal(got.view(torch.uint8 if dtype.itemsize == 1 else torch.int16 if dtype.itemsize == 2
                                    else torch.int32), want.view(torch.uint8 if dtype.itemsize == 1 else torch.int16
                                                                 if dtype.itemsize == 2 else torch.int32)), dtype


def test_fp8_table_covers_every_byte():
    every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    got, want = kv_quant.fp8_to_float(every), every.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


def test_codec_benchmark_cpu_path(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kv_codec.py"
    spec = importlib.util.spec_from_file_location("bench_kv_codec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--blocks", "4", "--repeat", "2", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].split()[0] == "4" and float(lines[-1].split()[-1]) > 0
