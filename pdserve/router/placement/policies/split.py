"""How many of a hybrid cluster's mixed workers should prefill for the others. Pure.

In a cluster of N mixed workers that can also send and receive KV, each request can run
locally (prefill and decode on one worker) or be split (prefill on one, KV over the link,
decode on another). Which is better depends on the load, not on the request alone: a local
prefill stalls every decode running on that worker (chunked prefill shares its steps), which
a tight TPOT SLO cannot absorb; a split keeps decode batches clean but leaves fewer workers
to decode and pays the KV transfer. So the choice is made for the cluster, from a model of
the steady state, and each request follows it (router.placement.policies.network_aware):

- k = 0 ("local"): every worker prefills and decodes its own requests; arrivals split evenly.
- k >= 1 ("split k"): k workers prefill, N - k decode; KV crosses the link for every request.

For each k, with the recent arrival rate lam, mean prompt P and output O (ArrivalWindow: quick
to see a rise, slow to believe a fall),
a profile of the engine (router.placement.profiles) and the KV link's rate:

- prefill duty u = lam_w * prefill(P) on a worker that prefills (lam_w its share of arrivals);
- TPOT t solves t = step(B, C) / (1 - u_d), with B = lam_d * O * t requests decoding there
  (Little's law), C = P + O/2 their mean context, u_d the prefill duty of a decode worker
  (u for k = 0, none for a split);
- TTFT = M/D/1 wait + service, the service being the prefill (plus, locally, the decode
  steps its chunks share; for a split, the exposed KV time and the admitting step);
  the link's utilisation lam_link * kv inflates the exposed KV time by 1 / (1 - rho);
- a k is infeasible when a utilisation reaches 1 or B exceeds the workers' batch limit.

Each k is scored by its worst SLO fraction, max(TTFT / slo_ttft, TPOT / slo_tpot) (without
SLOs: the mean request latency TTFT + O * TPOT). With SLOs the choice is by goodput first: each
k's SLO rate (`slo_rate`) is the highest arrival rate, up to lam, at which it meets both SLOs
(score <= 1); the k with the highest SLO rate wins, and among those that carry all of lam the
lowest score. So a split that the arrivals overload but that meets the SLOs at its capacity
(one prefill GPU serving what it can of 2k prompts, decodes clean) is kept rather than traded for
"local", which the same load makes miss a tight TPOT SLO on every request (the two-GPU sweep of
docs/two-gpu.md at its highest rate). Without SLOs, or when no k meets them at any
rate, the lowest score wins. Hysteresis keeps the current k unless another has a higher SLO
rate by `switch_margin`, or (at equal SLO rates) scores better by it.

Calibration (router.placement.policies.calibration): each k may come with `Factors` learned from the
router's outcomes. `prefill` multiplies the prefill service time of a split (the profile
misses the serving path: RPCs, KV gather and send), so with the served prefill f times the
profile's, u, the M/D/1 wait and the feasibility of a split all use f x prefill(P): a split
that the offline profile says can carry the rate but the served prefill cannot is infeasible.
`ttft` and `tpot` multiply the configuration's predicted TTFT and TPOT (residuals, e.g. a local
TPOT measured above its prediction) before the score. Neutral factors (no
outcomes yet) leave every number as above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.placement.policies.calibration import NEUTRAL, Factors
from pdserve.router.placement.profiles import Profile

_ITERATIONS = 60


@dataclass(frozen=True)
class Load:
    rate: float  # requests per second
    prompt_tokens: float  # mean
    output_tokens: float  # mean max_tokens


class _Ewma:
    """Exponentially weighted arrival count and length sums over a time constant."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.weight = 0.0  # decayed count of arrivals
        self.prompt = 0.0  # decayed sums
        self.output = 0.0
        self.last: float | None = None

    def decay(self, now: float) -> None:
        if self.last is not None and now <= self.last:
            return
        if self.last is not None:
            f = math.exp(-(now - self.last) / self.tau_s)
            self.weight *= f
            self.prompt *= f
            self.output *= f
        self.last = now

    def add(self, prompt_tokens: int, output_tokens: int) -> None:
        self.weight += 1.0
        self.prompt += prompt_tokens
        self.output += output_tokens

    def load(self, now: float, first: float) -> Load:
        # the decayed count over the window it covers (shorter than tau_s early on)
        span = self.tau_s * (1.0 - math.exp(-max(now - first, 1e-9) / self.tau_s))
        return Load(rate=self.weight / max(span, 1e-9), prompt_tokens=self.prompt / self.weight,
                    output_tokens=self.output / self.weight)


class ArrivalWindow:
    """The recent arrival rate and mean lengths: quick to see a rise, slow to believe a fall.

    Two exponentially weighted windows over the router's clock (`observe(now, ...)` from each
    snapshot): a slow one (`tau_s`) and a fast one (`fast_tau_s`). The estimate is the fast one
    while it sees a higher rate, else the slow one: a load step shows within a couple of
    seconds (the slow window alone saw a step of the two-GPU sweep only when its run was nearly
    over: docs/two-gpu.md, "The sweep"), while a lull does not at once undo a split that the
    next burst needs. The first `min_samples` arrivals give no estimate. `fast_tau_s=None`
    keeps the slow window alone."""

    def __init__(self, tau_s: float = 10.0, min_samples: int = 8, fast_tau_s: float | None = 2.0) -> None:
        taus = {"tau_s": tau_s} | ({} if fast_tau_s is None else {"fast_tau_s": fast_tau_s})
        for name, v in taus.items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if fast_tau_s is not None and fast_tau_s >= tau_s:
            raise ValueError(f"fast_tau_s must be < tau_s ({tau_s}), got {fast_tau_s!r}")
        self.min_samples = min_samples
        self._windows = [_Ewma(float(v)) for v in taus.values()]
        self._first: float | None = None
        self.samples = 0

    def observe(self, now: float, prompt_tokens: int, output_tokens: int) -> None:
        if self._first is None:
            self._first = now
        for w in self._windows:
            w.decay(now)
            w.add(prompt_tokens, output_tokens)
        self.samples += 1

    def estimate(self, now: float) -> Load | None:
        if self.samples < self.min_samples or self._first is None:
            return None
        loads = []
        for w in self._windows:
            w.decay(now)
            if w.weight > 0:
                loads.append(w.load(now, self._first))
        return max(loads, key=lambda load: load.rate) if loads else None


@dataclass(frozen=True)
class SplitPrediction:
    prefill_workers: int  # k; 0 = every request local
    ttft_s: float
    tpot_s: float
    score: float
    factors: Factors = NEUTRAL  # the calibration applied (ttft_s and tpot_s include it)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.score)

    def describe(self) -> str:
        kind = "local" if self.prefill_workers == 0 else f"split {self.prefill_workers}P"
        if not self.feasible:
            return f"{kind}: overloaded"
        return f"{kind}: TTFT {self.ttft_s:.3f}s TPOT {self.tpot_s * 1e3:.1f}ms score {self.score:.2f}"


INFEASIBLE = math.inf


def _mdl_wait(rate: float, service_s: float) -> float:
    """Mean M/D/1 queueing delay; inf at utilisation >= 1."""
    rho = rate * service_s
    if rho >= 1.0:
        return INFEASIBLE
    return rho * service_s / (2.0 * (1.0 - rho))


def decode_tpot(profile: Profile, rate: float, output_tokens: float, context: int, duty: float,
                max_batch: int) -> tuple[float, float]:
    """(TPOT, batch) of a worker decoding `rate` requests/s of `output_tokens` each, with a
    prefill duty `duty` stealing its time; (inf, inf) when it cannot keep up."""
    if duty >= 1.0:
        return INFEASIBLE, INFEASIBLE
    if rate <= 0:
        return profile.decode_step_seconds(1, context) / (1.0 - duty), 0.0
    t = profile.decode_step_seconds(1, context) / (1.0 - duty)
    for _ in range(_ITERATIONS):
        batch = max(1.0, rate * output_tokens * t)
        if batch > max_batch:
            return INFEASIBLE, INFEASIBLE
        t_next = profile.decode_step_seconds(math.ceil(batch), context) / (1.0 - duty)
        if abs(t_next - t) <= 1e-6 * t:
            t = t_next
            break
        t = t_next
    return t, max(1.0, rate * output_tokens * t)


def predict(profile: Profile, load: Load, workers: int, prefill_workers: int, *, kv_seconds: float,
            slo_ttft: float | None, slo_tpot: float | None, max_batch: int,
            factors: Factors = NEUTRAL) -> SplitPrediction:
    """The steady state of `workers` mixed workers with `prefill_workers` of them prefilling
    for the rest (0: all local); `kv_seconds`: one prompt's KV over a free link; `factors`:
    the calibration of this configuration (module docstring)."""
    n, k = workers, prefill_workers
    if not 0 <= k < n:
        raise ValueError(f"prefill_workers must be in [0, {n - 1}], got {k}")
    prompt = max(1, round(load.prompt_tokens))
    context = max(1, round(load.prompt_tokens + load.output_tokens / 2))
    prefill_s = profile.prefill_seconds(prompt) * factors.prefill
    if k == 0:
        lam = load.rate / n
        duty = lam * prefill_s
        tpot, batch = decode_tpot(profile, lam, load.output_tokens, context, duty, max_batch)
        if not math.isfinite(tpot):
            return SplitPrediction(0, INFEASIBLE, INFEASIBLE, INFEASIBLE, factors)
        chunks = -(-prompt // profile.max_num_batched_tokens)
        service = prefill_s + chunks * profile.decode_step_seconds(max(1, math.ceil(batch)), context)
        ttft = _mdl_wait(lam, service) + service
    else:
        lam_p, lam_d = load.rate / k, load.rate / (n - k)
        tpot, batch = decode_tpot(profile, lam_d, load.output_tokens, context, 0.0, max_batch)
        wait = _mdl_wait(lam_p, prefill_s)
        rho_link = load.rate / (k * (n - k)) * kv_seconds  # pairs share the arrivals evenly
        if not math.isfinite(tpot) or not math.isfinite(wait) or rho_link >= 1.0:
            return SplitPrediction(k, INFEASIBLE, INFEASIBLE, INFEASIBLE, factors)
        layers = profile.num_layers
        compute_s = profile.prefill_seconds(prompt)  # the unscaled forward hides the transfer (cost.estimate_pair)
        exposed = (kv_seconds - (layers - 1) / layers * min(kv_seconds, compute_s)) / (1.0 - rho_link)
        admit = profile.decode_step_seconds(max(1, math.ceil(batch)), context)
        ttft = wait + prefill_s + exposed + admit
    ttft, tpot = ttft * factors.ttft, tpot * factors.tpot
    if slo_ttft is None and slo_tpot is None:
        score = ttft + load.output_tokens * tpot
    else:
        score = max(ttft / slo_ttft if slo_ttft else 0.0, tpot / slo_tpot if slo_tpot else 0.0)
    return SplitPrediction(k, ttft, tpot, score, factors)


def slo_rate(profile: Profile, load: Load, workers: int, prefill_workers: int, *, kv_seconds: float,
             slo_ttft: float | None, slo_tpot: float | None, max_batch: int, factors: Factors = NEUTRAL,
             iterations: int = 20) -> float:
    """The highest arrival rate, up to `load.rate`, at which configuration `prefill_workers` is
    predicted to meet both SLOs (score <= 1) with `load`'s lengths: what it can serve within the
    SLOs at this load (bisection; the prediction worsens with the rate). 0.0 when it meets them at
    no rate, or without SLOs."""
    if slo_ttft is None and slo_tpot is None:
        return 0.0

    def meets(rate: float) -> bool:
        pred = predict(profile, Load(rate, load.prompt_tokens, load.output_tokens), workers, prefill_workers,
                       kv_seconds=kv_seconds, slo_ttft=slo_ttft, slo_tpot=slo_tpot, max_batch=max_batch,
                       factors=factors)
        return pred.score <= 1.0

    if load.rate <= 0 or meets(load.rate):
        return max(load.rate, 0.0)
    lo, hi = load.rate * 1e-3, load.rate
    if not meets(lo):
        return 0.0
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


class SplitChooser:
    """Keeps the cluster's current k and revisits it at each request (module docstring)."""

    def __init__(self, *, switch_margin: float = 0.1, tau_s: float = 10.0, min_samples: int = 8,
                 max_batch: int = 64, fast_tau_s: float | None = 2.0) -> None:
        if not 0 <= switch_margin < 1:
            raise ValueError(f"switch_margin must be in [0, 1), got {switch_margin!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        self.window = ArrivalWindow(tau_s=tau_s, min_samples=min_samples, fast_tau_s=fast_tau_s)
        self.switch_margin = switch_margin
        self.max_batch = max_batch
        self.current = 0
        self.last: list[SplitPrediction] = []
        self.last_slo_rates: list[float] = []  # slo_rate of each k at the last choice ([] when not modelled)

    def choose(self, profile: Profile, now: float, workers: int, *, kv_seconds: Callable[[float], float],
               slo_ttft: float | None, slo_tpot: float | None,
               factors: Callable[[int], Factors] | None = None) -> tuple[int, str]:
        """(k, why) for a request arriving at `now` (observe it first); `kv_seconds(prompt_tokens)`:
        a prompt's KV over a free link of the cluster; `factors(k)`: the calibration of
        configuration k (none: neutral). `last` holds the predictions ([] when not modelled)."""
        load = self.window.estimate(now)
        if load is None or workers < 2:
            self.current = 0
            self.last = []
            self.last_slo_rates = []
            return 0, f"local (too few arrivals to model: {self.window.samples})" if workers >= 2 else "local"
        self.current = min(self.current, workers - 1)
        kv = kv_seconds(load.prompt_tokens)
        preds = [predict(profile, load, workers, k, kv_seconds=kv, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                         max_batch=self.max_batch, factors=NEUTRAL if factors is None else factors(k))
                 for k in range(workers)]
        self.last = preds
        rates = [slo_rate(profile, load, workers, k, kv_seconds=kv, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                          max_batch=self.max_batch, factors=NEUTRAL if factors is None else factors(k))
                 for k in range(workers)]
        self.last_slo_rates = rates
        top = max(rates)
        current = preds[self.current]
        if top > 0.0:  # by goodput: the configuration that serves the most within the SLOs
            full = [p for p, r in zip(preds, rates) if r >= load.rate * (1 - 1e-9)]
            best = min(full, key=lambda p: (p.score, p.prefill_workers)) if full else \
                preds[max(range(workers), key=lambda k: (rates[k], -k))]
            r_best, r_current = rates[best.prefill_workers], rates[self.current]
            if best.prefill_workers != self.current and (
                    r_best > (1.0 + self.switch_margin) * r_current
                    or (r_best == r_current and best.score < (1.0 - self.switch_margin) * current.score)):
                self.current = best.prefill_workers
        else:
            best = min(preds, key=lambda p: (p.score, p.prefill_workers))
            # only to a configuration that can carry the load: when none can (a burst, or a rate
            # past every configuration's capacity), the cluster keeps the one it runs, rather than
            # falling back to "local" as the lowest k among equal infinite scores
            if best.feasible and best.prefill_workers != self.current and (
                    not current.feasible or best.score < (1.0 - self.switch_margin) * current.score):
                self.current = best.prefill_workers
        chosen = preds[self.current]

        def within(k: int) -> str:
            return f", within SLOs to {rates[k]:.2f} req/s" if top > 0.0 else ""
        others = "; ".join(p.describe() + within(p.prefill_workers) for p in preds
                           if p.prefill_workers != self.current)
        why = (f"{chosen.describe()}{within(self.current)} at {load.rate:.2f} req/s, prompt "
               f"{load.prompt_tokens:.0f}, output {load.output_tokens:.0f} (vs {others})")
        return self.current, why
