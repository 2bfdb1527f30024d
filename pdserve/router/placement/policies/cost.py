"""The cost model of network-aware placement: predicted TTFT and TPOT of each option. Pure.

Disaggregated (P, D)::

    TTFT = queue(P) + prefill(uncached) + kv - hidden + admit(D)

- queue(P) = profile.prefill_seconds(Q): Q is the prompt tokens queued or running at P. The
  router is the only client of prefill workers, so its own in-flight prompt tokens are Q;
  requests the worker reports beyond the router's count are assumed as long as this one.
- prefill(uncached) = profile.prefill_seconds(prompt - cached), cached = the prefix the
  policy last sent to P (an estimate: P may have evicted it).
- kv = link latency + prompt x kv_bytes_per_token at the fair share of the P->D link
  (router.placement.congestion.available_gbps). The whole prompt's KV moves, cached or not.
- hidden = (L-1)/L x min(kv, compute): P pushes layer l while layers l+1.. compute, so when
  the link keeps up only the last layer's share is exposed; when it does not, the compute
  hides what it overlaps and the rest of the transfer is exposed. compute is the layers'
  forward time, the offline profile's prefill(uncached) *without* the calibration's prefill
  factor: that factor learns the served prefill span (the worker's scheduling, sampling and
  hand-off around the forward, a GPU shared with a decode worker), and the transfer only
  overlaps the forward. (Until 2026-12-03 hidden used the calibrated prefill, which predicted
  almost none of a transfer exposed where the KV tail measured far more. Most of that tail came
  from two stalls fixed on 2026-12-03, the sender's wait for the newest queued layer and the
  prefill sampler's freeze of the worker's threads; since then the transfer hides behind the
  served prefill, and this unscaled forward sends FP8 there for the same TTFT. Which of the two
  spans to hide behind is to be measured again; the figures: docs/results.md, "Figures behind
  the code's choices".)
- admit(D) = one decode step at D's batch: Reserve runs on D's engine thread between steps.

Local (prefill on D)::

    TTFT = admit(D) + prefill(uncached on D) + chunks x decode_step(D's batch)

because D's chunked prefill shares each step with its decode batch (chunks =
ceil(uncached / max_num_batched_tokens)).

TPOT at D = decode_step(batch + 1, context): the batch after this request joins, at the mean
context of D's requests with this one. A local run also prefills inside D's steps: its TPOT
adds the prefill of one chunk to that step when D has other requests.

Calibration (router.placement.policies.calibration): the policy prices pairs with a profile whose
prefill times are scaled by the learned prefill factor (queue(P) and prefill(uncached) then
use the served prefill time), and an estimate may carry residual factors: TTFT = ttft_factor x
(the sum above), TPOT = tpot_factor x the model's (`tpot_s` holds the corrected value).
Without outcomes every factor is 1 and the numbers are the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.router.placement.congestion import transfer_seconds
from pdserve.router.placement.base import ClusterSnapshot, RequestInfo, WorkerSnapshot
from pdserve.router.placement.profiles import Profile


@dataclass(frozen=True)
class Estimate:
    """One option's predicted times (seconds); `prefill` is None for a local run on `decode`."""

    prefill: str | None
    decode: str
    queue_s: float
    prefill_s: float
    kv_s: float
    hidden_s: float
    admit_s: float
    tpot_s: float
    room: bool = True  # D has free KV blocks for the prompt (when it reports them)
    ttft_factor: float = 1.0  # calibration residuals (module docstring); tpot_s includes tpot_factor
    tpot_factor: float = 1.0
    prefill_tokens: int = 0  # the uncached prompt tokens `prefill_s` prices (0: not recorded)
    kv_precision: str = "full"  # the KV's precision on the wire `kv_s` prices (choose_kv_precision)
    kv_precision_reason: str = ""
    compute_s: float | None = None  # the layers' forward time the transfer hides behind (None: prefill_s)

    @property
    def base_ttft_s(self) -> float:
        """The model's TTFT, before the TTFT residual."""
        return self.queue_s + self.prefill_s + self.kv_s - self.hidden_s + self.admit_s

    @property
    def ttft_s(self) -> float:
        return self.ttft_factor * self.base_ttft_s

    @property
    def base_tpot_s(self) -> float:
        return self.tpot_s / self.tpot_factor

    @property
    def where(self) -> str:
        return f"{self.prefill}->{self.decode}" if self.prefill is not None else f"local on {self.decode}"

    def describe(self) -> str:
        wait = "queue" if self.prefill is not None else "decode steps"
        parts = f"{wait} {self.queue_s:.3f} + prefill {self.prefill_s:.3f}"
        if self.prefill is not None:
            parts += f" + kv {self.kv_s:.3f} - hidden {self.hidden_s:.3f}"
        parts += f" + admit {self.admit_s:.3f}"
        if self.ttft_factor != 1.0 or self.tpot_factor != 1.0:
            return (f"TTFT {self.ttft_s:.3f}s {self.where} (x{self.ttft_factor:.2f} ({parts})), "
                    f"TPOT {self.tpot_s:.3f}s (x{self.tpot_factor:.2f})")
        return f"TTFT {self.ttft_s:.3f}s {self.where} ({parts}), TPOT {self.tpot_s:.3f}s"


def queued_tokens(worker: WorkerSnapshot, request: RequestInfo) -> int:
    unknown = max(0, worker.num_waiting + worker.num_running - worker.num_inflight)
    return worker.num_inflight_tokens + unknown * request.num_prompt_tokens


def decode_context(worker: WorkerSnapshot, request: RequestInfo) -> tuple[int, int]:
    """(batch, mean context in tokens) at `worker` once `request` joins."""
    batch = worker.load
    known = worker.num_inflight_tokens / worker.num_inflight if worker.num_inflight else request.num_prompt_tokens
    context = (known * batch + request.num_tokens) / (batch + 1)
    return batch, max(1, round(context))


def has_room(worker: WorkerSnapshot, num_tokens: int) -> bool:
    if not (worker.num_blocks and worker.block_size):
        return True
    return -(-num_tokens // worker.block_size) <= worker.num_free_blocks


def estimate_pair(
    profile: Profile, request: RequestInfo, prefill: WorkerSnapshot, decode: WorkerSnapshot,
    snapshot: ClusterSnapshot, *, cached_tokens: int = 0, prefill_factor: float = 1.0,
) -> Estimate:
    """A pair's estimate (module docstring). `profile`'s prefill times may carry the
    calibration's `prefill_factor`; the compute that hides the transfer is the unscaled time."""
    if not prefill_factor > 0:
        raise ValueError(f"prefill_factor must be > 0, got {prefill_factor!r}")
    n = request.num_prompt_tokens
    uncached = max(1, n - cached_tokens)
    queue = queued_tokens(prefill, request)
    queue_s = profile.prefill_seconds(queue)
    prefill_s = profile.prefill_seconds(uncached)
    link, state = snapshot.link(prefill, decode)
    kv_bytes_per_token = snapshot.kv_bytes_per_token or profile.kv_bytes_per_token
    kv_s = transfer_seconds(link, state, n * kv_bytes_per_token)
    compute_s = prefill_s / prefill_factor
    batch, context = decode_context(decode, request)
    return Estimate(
        prefill=prefill.worker_id, decode=decode.worker_id, queue_s=queue_s, prefill_s=prefill_s, kv_s=kv_s,
        hidden_s=hidden_seconds(kv_s, compute_s, profile.num_layers),
        admit_s=profile.decode_step_seconds(batch, context),
        tpot_s=profile.decode_step_seconds(batch + 1, context), room=has_room(decode, n),
        prefill_tokens=uncached, compute_s=compute_s,
    )


def hidden_seconds(kv_s: float, compute_s: float, num_layers: int) -> float:
    """The part of a `kv_s` transfer that a `compute_s` forward of `num_layers` layers hides
    (module docstring)."""
    return (num_layers - 1) / num_layers * min(kv_s, compute_s)


def estimate_local(
    profile: Profile, request: RequestInfo, decode: WorkerSnapshot, *, cached_tokens: int = 0,
) -> Estimate:
    uncached = max(1, request.num_prompt_tokens - cached_tokens)
    batch, context = decode_context(decode, request)
    step_s = profile.decode_step_seconds(batch, context)
    chunk = profile.max_num_batched_tokens
    chunks = -(-uncached // chunk)
    return Estimate(
        prefill=None, decode=decode.worker_id, queue_s=chunks * step_s,
        prefill_s=profile.prefill_seconds(uncached), kv_s=0.0, hidden_s=0.0, admit_s=step_s,
        tpot_s=profile.decode_step_seconds(batch + 1, context)
        + (profile.prefill_seconds(min(uncached, chunk)) if batch else 0.0),
        room=has_room(decode, request.num_prompt_tokens),
    )


# ---- the KV's precision on the wire --------------------------------------------------------------

# FP8 bytes / full-precision bytes of a transfer (kvtransfer.layout, FP8_WIRE): a bf16 block of 16
# tokens (head_dim >= 64) goes as 16 rows of e4m3, one row of float32 token scales and one row of
# channel exponents, 18/32 of its bytes.
FP8_WIRE_RATIO = 18 / 32

# Quantize on P plus dequantize on D, in Gbit/s of full-precision KV (kernels.kv_codec.pack_blocks /
# unpack_blocks), measured with benchmarks/bench_kv_codec.py (CUDA: --device cuda); the runs and the
# derivation: docs/usage.md, "KV precision on the wire". CPU (torch ops): the rate under load, scaled
# by the codec's later speed-up. CUDA (Triton): what a transfer's codec adds to TTFT. A transfer
# codes layer by layer, overlapped with the wire: every layer's pack runs on the prefill's GPU
# between its layers, each unpack on the decode GPU while later layers are on the wire, only the
# last one's after it; so the rate is that of the packs alone, rounded down.
CODEC_GBPS = {"cpu": 0.28, "cuda": 700.0}
KV_PRECISIONS = ("full", "fp8")


def fp8_wire_ratio(num_tokens: int, block_size: int = 16, head_blocks: int = 1, ratio: float = FP8_WIRE_RATIO) -> float:
    """FP8 bytes / full-precision bytes of a transfer of `num_tokens`: its first `head_blocks`
    blocks go at full precision (kvtransfer.layout.FP8_FULL_HEAD_BLOCKS, the attention sink),
    the rest at `ratio`. 1.0 for a prompt of no more blocks than that."""
    blocks = -(-num_tokens // block_size) if num_tokens > 0 else 0
    if blocks <= head_blocks:
        return 1.0
    return (head_blocks + ratio * (blocks - head_blocks)) / blocks


def choose_kv_precision(
    estimate: Estimate, kv_bytes: int, *, device: str = "cuda", slo_ttft: float | None = None,
    ratio: float = FP8_WIRE_RATIO, codec_gbps: float | None = None, min_ttft_fraction: float = 0.1,
) -> tuple[str, str]:
    """("fp8" | "full", reason) for a pair's transfer of `kv_bytes` (full precision) priced by
    `estimate` (its `kv_s` at full precision).

    FP8 when the transfer is the bound: its time is more than twice the quantize + dequantize
    cost (kv_bytes at `codec_gbps`, by `device` from CODEC_GBPS), FP8 saves more than that cost
    ((1 - ratio) x kv_s), and its exposed part (kv_s - hidden_s) is at least `min_ttft_fraction`
    of the predicted TTFT at full precision, or of the TTFT SLO when that is tighter. Full
    precision otherwise: a fast link (same node, NVLink) where the bytes are cheap, or compute
    that hides the transfer. (Until 2026-12-02 the fraction was of the SLO alone, so under a loose
    SLO a transfer that was a large part of the TTFT went at full precision: docs/usage.md, "KV
    precision on the wire".)"""
    if estimate.prefill is None or kv_bytes <= 0:
        return "full", "no KV transfer"
    gbps = codec_gbps if codec_gbps is not None else CODEC_GBPS.get(device, CODEC_GBPS["cuda"])
    codec_s = kv_bytes * 8 / (gbps * 1e9)
    kv_s = estimate.kv_s
    exposed = max(0.0, kv_s - estimate.hidden_s)
    saved = (1 - ratio) * kv_s - codec_s
    budget, what = estimate.base_ttft_s, "TTFT"
    if slo_ttft is not None and slo_ttft < budget:
        budget, what = slo_ttft, "TTFT SLO"
    facts = (f"kv {kv_s * 1e3:.1f} ms at full precision ({exposed * 1e3:.1f} ms exposed, "
             f"{exposed / budget:.0%} of the {what} {budget * 1e3:.0f} ms), codec {codec_s * 1e3:.1f} ms")
    if kv_s > 2 * codec_s and saved > 0 and budget > 0 and exposed >= min_ttft_fraction * budget:
        return "fp8", f"fp8: the link is the bound: {facts}, saves ~{saved * 1e3:.1f} ms"
    return "full", f"full: the link is not the bound: {facts}"


def at_wire_precision(
    estimate: Estimate, kv_bytes: int, num_layers: int, *, device: str = "cuda", slo_ttft: float | None = None,
    ratio: float = FP8_WIRE_RATIO, codec_gbps: float | None = None, switch: str = "auto",
) -> Estimate:
    """`estimate` (a pair priced at full precision) at the precision `choose_kv_precision` picks
    for it (or `switch`, --kv-wire-precision, when "full" or "fp8"): for FP8, kv = ratio x kv +
    the codec's time and the hidden part recomputed (module docstring), so the pair competes
    with local runs and other pairs at what it will cost."""
    if switch == "auto":
        precision, why = choose_kv_precision(estimate, kv_bytes, device=device, slo_ttft=slo_ttft, ratio=ratio,
                                             codec_gbps=codec_gbps)
    elif switch in KV_PRECISIONS:
        precision, why = switch, f"{switch}: set by --kv-wire-precision"
    else:
        raise ValueError(f"kv_wire_precision must be auto, full or fp8, got {switch!r}")
    if precision == "full":
        return replace(estimate, kv_precision="full", kv_precision_reason=why)
    gbps = codec_gbps if codec_gbps is not None else CODEC_GBPS.get(device, CODEC_GBPS["cuda"])
    kv_s = ratio * estimate.kv_s + kv_bytes * 8 / (gbps * 1e9)
    compute_s = estimate.prefill_s if estimate.compute_s is None else estimate.compute_s
    hidden_s = hidden_seconds(kv_s, compute_s, num_layers)
    return replace(estimate, kv_s=kv_s, hidden_s=hidden_s, kv_precision="fp8", kv_precision_reason=why)
