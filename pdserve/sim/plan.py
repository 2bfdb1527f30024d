"""`pdserve plan`: the pool sizes with the most goodput per GPU, searched with the simulator.

Given a workload (a trace's lengths and burstiness, or loadgen's distributions), the SLOs, a GPU
budget and a base cluster (profile, topology with its links, engine limits, router options),
each candidate configuration of the budget is sized by the highest arrival rate at which it
keeps `attainment` (default 90%) of the requests within both SLOs; its goodput is that rate x
the share within the SLOs, and the plan ranks the candidates by goodput per GPU.

Candidates (`enumerate_candidates`): every P:D split of the budget (1..N-1 prefill workers, the
rest decode; in steps of about N/`max_splits` for large budgets), N colocated mixed workers, and
N hybrid mixed workers that also move KV (the router chooses per request; network-aware, the
policy that chooses, places them). One worker is one GPU (no tensor parallelism: no profile of
a TP worker is measured yet).

Search, two stages:

1. Estimate, all candidates, in microseconds each: the hybrid split model of
   router.placement.policies.split (M/D/1 prefill queues, Little's law decode batches, the KV
   link) gives each configuration's SLO rate. It prunes: only the `simulate_top` disaggregated
   splits with the best estimates are simulated, plus the 1:1 split (the usual default, kept
   as the reference), colocated and hybrid.
2. Simulate, the survivors: the real placement policies over simulated workers (sim.run), a
   bounded number of requests a run (`requests_per_gpu` x GPUs, between `min_requests` and
   `max_requests`), the rate bracketed from the estimate and bisected (`bisections`).
   A candidate larger than `slice_gpus` (`hybrid_slice_gpus` for hybrid: network-aware's
   search grows fast with the workers) is simulated as a slice: the same P:D ratio on that
   many GPUs at the same rate per GPU (the router spreads a homogeneous load evenly, so a
   large pool is many slices; a slice pools a little less, so it errs low). Candidates with the
   same slice are simulated once. At 64 GPUs only hybrid is sliced; at 1,000 the splits step
   by 16 prefill workers and each is simulated as its 64-GPU slice.

Each candidate that loses gets one line why: the SLO it misses first above its capacity (TTFT:
prefill or queueing bound; TPOT: decode bound) and its goodput per GPU against the winner's, or
"pruned" with the estimate that pruned it. Pure of I/O; `pdserve/sim/plan_cli.py` is the command.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from pdserve.router.placement.policies.split import Load, predict, slo_rate
from pdserve.sim.config import ClusterConfig, WorkerConfig
from pdserve.sim.run import Arrival, simulate

log = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated", "hybrid")


@dataclass(frozen=True)
class Candidate:
    mode: str
    prefill: int = 0
    decode: int = 0
    mixed: int = 0

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode + self.mixed

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.mode == "disaggregated" else f"{self.mixed} {self.mode}"

    def workers(self, nodes: Sequence[str] = ()) -> tuple[WorkerConfig, ...]:
        """One node per worker: the topology's nodes in turn where it lists any (prefill and
        decode interleaved, so the links between them are the topology's), else a node each."""
        roles = (["prefill"] * self.prefill + ["decode"] * self.decode) if self.mode == "disaggregated" \
            else ["mixed"] * self.mixed
        counts: dict[str, int] = {}
        out = []
        for i, role in enumerate(roles):
            k = counts[role] = counts.get(role, -1) + 1
            node = nodes[i % len(nodes)] if nodes else f"node-{role[0]}{k}"
            out.append(WorkerConfig(f"{role}-{k}", role, node))
        return tuple(out)

    def slice(self, max_gpus: int) -> "Candidate":
        """The same shape on at most `max_gpus` GPUs (prefill and decode in the same ratio, at
        least one of each): what a large candidate is simulated as (module docstring)."""
        n = self.gpus
        if n <= max_gpus:
            return self
        if self.mode != "disaggregated":
            return replace(self, mixed=max_gpus)
        p = min(max(1, round(self.prefill * max_gpus / n)), max_gpus - 1)
        return replace(self, prefill=p, decode=max_gpus - p)

    def cluster(self, base: ClusterConfig) -> ClusterConfig:
        mode = "colocated" if self.mode == "colocated" else "disaggregated"  # hybrid: mixed workers, split mode
        nodes = base.topology.nodes
        return replace(base, workers=self.workers(nodes), mode=mode, hosts={})


def enumerate_candidates(gpus: int, *, max_splits: int = 64, modes: Sequence[str] = MODES) -> list[Candidate]:
    """The candidates of a budget of `gpus` (module docstring). Splits step by
    ceil((gpus - 1) / max_splits) prefill workers, always with 1:1 and both ends."""
    if gpus < 1:
        raise ValueError(f"the GPU budget must be >= 1, got {gpus}")
    out: list[Candidate] = []
    if "disaggregated" in modes and gpus >= 2:
        step = max(1, math.ceil((gpus - 1) / max_splits))
        ks = set(range(1, gpus, step)) | {gpus - 1} | ({gpus // 2} if gpus % 2 == 0 else set())
        out += [Candidate("disaggregated", prefill=k, decode=gpus - k) for k in sorted(ks)]
    if "colocated" in modes:
        out.append(Candidate("colocated", mixed=gpus))
    if "hybrid" in modes and gpus >= 2:
        out.append(Candidate("hybrid", mixed=gpus))
    return out


@dataclass(frozen=True)
class Workload:
    """A request mix: arrivals (offsets, lengths) at their own mean `rate`; `at_rate` replays
    the same requests compressed or stretched in time (a trace keeps its burstiness)."""

    arrivals: tuple[Arrival, ...]
    name: str = "workload"

    def __post_init__(self) -> None:
        if len(self.arrivals) < 2:
            raise ValueError("the workload needs at least 2 requests")

    @property
    def rate(self) -> float:
        span = self.arrivals[-1].offset_s - self.arrivals[0].offset_s
        return (len(self.arrivals) - 1) / span if span > 0 else math.inf

    @property
    def load(self) -> Load:
        n = len(self.arrivals)
        return Load(self.rate, sum(a.prompt_tokens for a in self.arrivals) / n,
                    sum(a.max_tokens for a in self.arrivals) / n)

    def at_rate(self, rate: float, num_requests: int) -> list[Arrival]:
        """`num_requests` arrivals at mean `rate` (the workload repeated end to end if short)."""
        base = self.arrivals
        t0 = base[0].offset_s
        period = (base[-1].offset_s - t0) + 1.0 / self.rate
        scale = 1.0 / (rate / self.rate)
        out = []
        for i in range(num_requests):
            lap, a = divmod(i, len(base))
            r = base[a]
            out.append(Arrival(((r.offset_s - t0) + lap * period) * scale, r.prompt_tokens, r.max_tokens,
                               r.prompt_tokens_est, r.group, r.prefix_key))
        return out


def distribution_workload(rate: float, input_len, output_len, *, num_requests: int = 4000, seed: int = 0,
                          burstiness: float = 1.0) -> Workload:
    """Poisson (gamma with `burstiness`) arrivals at `rate` with lengths drawn from loadgen's
    `LengthDist`s (loadgen.datasets)."""
    from pdserve.loadgen.arrivals import arrival_offsets

    offsets = arrival_offsets("gamma" if burstiness != 1.0 else "poisson", rate, num_requests=num_requests,
                              seed=seed, burstiness=burstiness)
    rng = np.random.default_rng(seed)
    ins, outs = input_len.sample(len(offsets), rng), output_len.sample(len(offsets), rng)
    return Workload(tuple(Arrival(float(o), int(i), int(m), int(i)) for o, i, m in zip(offsets, ins, outs)),
                    name=f"poisson {rate:g} req/s" if burstiness == 1.0 else f"gamma {rate:g} req/s")


@dataclass(frozen=True)
class SLOs:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the share of requests within both that a configuration must keep

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--slo-{name[:4]} must be > 0 seconds, got {getattr(self, name)!r}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment!r}")


@dataclass
class Measurement:
    """One simulated run of a candidate at one rate."""

    rate: float
    attainment: float  # requests within both SLOs / requests
    miss_ttft: float  # share of requests over the TTFT SLO (failed ones count as both)
    miss_tpot: float
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    wall_s: float


@dataclass
class Evaluation:
    candidate: Candidate
    estimate: float  # the split model's SLO rate, req/s
    simulated: bool = False
    rate: float = 0.0  # the highest simulated rate that kept the attainment
    at: Measurement | None = None  # the run at `rate`
    above: Measurement | None = None  # the lowest failing run above it (what binds)
    runs: int = 0
    sliced_as: str = ""  # the slice simulated for it ("" for itself)
    reason: str = ""  # why it loses ("" for the winner)

    @property
    def goodput(self) -> float:
        return self.rate * self.at.attainment if self.at is not None else 0.0

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.candidate.gpus

    @property
    def estimate_per_gpu(self) -> float:
        return self.estimate / self.candidate.gpus

    def bound(self) -> str:
        """The SLO missed first above the capacity: 'TTFT' or 'TPOT' ('' when not known)."""
        m = self.above
        if m is None:
            return ""
        return "TTFT" if m.miss_ttft >= m.miss_tpot else "TPOT"

    def to_dict(self) -> dict:
        c = self.candidate
        out = {"config": c.label, "mode": c.mode, "prefill": c.prefill, "decode": c.decode, "mixed": c.mixed,
               "gpus": c.gpus, "estimate_rps": round(self.estimate, 4), "simulated": self.simulated,
               "reason": self.reason}
        if self.simulated and self.at is not None:
            m = self.at
            out |= {"rate_rps": round(self.rate, 4), "goodput_rps": round(self.goodput, 4),
                    "goodput_per_gpu": round(self.goodput_per_gpu, 5), "attainment": round(m.attainment, 4),
                    "ttft_p50_s": round(m.ttft_p50, 4), "ttft_p90_s": round(m.ttft_p90, 4),
                    "tpot_p50_s": round(m.tpot_p50, 5), "tpot_p90_s": round(m.tpot_p90, 5),
                    "bound": self.bound(), "sim_runs": self.runs, "simulated_as": self.sliced_as or c.label}
        elif self.simulated:
            out |= {"rate_rps": 0.0, "goodput_rps": 0.0, "goodput_per_gpu": 0.0, "bound": self.bound(),
                    "sim_runs": self.runs}
        return out


@dataclass
class PlanOptions:
    policy: str = "least-loaded"  # disaggregated and colocated candidates; hybrid uses network-aware
    hybrid_policy: str = "network-aware"
    simulate_top: int = 4
    requests_per_gpu: int = 20
    min_requests: int = 240
    max_requests: int = 2400
    bisections: int = 3
    max_splits: int = 64
    slice_gpus: int = 64
    hybrid_slice_gpus: int = 16
    modes: tuple[str, ...] = MODES
    seed: int = 0


@dataclass
class Plan:
    gpus: int
    slos: SLOs
    workload: str
    offered_rate: float
    evaluations: list[Evaluation]  # the best first: simulated by goodput per GPU, then the pruned
    wall_s: float
    options: PlanOptions = field(default_factory=PlanOptions)

    @property
    def best(self) -> Evaluation:
        return self.evaluations[0]

    def find(self, label: str) -> Evaluation | None:
        return next((e for e in self.evaluations if e.candidate.label == label), None)

    def to_dict(self) -> dict:
        best = self.best
        return {"gpus": self.gpus, "slo_ttft_s": self.slos.ttft_s, "slo_tpot_s": self.slos.tpot_s,
                "attainment": self.slos.attainment, "workload": self.workload,
                "offered_rate_rps": round(self.offered_rate, 4), "policy": self.options.policy,
                "best": best.to_dict(), "candidates": [e.to_dict() for e in self.evaluations],
                "wall_s": round(self.wall_s, 2)}


def kv_seconds(base: ClusterConfig, prompt_tokens: float) -> float:
    """One mean prompt's KV over the topology's link between two workers' nodes (its default
    remote link when the nodes are not listed)."""
    topo = base.topology
    nodes = topo.nodes
    link = topo.link(nodes[0], nodes[1]) if len(nodes) >= 2 else topo.link("node-p0", "node-d0")
    return prompt_tokens * base.profile.kv_bytes_per_token * 8 / (link.capacity_gbps * 1e9) + link.latency_ms / 1e3


def estimate(candidate: Candidate, base: ClusterConfig, load: Load, slos: SLOs) -> float:
    """The split model's SLO rate of `candidate` (req/s; 0 when it meets the SLOs at no rate)."""
    n = candidate.gpus
    profile = base.decode_profile or base.profile
    # slo_rate bisects below load.rate: start from every worker prefilling back to back
    ceiling = Load(1.01 * n / base.profile.prefill_seconds(max(1, round(load.prompt_tokens))),
                   load.prompt_tokens, load.output_tokens)
    kv = kv_seconds(base, load.prompt_tokens)
    kw = dict(kv_seconds=kv, slo_ttft=slos.ttft_s, slo_tpot=slos.tpot_s, max_batch=base.engine.max_num_seqs)
    if candidate.mode == "disaggregated":
        ks = [candidate.prefill]
    elif candidate.mode == "colocated":
        ks = [0]
    else:  # hybrid: the router picks the best k for the load; the model at a few k stands for it
        ks = sorted({0, 1, max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4), n - 1} - {n}) if n >= 2 else [0]
    return max(slo_rate(profile, ceiling, n, k, iterations=30, **kw) for k in ks)


def _estimate_bound(candidate: Candidate, base: ClusterConfig, load: Load, slos: SLOs, rate: float) -> str:
    if candidate.mode != "disaggregated":
        return ""
    p = predict(base.profile, Load(max(rate, 1e-3) * 1.1, load.prompt_tokens, load.output_tokens), candidate.gpus,
                candidate.prefill, kv_seconds=kv_seconds(base, load.prompt_tokens), slo_ttft=slos.ttft_s,
                slo_tpot=slos.tpot_s, max_batch=base.engine.max_num_seqs)
    if not math.isfinite(p.score):
        return "prefill overloaded" if math.isinf(p.ttft_s) and math.isfinite(p.tpot_s) else "overloaded"
    return "TTFT" if p.ttft_s / slos.ttft_s >= p.tpot_s / slos.tpot_s else "TPOT"


def measure(config: ClusterConfig, policy: str, arrivals: list[Arrival], slos: SLOs, *, seed: int = 0) -> Measurement:
    """Simulates `arrivals` on `config` and scores the requests against the SLOs."""
    run = simulate(config, policy, arrivals, seed=seed, record_tokens=False)
    ttfts, tpots = [], []
    ok = miss_ttft = miss_tpot = 0
    for r in run.requests:
        if r.error is not None or r.first_token_time is None:
            miss_ttft += 1
            miss_tpot += 1
            continue
        ttft = r.first_token_time - r.sent
        tpot = ((r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
                if r.num_output_tokens > 1 and r.last_token_time is not None else 0.0)
        ttfts.append(ttft)
        tpots.append(tpot)
        bad_ttft, bad_tpot = ttft > slos.ttft_s, tpot > slos.tpot_s
        miss_ttft += bad_ttft
        miss_tpot += bad_tpot
        ok += not (bad_ttft or bad_tpot)
    n = max(len(run.requests), 1)

    def q(xs, p):
        return float(np.percentile(xs, p)) if xs else math.inf

    rate = (len(arrivals) - 1) / (arrivals[-1].offset_s - arrivals[0].offset_s) if len(arrivals) > 1 else 0.0
    return Measurement(rate, ok / n, miss_ttft / n, miss_tpot / n, q(ttfts, 50), q(ttfts, 90), q(tpots, 50),
                       q(tpots, 90), run.wall_s)


def size(evaluation: Evaluation, base: ClusterConfig, workload: Workload, slos: SLOs, options: PlanOptions,
         correction: float = 1.0) -> None:
    """The highest rate at which the candidate keeps the attainment: bracketed from the
    estimate (x1.5 up or /1.5 down, up to 4 steps each way), then bisected; on its slice
    (module docstring), the rates scaled back to the whole candidate. `correction`: the
    simulated / estimated rate of the candidates sized so far (the first bracket starts there)."""
    whole = evaluation.candidate
    c = whole.slice(options.hybrid_slice_gpus if whole.mode == "hybrid" else options.slice_gpus)
    scale = whole.gpus / c.gpus
    num_requests = min(max(options.requests_per_gpu * c.gpus, options.min_requests), options.max_requests)
    config = c.cluster(base)
    policy = options.hybrid_policy if c.mode == "hybrid" else options.policy

    def run(rate: float) -> Measurement:
        evaluation.runs += 1
        return measure(config, policy, workload.at_rate(rate, num_requests), slos, seed=options.seed)

    start = evaluation.estimate * correction / scale if evaluation.estimate > 0 else 0.05 * c.gpus
    good: Measurement | None = None
    bad: Measurement | None = None
    m = run(start)
    if m.attainment >= slos.attainment:
        good = m
        for _ in range(4):
            m = run(good.rate * 1.5)
            if m.attainment < slos.attainment:
                bad = m
                break
            good = m
    else:
        bad = m
        for _ in range(4):
            m = run(bad.rate / 1.5)
            if m.attainment >= slos.attainment:
                good = m
                break
            bad = m
    if good is not None and bad is not None:
        for _ in range(options.bisections):
            m = run(math.sqrt(good.rate * bad.rate))
            if m.attainment >= slos.attainment:
                good = m
            else:
                bad = m
    evaluation.simulated = True
    evaluation.sliced_as = c.label if c != whole else ""
    evaluation.at, evaluation.above = good, bad
    evaluation.rate = good.rate * scale if good is not None else 0.0


def plan(base: ClusterConfig, workload: Workload, slos: SLOs, gpus: int, *, options: PlanOptions | None = None,
         progress: Callable[[str], None] | None = None) -> Plan:
    """The plan (module docstring). `progress(label)` is called as each candidate is simulated."""
    options = options or PlanOptions()
    start = time.perf_counter()
    load = workload.load
    evaluations = [Evaluation(c, estimate(c, base, load, slos))
                   for c in enumerate_candidates(gpus, max_splits=options.max_splits, modes=options.modes)]
    splits = sorted((e for e in evaluations if e.candidate.mode == "disaggregated"),
                    key=lambda e: (-e.estimate, abs(e.candidate.prefill - e.candidate.decode)))
    chosen = {id(e) for e in splits[:options.simulate_top]}
    chosen |= {id(e) for e in evaluations if e.candidate.mode != "disaggregated"
               or e.candidate.prefill == e.candidate.decode}
    done: dict[Candidate, Evaluation] = {}
    for e in evaluations:
        if id(e) not in chosen:
            continue
        c = e.candidate
        key = c.slice(options.hybrid_slice_gpus if c.mode == "hybrid" else options.slice_gpus)
        twin = done.get(key)
        if twin is not None:  # the same slice: the same runs, per GPU
            scale = c.gpus / twin.candidate.gpus
            e.simulated, e.sliced_as, e.at, e.above = True, key.label, twin.at, twin.above
            e.rate = twin.rate * scale
            continue
        if progress is not None:
            progress(c.label if key == c else f"{c.label} as {key.label}")
        ratios = sorted(d.rate / d.estimate for d in done.values() if d.rate > 0 and d.estimate > 0)
        size(e, base, workload, slos, options, correction=ratios[len(ratios) // 2] if ratios else 1.0)
        done[key] = e
        log.info("%s: %.3f req/s within the SLOs (%d runs)", c.label, e.rate, e.runs)
    simulated = sorted((e for e in evaluations if e.simulated),
                       key=lambda e: (-e.goodput_per_gpu, -e.estimate_per_gpu, e.candidate.label))
    pruned = sorted((e for e in evaluations if not e.simulated), key=lambda e: -e.estimate_per_gpu)
    ranked = simulated + pruned
    best = ranked[0]
    for e in ranked[1:]:
        e.reason = _reason(e, best, base, load, slos)
    return Plan(gpus=gpus, slos=slos, workload=workload.name, offered_rate=workload.rate, evaluations=ranked,
                wall_s=time.perf_counter() - start, options=options)


def _reason(e: Evaluation, best: Evaluation, base: ClusterConfig, load: Load, slos: SLOs) -> str:
    if not e.simulated:
        bound = _estimate_bound(e.candidate, base, load, slos, e.estimate)
        return (f"pruned: the model's estimate, {e.estimate_per_gpu:.4f} req/s per GPU within the SLOs"
                + (f" ({bound} bound)" if bound else "") + ", ranks it below the splits simulated")
    bound = e.bound()
    what = {"TTFT": "misses TTFT first (prefill/queue bound)",
            "TPOT": "misses TPOT first (decode bound)"}.get(bound, "")
    if e.at is None:
        return "meets the SLOs at no simulated rate" + (f": {what}" if what else "")
    if best.goodput_per_gpu <= 0:
        return what or "no goodput"
    lower = 1 - e.goodput_per_gpu / best.goodput_per_gpu
    text = f"{lower * 100:.0f}% lower goodput per GPU ({e.goodput_per_gpu:.4f} vs {best.goodput_per_gpu:.4f})"
    return f"{text}; above {e.rate:.3g} req/s it {what}" if what else text

