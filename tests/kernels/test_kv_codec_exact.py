"""The FP8 wire codec's fast paths (float32 division, a table of the 256 FP8 values, a table of
powers of two) give the bytes and values of the plain formulas (division in float64, torch's
FP8 conversion, torch.ldexp), bit for bit; the Triton kernels (kernels.kv_codec) give the bytes
and values of the torch path, bit for bit, interpreted on the CPU and compiled on CUDA; and the
codec benchmark's CPU path runs."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from pdserve.kernels import kv_codec, kv_quant
from pdserve.kernels.dispatch import force_backend, triton_available
from pdserve.kernels.kv_codec import pack_blocks_triton, unpack_blocks_triton
from pdserve.kernels.kv_codec import pack_blocks, unpack_blocks
from pdserve.kernels.kv_quant import FP8_DTYPE, FP8_MAX, fp8_block_rows, pack_blocks_ref, split_pool, unpack_blocks_ref


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
    x = torch.randn(24, 16, 3, 64, generator=gen) * torch.pow(
        10.0, torch.randint(-30, 31, (24, 1, 3, 1), generator=gen).float())
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
    module = importlib.import_module("benchmarks.bench_kv_codec")
    assert module.main(["--blocks", "4", "--repeat", "2", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].split()[0] == "4" and float(lines[-1].split()[-1]) > 0


# ---- the Triton kernels against the torch path ------------------------------------------------

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype])


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit; NaN only as NaN (its payload bits differ between torch's own CPU and CUDA)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    diff = (bits(got) != bits(want)) & ~nan
    assert not bool(diff.any()), f"{int(diff.sum())} values differ, first at {diff.nonzero()[0].tolist()}"


def hard_blocks(n: int, bs: int, hk: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random blocks, channel magnitudes spread over 1e-3..1e3 (1e-2..1e2 in float16), with a
    channel all zero, a token row all zero, a huge outlier, values near and over e4m3's max, and
    tiny values (subnormal in the dtype: in y they fall to float32 subnormals, and so do scales)."""
    gen = torch.Generator().manual_seed(seed)
    span = 2 if dtype == torch.float16 else 3
    x = torch.randn(n, bs, hk, d, generator=gen)
    x *= torch.pow(10.0, torch.randint(-span, span + 1, (n, 1, hk, d), generator=gen).float())
    x[0, :, hk - 1, 5] = 0.0  # a channel all zero: exponent 0
    x[min(1, n - 1), 4] = 0.0  # a token row all zero: scale 1
    x[0, 3, 0, 3] = 3e4 if dtype == torch.float16 else 1e7  # a K-style outlier channel
    b = n - 1
    x[b, 2, 0, :8] = torch.tensor([448.0, -447.5, 449.0, 464.0, -480.0, 240.0, 0.875, -1e-3])
    x[b, 5:8, :, :] = torch.randn(3, hk, d, generator=gen) * (1e-6 if dtype == torch.float16 else 1e-39)
    x[b, bs - 1, hk - 1, :4] = torch.tensor([6e-8, -6e-8, 1.4e-45, -3e-39]) if dtype != torch.float16 else \
        torch.tensor([6e-8, -6e-8, 1.2e-7, -3e-5])
    return x.to(dtype)


def ties_block(bs: int, hk: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """A block where rounding to e4m3 meets exact ties: every channel's amax is 0.875 (exponent 0)
    and every token's amax 0.875 (scale 2^-9 exactly), so q = x * 2^9 without rounding, at values
    halfway between two e4m3 values (subnormal ones, the carry into the exponent, the top binade)."""
    q = torch.tensor([0.5 / 512, 1.5 / 512, 2.5 / 512, 7.5 / 512, 1.0625 / 64, 1.0625, 1.1875, 3.0625,
                      17.0, 19.0, 248.0, 432.0, 440.0, 447.0, 0.25 / 512, 0.75 / 512])
    x = torch.zeros(bs, hk, d)
    x[:, :, 0] = 0.875
    x[0] = 0.875
    x[1, :, 1:1 + len(q)] = q / 512
    x[2, :, 1:1 + len(q)] = -q / 512
    gen = torch.Generator().manual_seed(5)
    x[3:, :, 1:] = torch.randint(-448 * 8, 448 * 8 + 1, (bs - 3, hk, d - 1), generator=gen).float() / 8 / 512
    return x.to(dtype)


def extreme_blocks(bs: int, hk: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """An all-subnormal block (channel amax subnormal: exponent -126 or clamped to -127), a block at
    the top of the range (amax >= 2^127: exponent clamped to 127, y = x * 2^-127, a subnormal
    power), an all-zero block, and the ties block."""
    gen = torch.Generator().manual_seed(7)
    tiny = torch.randn(bs, hk, d, generator=gen) * (1e-6 if dtype == torch.float16 else 3e-39)
    top = torch.randn(bs, hk, d, generator=gen).clamp(-3, 3) * (2e4 if dtype == torch.float16 else 1e38)
    return torch.stack([tiny.to(dtype), top.to(dtype), torch.zeros(bs, hk, d, dtype=dtype),
                        ties_block(bs, hk, d, dtype)])


def every_byte_raw(n: int, bs: int, hk: int, d: int, seed: int = 0) -> torch.Tensor:
    """Wire blocks with every e4m3 byte in the data rows, scales from subnormal to large and every
    exponent in [-127, 127]."""
    gen = torch.Generator().manual_seed(seed)
    rows = fp8_block_rows(bs, d)
    raw = torch.zeros(n, rows, hk, d, dtype=torch.uint8)
    raw[:, :bs] = (torch.arange(n * bs * hk * d) % 256).view(n, bs, hk, d).to(torch.uint8)
    data, scales = split_pool(raw[:, :rows - 1].view(FP8_DTYPE))
    mags = torch.randint(-140, 30, scales.shape, generator=gen).float()
    scales.copy_(torch.rand(scales.shape, generator=gen) * torch.pow(2.0, mags) + 2.0 ** -149)
    raw[:, rows - 1] = (torch.randint(-127, 128, (n, hk, d), generator=gen)).to(torch.int8).view(torch.uint8)
    raw[0, rows - 1, 0, :3] = torch.tensor([-127, 127, 0], dtype=torch.int8).view(torch.uint8)
    return raw


def check_codec(x: torch.Tensor) -> None:
    """Triton pack/unpack of x against the torch path, bit for bit, and the round trip."""
    raw = pack_blocks_ref(x)
    got = pack_blocks_triton(x)
    assert got.shape == raw.shape and got.dtype == torch.uint8
    diff = got != raw
    assert not bool(diff.any()), f"{int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"
    assert_same_values(unpack_blocks_triton(raw, x.dtype), unpack_blocks_ref(raw, x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 16, 2, 64), (3, 16, 3, 64), (2, 8, 3, 80)],
                         ids=["hk2", "hk3", "bs8-d80-padded"])
def test_triton_codec_matches_torch_bit_for_bit(needs_triton, shape, dtype):
    check_codec(hard_blocks(*shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_codec_extremes_and_ties(needs_triton, dtype):
    x = extreme_blocks(16, 2, 32, dtype)
    check_codec(x)
    raw = pack_blocks_ref(x)
    exps = raw[:, -1].view(torch.int8)
    assert int(exps[2].abs().max()) == 0
    _, scales = split_pool(raw[:, :-1].view(FP8_DTYPE))
    assert bool((scales[3] == 2.0 ** -9).all()) and int(exps[3].abs().max()) == 0  # the ties are exact
    tie_bytes = raw[3, 1, 0, 1:8].tolist()  # q = 0.5, 1.5, 2.5, 7.5 (x 2^-9), 1.0625 x 2^-6, 1.0625, 1.1875
    assert tie_bytes == [0, 2, 2, 8, 8, 0x38, 0x3A]
    if dtype != torch.float16:  # the clamped exponents and subnormal amax (-126 from 2^-127 up)
        assert {-127, -126} <= set(exps[0].flatten().tolist()) and exps[1].max() == 127


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, interpreting products that overflow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_unpack_every_byte(needs_triton, dtype):
    raw = every_byte_raw(2, 16, 3, 64)
    assert_same_values(unpack_blocks_triton(raw, dtype), unpack_blocks_ref(raw, dtype))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, interpreting inf / inf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_codec_nonfinite(needs_triton, dtype):
    """inf and NaN in the input: torch's bytes (frexp gives inf and NaN exponent 0; a NaN token's
    scale is 1; its NaN stores 0x7F with its sign); unpacked NaN is NaN."""
    x = torch.randn(2, 16, 2, 32, generator=torch.Generator().manual_seed(1))
    inf, nan = float("inf"), float("nan")
    x[0, 3, 0, 5], x[0, 4, 1, 6], x[1, 2, 1, 9], x[1, 5, 0, 1] = nan, inf, -inf, -nan
    check_codec(x.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_round_trip(needs_triton, dtype):
    x = hard_blocks(3, 16, 3, 64, dtype, seed=11)
    back = unpack_blocks_triton(pack_blocks_triton(x), dtype)
    assert_same_values(back, unpack_blocks_ref(pack_blocks_ref(x), dtype))
    xf, bf = x.float(), back.float()
    assert float((bf - xf).norm() / xf.norm()) < 0.05  # e4m3: 3 mantissa bits


def test_dispatch_and_views(needs_triton, monkeypatch):
    """pack_blocks / unpack_blocks reach the kernels on the triton backend (the CPU's default is
    the torch path), with any leading dims, a non-contiguous input and a misaligned byte buffer."""
    calls = []
    for name in ("pack_blocks_triton", "unpack_blocks_triton"):
        fn = getattr(kv_codec, name)
        monkeypatch.setattr(kv_codec, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    wide = hard_blocks(4, 16, 4, 64, torch.bfloat16).view(2, 2, 16, 4, 64)
    x = wide[:, :, :, 1:4]  # [2, 2, BS, 3, D]: heads sliced, not contiguous
    pack_blocks(x), unpack_blocks(pack_blocks_ref(x), torch.bfloat16)
    assert calls == []
    with force_backend("triton"):
        raw = pack_blocks(x)
        assert torch.equal(raw, pack_blocks_ref(x)) and raw.shape == (2, 2, fp8_block_rows(16, 64), 3, 64)
        buf = torch.empty(raw.numel() + 1, dtype=torch.uint8)
        misaligned = buf[1:].view(raw.shape)
        misaligned.copy_(raw)
        assert_same_values(unpack_blocks(misaligned, torch.bfloat16), unpack_blocks_ref(raw, torch.bfloat16))
        assert pack_blocks(x[:0]).shape == (0, 2, fp8_block_rows(16, 64), 3, 64)
        assert unpack_blocks(raw[:0], torch.float32).shape == (0, 2, 16, 3, 64)
    assert calls == ["pack_blocks_triton", "unpack_blocks_triton", "pack_blocks_triton", "unpack_blocks_triton"]


def _gpu_skip_reason() -> str | None:
    if not triton_available():
        return "needs triton"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set: this test must compile for the GPU"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_codec_on_cuda(dtype):
    """Compiled for the GPU, a layer's worth of Llama-3.1-8B blocks (128 x 16 tokens x 8 KV heads x
    d128) and the extreme blocks: the bytes and values of the torch path on the same device and on
    the CPU."""
    x = torch.cat([hard_blocks(128, 16, 8, 128, dtype, seed=2), extreme_blocks(16, 8, 128, dtype)]).cuda()
    raw = pack_blocks_ref(x)
    assert torch.equal(pack_blocks(x), raw)  # the dispatcher: CUDA runs the kernels
    assert torch.equal(pack_blocks_triton(x), raw)
    assert torch.equal(raw.cpu(), pack_blocks_ref(x.cpu()))
    assert_same_values(unpack_blocks_triton(raw, dtype).cpu(), unpack_blocks_ref(raw, dtype).cpu())
    assert_same_values(unpack_blocks(raw, dtype).cpu(), unpack_blocks_ref(raw.cpu(), dtype))
    every = every_byte_raw(8, 16, 8, 128).cuda()
    assert_same_values(unpack_blocks_triton(every, dtype).cpu(), unpack_blocks_ref(every, dtype).cpu())


def test_warm_codec_runs_the_kernels_for_float_pools_only(needs_triton):
    """`warm_codec` (a worker's start) runs the codec once where the kernels serve the pool's
    device, and does nothing for the torch path, an FP8 pool or a head_dim the wire cannot take."""
    pool = torch.randn(4, 16, 2, 8, dtype=torch.float32)
    assert kv_codec.warm_codec(pool) is False  # auto on the CPU: torch ops, nothing to compile
    with force_backend("triton"):
        assert kv_codec.warm_codec(pool) is True
        assert kv_codec.warm_codec(pool.to(FP8_DTYPE)) is False
        assert kv_codec.warm_codec(torch.zeros(4, 16, 2, 6)) is False


def _compiled(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
def test_warm_codec_compiles_what_a_transfer_launches():
    """After `warm_codec` on a Llama-3.1-8B bf16 pool, a transfer's gathered layer (K and V of 128
    blocks, packed at the sender, unpacked at the receiver) compiles nothing more."""
    pool = torch.zeros(256, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert kv_codec.warm_codec(pool)
    pack, unpack = kv_codec._TRITON.get("_pack_kernel"), kv_codec._TRITON.get("_unpack_kernel")
    before = (_compiled(pack), _compiled(unpack))
    staged = torch.empty(1, 2, 128, 16, 8, 128, dtype=torch.bfloat16, device="cuda").normal_()
    raw = pack_blocks(staged)
    received = torch.empty(raw.numel(), dtype=torch.uint8, device="cuda")
    received.copy_(raw.view(-1))
    unpack_blocks(received.view(raw.shape), torch.bfloat16)
    torch.cuda.synchronize()
    assert (_compiled(pack), _compiled(unpack)) == before
