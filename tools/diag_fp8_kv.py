"""FP8 (e4m3) KV cache: the Triton kernels against the torch reference, bit for bit.

    python -m tools.diag_fp8_kv                # on a CUDA GPU (compiled Triton), ~20 s
    python -m tools.diag_fp8_kv --device cpu   # TRITON_INTERPRET=1 (float32 attention)

Checks, each printed with its numbers, and exits 1 if any fails:
1. cast: the kernels' float32 -> e4m3 byte (kernels.cache._e4m3_bits) against torch's cast
   of the value clamped to +-448, over every finite bf16, random float32 bit patterns, the
   e4m3 grid, the midpoints between neighbours (ties) and their neighbours;
2. write: write_kv_cache_triton into FP8 pools against write_kv_cache_ref (scales, data bytes,
   the whole pool), for several shapes; also how many of the scales `amax / 448.0` would get
   wrong on this device (on CUDA torch multiplies by a rounded reciprocal there);
3. rope+write: the fused RoPE + KV write the engine runs, into FP8 pools;
4. attention: decode and prefill Triton kernels over FP8 pools written by the Triton write
   against the torch path over the same pools (max abs error, bf16 tolerance 2e-2), and,
   for information, against attention over the unquantized cache.
A mismatch prints up to 5 examples: (value divided by its scale, kernel byte, reference byte).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

EXAMPLES = 5
ATTN_TOL = 2e-2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton interpreter)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        from pdserve.kernels import dispatch

        dispatch.configure(backend="triton")  # the interpreter's kernels where a function dispatches

    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the interpreter")
        return 2
    import triton

    from pdserve.kernels import kv_quant
    from pdserve.kernels.cache import e4m3_bytes_ref, e4m3_bytes_triton, write_kv_cache_ref, write_kv_cache_triton
    from pdserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton
    from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
    from pdserve.kernels.rope import rope_cos_sin_cache
    from pdserve.kernels.rope_cache import rope_write_kv_ref, rope_write_kv_triton

    dev = args.device
    # bf16 dots under the interpreter are not meaningful; the GPU runs bf16 like the engine
    dtype = torch.bfloat16 if dev != "cpu" else torch.float32
    name = torch.cuda.get_device_name() if dev != "cpu" else "cpu (TRITON_INTERPRET=1)"
    print(f"device {name}, triton {triton.__version__}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}, model dtype {dtype}")
    t0 = time.perf_counter()
    failures: list[str] = []
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(dev)

    def pools(nb, bs, hk, d):
        shape = kv_quant.fp8_pool_shape(nb, bs, hk, d)
        return (torch.full(shape, 0x7F, dtype=torch.uint8, device=dev).view(kv_quant.FP8_DTYPE),
                torch.full(shape, 0x7F, dtype=torch.uint8, device=dev).view(kv_quant.FP8_DTYPE))

    def report(label, ok, detail):
        print(f"  [{'ok' if ok else 'MISMATCH'}] {label}: {detail}")
        if not ok:
            failures.append(label)

    # ---- 1. the cast ------------------------------------------------------------------------
    print("1. float32 -> e4m3 byte (kernel) vs torch cast of clamp(x, -448, 448)")
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    small = dev == "cpu"  # the interpreter is slow: fewer random values, shorter sequences
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << (14 if small else 20),), generator=gen).to(torch.int32)
    grid = torch.arange(256, dtype=torch.uint8).view(kv_quant.FP8_DTYPE).float()
    grid = grid[~torch.isnan(grid)].sort().values
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([every_bf16, bits.view(torch.float32), grid, mids,
                   torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf))])
    x = x[~torch.isnan(x)].contiguous().to(dev)
    got, ref = e4m3_bytes_triton(x), e4m3_bytes_ref(x)
    bad = (got != ref).nonzero().squeeze(1)
    report("cast", bad.numel() == 0, f"{bad.numel()} of {x.numel()} bytes differ"
           + examples([(float(x[i]), int(got[i]), int(ref[i])) for i in bad[:EXAMPLES].tolist()]))

    # ---- 2. write_kv_cache ------------------------------------------------------------------
    print("2. write_kv_cache_triton vs write_kv_cache_ref into FP8 pools")
    for t, hk, d, bs, k_mag, v_mag in [(77, 8, 128, 16, 4.0, 0.05), (77, 8, 128, 32, 4.0, 0.05),
                                         (61, 3, 64, 16, 20.0, 1.0), (200, 8, 128, 16, 1e-3, 300.0)]:
        nb = -(-t // bs) + 2
        k, v = randn(t, hk, d, scale=k_mag), randn(t, hk, d, scale=v_mag)
        k[1, 0] = 0  # an all-zero head
        slots = torch.randperm(nb * bs, generator=gen)[:t].to(dev)
        slots[3] = -1
        ref_pools, tri_pools = pools(nb, bs, hk, d), pools(nb, bs, hk, d)
        write_kv_cache_ref(k, v, *ref_pools, slots)
        write_kv_cache_triton(k, v, *tri_pools, slots)
        label = f"write T={t} Hkv={hk} D={d} BS={bs}"
        for which, src, rp, tp in (("K", k, ref_pools[0], tri_pools[0]), ("V", v, ref_pools[1], tri_pools[1])):
            compare_pools(f"{label} {which}", src, slots, rp, tp, kv_quant, report)
        if dev != "cpu":
            amax = k.float().abs().amax(-1)
            naive = torch.where(amax > 0, amax / kv_quant.FP8_MAX, torch.ones_like(amax))
            off = int((naive != kv_quant.fp8_scales(amax)).sum())
            print(f"      (for the record: `amax / 448.0` on {dev} gives {off} of {amax.numel()} K scales "
                  "that differ from the correctly rounded ones)")

    # ---- 3. rope + write --------------------------------------------------------------------
    print("3. rope_write_kv_triton into FP8 pools (the engine's write)")
    for hk, d, bs in [(3, 64, 16), (8, 128, 16)]:
        t, hq, nb = 61, 3 * hk, 8
        cos_sin = rope_cos_sin_cache(d, 4096, 100000.0, None, device=dev)
        q, k, v = randn(t, hq, d), randn(t, hk, d, scale=8.0), randn(t, hk, d, scale=0.1)
        positions = torch.randint(0, 4096, (t,), generator=gen).to(dev)
        slots = torch.randperm(nb * bs, generator=gen)[:t].to(dev)
        slots[::9] = -1
        tri_pools = pools(nb, bs, hk, d)
        q_out = rope_write_kv_triton(q, k, v, positions, cos_sin, *tri_pools, slots)
        q_ref = rope_write_kv_ref(q, k, v, positions, cos_sin, *pools(nb, bs, hk, d), slots)
        # the kernel quantizes its own rotation of k (rounded to the model dtype): take it from
        # a write of the same call into an unquantized cache
        rotated = [torch.zeros(nb, bs, hk, d, device=dev, dtype=dtype) for _ in range(2)]
        rope_write_kv_triton(q, k, v, positions, cos_sin, *rotated, slots)
        kept = slots >= 0
        k_rot = rotated[0].view(-1, hk, d)[slots[kept]]
        ref_pools = pools(nb, bs, hk, d)
        write_kv_cache_ref(k_rot, v[kept], *ref_pools, slots[kept])
        label = f"rope+write Hkv={hk} D={d} BS={bs}"
        compare_pools(f"{label} K", k_rot, slots[kept], ref_pools[0], tri_pools[0], kv_quant, report,
                      check_whole=False)
        compare_pools(f"{label} V", v[kept], slots[kept], ref_pools[1], tri_pools[1], kv_quant, report,
                      check_whole=False)
        whole = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref_pools, tri_pools))
        report(f"{label} whole pools", whole, "equal" if whole else "differ outside the written slots")
        err = float((q_out.float() - q_ref.float()).abs().max())
        print(f"      rotated q max abs error vs torch {err:.3g}")

    # ---- 4. attention over FP8 pools ----------------------------------------------------------
    print("4. attention over FP8 pools written by the Triton write: Triton vs torch path")
    cases = [([7, 130, 45, 1000], 9, 3, 64, 16), ([1, 100, 1000, 4097], 32, 8, 128, 16), ([33, 700], 12, 2, 64, 32)]
    if small:
        cases = [([7, 40, 17], 9, 3, 64, 16), ([33, 70], 4, 2, 32, 32)]
    for seq_lens, hq, hk, d, bs in cases:
        blocks = [-(-n // bs) for n in seq_lens]
        nb = sum(blocks) + 2
        order = torch.randperm(nb, generator=gen)
        width = max(blocks) + 1
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        k_pool, v_pool = pools(nb, bs, hk, d)
        full_k = torch.zeros(nb, bs, hk, d, dtype=dtype, device=dev)
        full_v = torch.zeros_like(full_k)
        used = 0
        for b, n in enumerate(seq_lens):
            ids = order[used:used + blocks[b]]
            used += blocks[b]
            tables[b, :len(ids)] = ids.to(torch.int32)
            slots = (ids[torch.arange(n) // bs] * bs + torch.arange(n) % bs).to(dev)
            kb, vb = randn(n, hk, d), randn(n, hk, d)
            write_kv_cache_triton(kb, vb, k_pool, v_pool, slots)
            write_kv_cache_ref(kb, vb, full_k, full_v, slots)
        tables = tables.to(dev)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        scale = d ** -0.5
        q = randn(len(seq_lens), hq, d)
        label = f"lens={seq_lens} Hq={hq} Hkv={hk} D={d} BS={bs}"
        got = decode_attention_triton(q, k_pool, v_pool, tables, lens, scale)
        want = decode_attention_ref(q, k_pool, v_pool, tables, lens, scale)
        unq = decode_attention_ref(q, full_k, full_v, tables, lens, scale)
        attn_report(f"decode {label}", got, want, unq, report)
        qp = randn(sum(seq_lens), hq, d)
        cu = torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32).to(dev)
        got = prefill_attention_triton(qp, k_pool, v_pool, tables, cu, lens, scale)
        want = prefill_attention_ref(qp, k_pool, v_pool, tables, cu, lens, scale)
        unq = prefill_attention_ref(qp, full_k, full_v, tables, cu, lens, scale)
        attn_report(f"prefill {label}", got, want, unq, report)

    print(f"{'FAIL: ' + ', '.join(failures) if failures else 'all checks passed'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 1 if failures else 0


def examples(rows) -> str:
    if not rows:
        return ""
    return "; e.g. " + ", ".join(f"(value {v:.9g}, kernel 0x{a:02x}, ref 0x{b:02x})" for v, a, b in rows)


def compare_pools(label, src, slots, ref_pool, tri_pool, kv_quant, report, check_whole=True):
    """Scales and bytes of the written slots, then the whole pool; max abs error of the
    kernel's dequantized values against the reference's and against the input."""
    import torch

    kept = slots >= 0
    src, slots = src[kept], slots[kept]
    bs = kv_quant.pool_block_size(ref_pool)
    block, offset = slots // bs, slots % bs
    (r_data, r_scales), (t_data, t_scales) = kv_quant.split_pool(ref_pool), kv_quant.split_pool(tri_pool)
    r_s, t_s = r_scales[block, offset], t_scales[block, offset]
    r_b, t_b = r_data.view(torch.uint8)[block, offset], t_data.view(torch.uint8)[block, offset]
    bad_scales = int((r_s != t_s).sum())
    bad = (r_b != t_b).nonzero()
    quotient = (src.double() / r_s.double()[..., None]).float()
    rows = [(float(quotient[tuple(i)]), int(t_b[tuple(i)]), int(r_b[tuple(i)])) for i in bad[:EXAMPLES].tolist()]
    r_deq = kv_quant.dequantize(r_data[block, offset], r_s, torch.float32)
    t_deq = kv_quant.dequantize(t_data[block, offset], t_s, torch.float32)
    err = float((t_deq - r_deq).abs().max())
    q_err = float((t_deq - src.float()).abs().max())
    ok = bad_scales == 0 and bad.shape[0] == 0
    report(label, ok, f"{bad_scales} of {r_s.numel()} scales and {bad.shape[0]} of {r_b.numel()} bytes differ, "
           f"max abs error vs ref {err:.3g} (quantization error vs input {q_err:.3g})" + examples(rows))
    if check_whole:
        whole = torch.equal(ref_pool.view(torch.uint8), tri_pool.view(torch.uint8))
        report(f"{label} whole pool", whole, "equal" if whole else "differ (scale rows and untouched slots included)")


def attn_report(label, got, want, unquantized, report):
    err = float((got.float() - want.float()).abs().max())
    q_err = float((want.float() - unquantized.float()).abs().max())
    finite = bool(torch_isfinite(got))
    report(label, finite and err <= ATTN_TOL,
           f"max abs error vs torch path {err:.3g} (tolerance {ATTN_TOL}); fp8 vs unquantized cache {q_err:.3g}"
           + ("" if finite else "; NON-FINITE output"))


def torch_isfinite(t):
    import torch

    return torch.isfinite(t).all()


if __name__ == "__main__":
    sys.exit(main())
