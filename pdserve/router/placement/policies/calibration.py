"""Online calibration of network-aware's model from what the router observes. Pure.

The cost model (router.placement.policies.cost) and the split model (router.placement.policies.split) predict from
an offline profile of the engine, which misses the serving path: HTTP/gRPC, KV gather and
send, Python between steps. On two GPUs a served prefill took far longer than the profile's
(docs/two-gpu.md, "The sweep"), so a split the model called feasible built an unbounded TTFT
queue. Like a serving
planner that corrects its models from live metrics, the policy keeps, per quantity q::

    r_q <- r_q + alpha (clamp(observed / predicted) - r_q)     (the first sample sets r_q)
    factor_q = r_q once `min_samples` samples are in, else 1

where clamp keeps each ratio in [lo, hi] (default [0.5, 4]: one stalled request cannot teach
the policy that the engine is 100x slower). The quantities:

- ``prefill``: a disaggregated request's prefill as its prefill worker reports it (first
  chunk to first token, its queue excluded) over the profile's prefill of its uncached prompt,
  n tokens. It is the served prefill's *service time*, so it acts on capacity: the split
  model's prefill utilisation (its M/D/1 queue and its feasibility) and the cost model's
  prefill queue and prefill time use profile x factor. It is learned against the raw profile
  (no feedback loop). A request that waited at P for at least one full step (P backlogged)
  shares its first and last steps with its neighbours' chunks: a backlogged chunked-prefill
  worker runs full steps of B = max_num_batched_tokens, and n tokens touch n/B + 1 of them on
  average, so its prediction is (n/B + 1) x prefill(B) (for n = 1000, B = 512: 1.51x prefill(n)
  on a linear profile), not prefill(n), which would read the sharing as a slower engine.
- ``ttft.local``, ``ttft.disaggregated``, ``tpot.local``, ``tpot.disaggregated``: the residual
  of the per-request estimates (router.placement.policies.cost) for the kind of run the request had,
  observed over the estimate *with* the prefill correction and *without* the residual itself,
  so that the residual does not feed on itself and does not count the prefill twice (early
  on, before the prefill factor is in use, the queue a too-fast profile builds at P is the
  prefill factor's error, not a residual: a disaggregated TTFT predicted then is not learned
  from when the outcome reports a prefill). They scale the estimates' TTFT and TPOT, which
  decide the pair-vs-local competition, the SLO checks and the TPOT feasibility.
- ``split.ttft.local``, ``split.ttft.split``, ``split.tpot.local``, ``split.tpot.split``: the
  same residuals for the hybrid split model's steady-state prediction of the configuration a
  request ran under (k = 0, or k >= 1), which scale that configuration's TTFT and TPOT and so
  its score.

A placement's predictions wait in a bounded table (oldest dropped first: requests that never
finish, e.g. errors) until the request's outcome arrives. An outcome is used only when it ran
where it was placed, in one attempt (a recovery's times are not the model's). When a hybrid
cluster changes its configuration, the requests placed before the change ran partly in each
(a split's decode worker that starts prefilling local requests slows the split requests it
still decodes 2x in the simulator): their outcomes teach the prefill factor, not the
residuals. Nor is anything learned from the requests placed while the previous
configuration's requests still drain (`settled` False: the policy expects that to take the
prompts in flight on the busiest worker at the served prefill rate, then their mean output x
that configuration's TPOT): a split's first hand-off prefills, on a worker still decoding its
local requests, took about twice a dedicated prefill worker's (docs/two-gpu.md, "The sweep"),
which would read as a slow engine and undo the split at once. Factors only move with the
placements that produce samples: a configuration
the policy no longer uses keeps its last factors.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.router.placement.base import Outcome

QUANTITIES = ("prefill", "ttft.local", "ttft.disaggregated", "tpot.local", "tpot.disaggregated",
              "split.ttft.local", "split.ttft.split", "split.tpot.local", "split.tpot.split")


@dataclass(frozen=True)
class Factors:
    """Multipliers of one option's model: `prefill` on the prefill service time, `ttft` and
    `tpot` on the predicted times."""

    prefill: float = 1.0
    ttft: float = 1.0
    tpot: float = 1.0


NEUTRAL = Factors()


class Ratio:
    """An exponentially weighted observed / predicted ratio (module docstring)."""

    def __init__(self, *, alpha: float, lo: float, hi: float, min_samples: int) -> None:
        self.alpha, self.lo, self.hi, self.min_samples = alpha, lo, hi, min_samples
        self.value = 1.0
        self.samples = 0

    def observe(self, observed: float, predicted: float) -> bool:
        if not (math.isfinite(observed) and math.isfinite(predicted)) or observed < 0 or predicted <= 0:
            return False
        r = min(self.hi, max(self.lo, observed / predicted))
        self.value = r if self.samples == 0 else self.value + self.alpha * (r - self.value)
        self.samples += 1
        return True

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    @property
    def factor(self) -> float:
        return self.value if self.ready else 1.0


@dataclass(frozen=True)
class Prediction:
    """What the model predicted for a placed request, to be compared with its outcome.

    `ttft_s`/`tpot_s`: the per-request estimate with the prefill correction, without the
    residuals; `prefill_s`: the raw profile's prefill of the uncached prompt (disaggregated),
    `prefill_busy_s` the same prompt's span on a backlogged worker, `prefill_step_s` the
    profile's full step (the queue beyond which the worker counts as backlogged);
    `split_k`, `split_ttft_s`, `split_tpot_s`: the hybrid split model's prediction for the
    configuration the request ran under (None outside hybrid clusters), likewise."""

    kind: str  # "local" | "disaggregated"
    prefill: str | None
    decode: str
    ttft_s: float
    tpot_s: float
    prefill_s: float = 0.0
    prefill_busy_s: float = 0.0
    prefill_step_s: float = math.inf
    prefill_in_use: bool = True  # the prefill factor was in use when this was predicted
    epoch: int = 0  # the cluster configuration it was placed in (Calibration.epoch)
    settled: bool = True  # placed after the previous configuration's requests drained
    split_k: int | None = None
    split_ttft_s: float = math.nan
    split_tpot_s: float = math.nan


class Calibration:
    """The factors and the predictions waiting for their outcomes (module docstring)."""

    def __init__(self, *, alpha: float = 0.2, lo: float = 0.5, hi: float = 4.0, min_samples: int = 4,
                 max_pending: int = 4096) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"the clamp must hold 1 (0 < lo <= 1 <= hi), got [{lo!r}, {hi!r}]")
        if min_samples < 1 or max_pending < 1:
            raise ValueError("min_samples and max_pending must be >= 1")
        self.ratios = {q: Ratio(alpha=alpha, lo=lo, hi=hi, min_samples=min_samples) for q in QUANTITIES}
        self.max_pending = max_pending
        self._pending: OrderedDict[str, Prediction] = OrderedDict()
        self.num_outcomes = 0  # outcomes used
        self.epoch = 0  # bumped when the cluster's configuration changes (hybrid: k)

    # ---------------------------------------------------------------- factors

    def factor(self, quantity: str) -> float:
        return self.ratios[quantity].factor

    def factors(self) -> dict[str, float]:
        return {q: r.factor for q, r in self.ratios.items()}

    def estimate_factors(self, kind: str) -> Factors:
        """For a per-request estimate of a run of `kind` (local | disaggregated)."""
        return Factors(prefill=self.factor("prefill") if kind == "disaggregated" else 1.0,
                       ttft=self.factor(f"ttft.{kind}"), tpot=self.factor(f"tpot.{kind}"))

    def split_factors(self, prefill_workers: int) -> Factors:
        """For the split model's configuration with `prefill_workers` (0: all local)."""
        config = "split" if prefill_workers else "local"
        return Factors(prefill=self.factor("prefill") if prefill_workers else 1.0,
                       ttft=self.factor(f"split.ttft.{config}"), tpot=self.factor(f"split.tpot.{config}"))

    def describe(self) -> str:
        """The factors in use ("" when none is), e.g. "prefill x1.60, ttft.disaggregated x1.21"."""
        return ", ".join(f"{q} x{r.value:.2f}" for q, r in self.ratios.items() if r.ready)

    # ---------------------------------------------------------------- predictions and outcomes

    def new_epoch(self) -> None:
        """The cluster's configuration changed: requests placed before it are not learned from
        for the residuals (they ran partly in each configuration)."""
        self.epoch += 1

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def expect(self, request_id: str, prediction: Prediction) -> None:
        """Remembers `prediction` until `request_id`'s outcome (a re-placement replaces it)."""
        self._pending.pop(request_id, None)
        self._pending[request_id] = prediction
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def observe(self, outcome: Outcome) -> bool:
        """Learns from `outcome` when its prediction is waiting and it ran as predicted."""
        p = self._pending.pop(outcome.request_id, None)
        if p is None or not p.settled or outcome.attempts > 1 or outcome.placement != p.kind:
            return False
        if outcome.decode_worker != p.decode or (p.kind == "disaggregated" and outcome.prefill_worker != p.prefill):
            return False
        config = None if p.split_k is None else ("split" if p.split_k else "local")
        # a disaggregated TTFT predicted before the prefill factor was in use is not the
        # residual's to learn: the queue that the missing factor builds is the factor's error
        stable = p.epoch == self.epoch
        learn_ttft = stable and (p.kind == "local" or p.prefill_in_use or outcome.prefill_s is None)
        if outcome.ttft_s is not None and learn_ttft:
            self.ratios[f"ttft.{p.kind}"].observe(outcome.ttft_s, p.ttft_s)
            if config is not None:
                self.ratios[f"split.ttft.{config}"].observe(outcome.ttft_s, p.split_ttft_s)
        if outcome.tpot_s is not None and stable:
            self.ratios[f"tpot.{p.kind}"].observe(outcome.tpot_s, p.tpot_s)
            if config is not None:
                self.ratios[f"split.tpot.{config}"].observe(outcome.tpot_s, p.split_tpot_s)
        if p.kind == "disaggregated" and outcome.prefill_s is not None:
            busy = outcome.prefill_queue_s is not None and outcome.prefill_queue_s >= p.prefill_step_s
            self.ratios["prefill"].observe(outcome.prefill_s, p.prefill_busy_s if busy else p.prefill_s)
        self.num_outcomes += 1
        return True
