"""Network-aware placement: the option with the lowest predicted TTFT that meets the SLOs.

For a request that may be disaggregated (router.placement.base's shared rules decide that):
1. every (P, D) pair with P != D and every local run on D is an option, priced by
   router.placement.policies.cost; router.placement.policies.search finds the best ones without pricing
   them all, over arrays of the workers kept across placements (pricing every option, the
   reference it is tested against, is router.placement.policies.oracle);
2. an option is feasible when D has free KV blocks for the prompt (when it reports them) and,
   with `slo_tpot`, its predicted TPOT at D is within it;
3. the best feasible pair and the best feasible local run (lowest TTFT; ties to the less loaded
   workers, then worker ids) compete: local wins only when its TTFT is lower than the best
   pair's by more than `local_margin` (a fraction). Disaggregation is the default because it
   keeps prefill work off decode workers, which the TTFT of one request does not price.
   `local_prefill=False` (--no-local-prefill) takes local runs out of the competition: a
   decode worker prefills only when no pair is feasible (strict disaggregation, as engines
   without a local path serve);
4. with `slo_ttft`, an option that meets it beats one that does not;
5. when no option is feasible, or none meets `slo_ttft`: with `admission_control`,
   SLOUnattainable (the router answers 429); without, the lowest-TTFT option (best effort).

Short prompts, resumed requests and colocated mode keep the shared rules; there the decode
worker with the lowest predicted local TTFT (within the TPOT SLO where possible) is taken.
The `Decision.reason` carries the predicted numbers.

The KV's precision on the wire: for the chosen pair, `Decision.kv_precision` is "fp8" when the
link is the bound (router.placement.policies.cost.choose_kv_precision: the predicted transfer at
full precision is more than twice the quantize + dequantize cost and its exposed part at least a
tenth of the TTFT SLO, or of the predicted TTFT without one), "full" where it is not (same node,
NVLink, a fast link); `Decision.kv_precision_reason` says why. The best pair (searched at full
precision) is priced at its precision before it competes with the best local run, so FP8 can keep
a prompt disaggregated over a slow link. `kv_wire_precision` "full" or "fp8" (the router's
--kv-wire-precision) fixes the precision instead.

Hybrid clusters (every candidate a mixed worker that also moves KV, `pdserve up --mode
hybrid`): how many workers prefill for the others is chosen for the cluster from the recent
load, the profile, the measured link and the SLOs (router.placement.policies.split); with k = 0 the
request runs locally on the worker with the lowest predicted TTFT, otherwise it is prefilled
on one of the k prefilling workers and decoded on one of the others (the pair with the lowest
predicted TTFT, as above). The prefilling workers stay the same while k does; when k changes,
the least loaded become them.

Calibration (router.placement.policies.calibration): at each placement the policy remembers what its
model predicted for the chosen option (and, on a hybrid cluster, the split model's prediction
for the configuration in use); `observe_outcome` compares the request's measured TTFT, TPOT
and reported prefill with it and keeps exponentially weighted observed/predicted factors,
separately for local and disaggregated runs. They are applied to what is compared: pairs are
priced with the prefill times scaled by the prefill factor (queue and prefill at P), each
option's TTFT and TPOT by its kind's residuals (so the pair-vs-local competition, the SLOs
and the TPOT feasibility use them), and the split model's configurations by theirs (the
prefill factor on the split's prefill service time, hence on its capacity). Until enough
outcomes arrive every factor is 1 and the policy decides as without calibration. The factors
in use are named at the end of `Decision.reason` ("calibrated: prefill x1.60, ...").
`calibrate=False` keeps the offline model alone (outcomes are ignored).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from pdserve.router.placement.base import (
    ClusterSnapshot,
    Decision,
    Outcome,
    PoolPolicy,
    Purpose,
    RequestInfo,
    SLOUnattainable,
    WorkerSnapshot,
)
from pdserve.router.placement.policies.baselines import PrefixIndex
from pdserve.router.placement.policies.calibration import Calibration, Prediction
from pdserve.router.placement.policies.columns import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, Columns
from pdserve.router.placement.policies.search import Search
from pdserve.router.placement.congestion import transfer_seconds
from pdserve.router.placement.policies.cost import (Estimate, at_wire_precision, estimate_local, estimate_pair,
                                                    fp8_wire_ratio)
from pdserve.router.placement.policies.split import SplitChooser, SplitPrediction
from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Topology


log = logging.getLogger(__name__)


class NetworkAware(PoolPolicy):
    name = "network-aware"
    uses_link_estimates = True

    def __init__(
        self, *, profile: Profile | None = None, topology: Topology | None = None,
        slo_ttft: float | None = None, slo_tpot: float | None = None, admission_control: bool = False,
        local_margin: float = 0.2, block_size: int = 16, local_prefill_max_tokens: int = 0,
        max_batch: int = 64, calibrate: bool = True, columnar: bool | None = None,
        kv_wire_precision: str = "auto", local_prefill: bool = True,
    ) -> None:
        super().__init__(local_prefill_max_tokens=local_prefill_max_tokens)
        if not isinstance(profile, Profile):
            raise ValueError("network-aware needs --profile (a file from `pdserve profile` measured on this "
                             "hardware): its predictions come from measured prefill and decode times")
        for name, value in (("slo_ttft", slo_ttft), ("slo_tpot", slo_tpot)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(admission_control, bool):
            raise ValueError(f"admission_control must be true or false, got {admission_control!r}")
        if admission_control and slo_ttft is None and slo_tpot is None:
            raise ValueError("admission control needs an SLO to enforce (--slo-ttft and/or --slo-tpot)")
        if isinstance(local_margin, bool) or not isinstance(local_margin, (int, float)) or not 0 <= local_margin < 1:
            raise ValueError(f"local_margin must be in [0, 1), got {local_margin!r}")
        if kv_wire_precision not in ("auto", "full", "fp8"):
            raise ValueError(f"kv_wire_precision must be auto, full or fp8, got {kv_wire_precision!r}")
        self.kv_wire_precision = kv_wire_precision  # the backend's switch: "auto" lets the link decide
        self.profile = profile
        self.topology = topology
        self.slo_ttft = slo_ttft
        self.slo_tpot = slo_tpot
        self.admission_control = admission_control
        self.local_margin = float(local_margin)
        if not isinstance(local_prefill, bool):
            raise ValueError(f"local_prefill must be true or false, got {local_prefill!r}")
        self.local_prefill = local_prefill  # False (--no-local-prefill): a feasible pair always wins
        self.prefixes = PrefixIndex(block_size=block_size)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (the workers' --max-num-seqs), got {max_batch!r}")
        self.split = SplitChooser(max_batch=max_batch)
        self._prefilling: tuple[str, ...] = ()  # hybrid: the workers that prefill for the others now
        if not isinstance(calibrate, bool):
            raise ValueError(f"calibrate must be true or false, got {calibrate!r}")
        self.calibrate = calibrate
        self.calibration = Calibration()
        self._pair_profile_cache: tuple[float, Profile] = (1.0, profile)
        # set while placing: the chosen estimate and the split model's prediction in use
        self._chosen: Estimate | None = None
        self._split_chosen: SplitPrediction | None = None
        self._residuals = {kind: self.calibration.estimate_factors(kind) for kind in ("local", "disaggregated")}
        self._settle_until = -math.inf  # hybrid: the previous configuration's requests drain until then
        self._now = 0.0
        self._kv_bytes = 0
        self._num_tokens = 0
        if columnar is not None:  # it chose between two searches; there is one now
            if not isinstance(columnar, bool):
                raise ValueError(f"columnar must be true or false, got {columnar!r}")
            log.warning("network-aware: the option columnar=%s is deprecated and ignored: one search serves "
                        "every cluster", columnar)
        self._columns = Columns()  # the workers as arrays, kept across placements

    # ---------------------------------------------------------------- calibration

    def place(self, request: RequestInfo, snapshot: ClusterSnapshot) -> Decision:
        self._chosen = self._split_chosen = None
        cal = self.calibration  # the residuals of this placement, read once
        self._residuals = {kind: cal.estimate_factors(kind) for kind in ("local", "disaggregated")}
        self._now = snapshot.now
        # the prompt's KV bytes at full precision (measured per token when known): what the link moves
        self._kv_bytes = request.num_prompt_tokens * (snapshot.kv_bytes_per_token or self.profile.kv_bytes_per_token)
        self._num_tokens = request.num_prompt_tokens
        self._columns.update(snapshot)
        decision = self._place_disaggregated(request, snapshot)
        if decision is None:
            decision = super().place(request, snapshot)
        try:
            if self.calibrate:
                self._remember(request, decision)
        finally:
            self._chosen = self._split_chosen = None
        note = self.calibration.describe()
        if note:
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; calibrated: {note}")
        return decision

    def observe_outcome(self, outcome: Outcome) -> None:
        if self.calibrate:
            self.calibration.observe(outcome)

    def calibration_factors(self) -> dict[str, float]:
        return self.calibration.factors()

    def _remember(self, request: RequestInfo, decision: Decision) -> None:
        e = self._chosen
        if e is None or decision.degraded or e.decode != decision.decode or e.prefill != decision.prefill:
            return
        kind = "local" if e.prefill is None else "disaggregated"
        # the estimate's prefill is the profile's scaled by the prefill factor for pairs
        prefill_factor = self._pair_profile_cache[0] if e.prefill is not None else 1.0
        budget = self.profile.max_num_batched_tokens
        step_s = self.profile.prefill_seconds(budget)
        busy_s = (e.prefill_tokens / budget + 1.0) * step_s if e.prefill is not None else 0.0
        split = self._split_chosen
        if split is not None and (split.prefill_workers > 0) != (kind == "disaggregated"):
            split = None  # the request did not run as its configuration does (no pair was free)
        self.calibration.expect(request.request_id, Prediction(
            kind=kind, prefill=e.prefill, decode=e.decode, ttft_s=e.base_ttft_s, tpot_s=e.base_tpot_s,
            prefill_s=e.prefill_s / prefill_factor, prefill_busy_s=busy_s, prefill_step_s=step_s,
            prefill_in_use=self.calibration.ratios["prefill"].ready, epoch=self.calibration.epoch,
            settled=self._now >= self._settle_until,
            split_k=None if split is None else split.prefill_workers,
            split_ttft_s=math.nan if split is None else split.ttft_s / split.factors.ttft,
            split_tpot_s=math.nan if split is None else split.tpot_s / split.factors.tpot,
        ))

    def _pair_profile(self) -> Profile:
        """The profile pairs are priced with: prefill times x the prefill factor."""
        f = self.calibration.factor("prefill")
        cached_f, cached = self._pair_profile_cache
        if f != cached_f:
            cached = self.profile if f == 1.0 else dataclasses.replace(
                self.profile, prefill_times=tuple(t * f for t in self.profile.prefill_times))
            if cached is not self.profile:  # the decode steps are the same: share their memo
                object.__setattr__(cached, "_step_memo_dict", self.profile._step_memo)
            self._pair_profile_cache = (f, cached)
        return cached

    def _correct(self, e: Estimate) -> Estimate:
        """`e` with its kind's TTFT and TPOT residuals applied."""
        f = self._residuals["local" if e.prefill is None else "disaggregated"]
        if f.ttft == 1.0 and f.tpot == 1.0:
            return e
        return dataclasses.replace(e, ttft_factor=f.ttft, tpot_factor=f.tpot, tpot_s=e.tpot_s * f.tpot)

    def _feasible_raw(self, e: Estimate) -> bool:
        """Feasibility of a model estimate (not yet corrected), as the search sees it."""
        return self._feasible(self._correct(e))

    # ---------------------------------------------------------------- the disaggregated choice

    def decide(
        self,
        prefills: Sequence[WorkerSnapshot],
        decodes: Sequence[WorkerSnapshot],
        request: RequestInfo,
        snapshot: ClusterSnapshot,
    ) -> Decision:
        if _hybrid(prefills, decodes):
            return self._decide_hybrid(prefills, decodes, request, snapshot)
        keys = self.prefixes.keys(request.prompt_token_ids)
        options = self._search(request, snapshot, keys, self._rows(prefills), self._rows(decodes))
        return self._choose(options, request, keys, options.load_map, len(decodes))

    def _place_disaggregated(self, request: RequestInfo, snapshot: ClusterSnapshot) -> Decision | None:
        """PoolPolicy.place + decide, from the arrays, for a request that the shared rules send to
        `decide` (not a hybrid cluster's): the same decision. None, with nothing changed, for the
        others (colocated, resumed, short, degraded, no decode worker, hybrid)."""
        if (snapshot.mode != "disaggregated" or request.num_resumed_tokens
                or request.num_prompt_tokens <= self.local_prefill_max_tokens):
            return None
        if len({w.kv_compat for w in snapshot.workers} - {""}) > 1:
            return None  # workers that must not pair: the shared rules pair only compatible ones
        columns = self._columns
        healthy = columns.healthy()
        can_decode, can_prefill = columns.role != ROLE_PREFILL, columns.role != ROLE_DECODE
        if not (healthy & can_decode).any():
            return None  # degraded: the shared rules' stand-in
        usable = healthy
        for worker_id in request.excluded:
            row = columns.index.get(worker_id)
            if row is not None:
                usable[row] = False
        decode_ok = usable & can_decode & columns.fits(request.num_tokens)
        prefill_ok = usable & can_prefill & columns.fits(request.num_prompt_tokens)
        candidates = decode_ok | prefill_ok
        if not decode_ok.any() or (columns.has_mixed and (prefill_ok == decode_ok).all()
                                   and (columns.role[candidates] == ROLE_MIXED).all() and candidates.sum() >= 2):
            return None  # the shared rules say none is left; or a hybrid cluster (_decide_hybrid)
        by_id = columns.by_id
        keys = self.prefixes.keys(request.prompt_token_ids)
        decode_rows = by_id[decode_ok[by_id]]
        options = self._search(request, snapshot, keys, by_id[prefill_ok[by_id]], decode_rows)
        return self._choose(options, request, keys, options.load_map, len(decode_rows))

    def _rows(self, workers: Sequence[WorkerSnapshot]) -> np.ndarray:
        """The rows of `workers` (in worker-id order) in the arrays of this placement's snapshot."""
        index = self._columns.index
        return np.array([index[w.worker_id] for w in workers], dtype=np.intp)

    def _search(self, request: RequestInfo, snapshot: ClusterSnapshot, keys: list[int], prefill_rows: np.ndarray,
                decode_rows: np.ndarray) -> Search:
        """The options of `request` over these rows of the arrays (P != D), for the rules below."""
        profile = self._pair_profile()  # sets the factor it carries
        return Search(
            profile, request, self._columns, prefill_rows, decode_rows, snapshot, self._columns.load(),
            pair=lambda p, d: self._estimate_pair(request, p, d, snapshot, keys),
            local=lambda d: self._estimate_local(request, d, keys),
            cached_blocks=self.prefixes.depths(keys), block_size=self.prefixes.block_size,
            tpot_limit=self.slo_tpot, tpot_factor=self._residuals["disaggregated"].tpot,
            prefill_factor=self._pair_profile_cache[0],
        )

    def _choose(self, options: Search, request: RequestInfo, keys: list[int],
                load: Mapping[str, int], num_decodes: int) -> Decision:
        """Rules 2-5 of the module docstring over the priced (or searched) options."""
        best_pair = _maybe(self._at_wire_precision, _maybe(self._correct, options.best_pair(self._feasible_raw)))
        best_local = _maybe(self._correct, options.best_local(self._feasible_raw))

        chosen, why = self._compete(best_pair, best_local)
        if chosen is None:
            summary = (f"no option within the TPOT SLO or with free KV blocks "
                       f"({options.num_pairs + num_decodes} estimated)")
            if self.admission_control:
                raise SLOUnattainable(f"request {request.request_id}: {summary}")
            everything = [self._at_wire_precision(self._correct(e)) if e.prefill is not None else self._correct(e)
                          for e in (options.best_pair(), options.best_local()) if e is not None]
            chosen = min(everything, key=lambda e: _order(e, load))
            why = f"best effort, {summary}"
        elif self.slo_ttft is not None and chosen.ttft_s > self.slo_ttft:
            if self.admission_control:
                raise SLOUnattainable(f"request {request.request_id}: no option meets the TTFT SLO of "
                                      f"{self.slo_ttft:.3f}s; best: {chosen.describe()}")
            why += f"; misses the TTFT SLO {self.slo_ttft:.3f}s"

        over_tpot = 0 if self.slo_tpot is None else options.count_over_tpot(
            self.slo_tpot, self._residuals["disaggregated"].tpot)
        no_room = options.count_without_room()
        others = (f"{options.num_pairs} pairs ({over_tpot} over the TPOT SLO, {no_room} without free KV blocks "
                  f"at D)")
        rival = best_local if chosen.prefill is not None else best_pair
        rival_text = f"; best {'local' if rival.prefill is None else 'pair'} {rival.ttft_s:.3f}s" if rival else ""
        reason = f"{chosen.describe()}; {why}{rival_text}; {others}"
        self._chosen = chosen
        self.prefixes.record(keys, chosen.prefill if chosen.prefill is not None else chosen.decode)
        if chosen.prefill is None:
            return Decision("local", None, chosen.decode, reason)
        return self._with_precision(Decision("disaggregated", chosen.prefill, chosen.decode, reason), chosen, request)

    def _at_wire_precision(self, e: Estimate) -> Estimate:
        """A pair priced at the KV precision the link calls for (cost.at_wire_precision), from
        the link's predicted transfer time, the prompt's KV bytes and the TTFT SLO."""
        if e.prefill is None or e.kv_precision_reason:
            return e
        return at_wire_precision(e, self._kv_bytes, self.profile.num_layers, device=self.profile.device,
                                 slo_ttft=self.slo_ttft, switch=self.kv_wire_precision,
                                 ratio=fp8_wire_ratio(self._num_tokens, self.prefixes.block_size))

    def _with_precision(self, decision: Decision, chosen: Estimate, request: RequestInfo) -> Decision:
        """`decision` with the chosen pair's KV precision on the wire and why."""
        chosen = self._at_wire_precision(chosen)
        return dataclasses.replace(decision, kv_precision=chosen.kv_precision,
                                   kv_precision_reason=chosen.kv_precision_reason)

    # ---------------------------------------------------------------- hybrid clusters

    def _decide_hybrid(self, prefills: Sequence[WorkerSnapshot], decodes: Sequence[WorkerSnapshot],
                       request: RequestInfo, snapshot: ClusterSnapshot) -> Decision:
        workers = sorted({w.worker_id: w for w in (*prefills, *decodes)}.values(), key=lambda w: w.worker_id)
        self.split.window.observe(snapshot.now, request.num_prompt_tokens, request.max_tokens)
        kv_bytes_per_token = snapshot.kv_bytes_per_token or self.profile.kv_bytes_per_token

        by_node: dict[str, list[WorkerSnapshot]] = {}
        for w in workers:  # a link is a node pair: price each once, weighted by its worker pairs
            by_node.setdefault(snapshot.node_of(w), []).append(w)

        def kv_seconds(prompt_tokens: float) -> float:  # mean over the worker pairs' links
            nbytes = round(prompt_tokens * kv_bytes_per_token)
            total, pairs = 0.0, 0
            for a, src in by_node.items():
                for b, dst in by_node.items():
                    n = len(src) * len(dst) - (len(src) if a == b else 0)
                    if n:
                        total += n * transfer_seconds(*snapshot.link(src[0], dst[0]), nbytes)
                        pairs += n
            return total / pairs

        before = self.split.current
        k, why = self.split.choose(self.profile, snapshot.now, len(workers), kv_seconds=kv_seconds,
                                   slo_ttft=self.slo_ttft, slo_tpot=self.slo_tpot,
                                   factors=self.calibration.split_factors)
        self._split_chosen = self.split.last[k] if self.split.last else None
        if k != before:
            self.calibration.new_epoch()
            self._settle_until = snapshot.now + self._drain_s(before, k, snapshot.now, workers)
        keys = self.prefixes.keys(request.prompt_token_ids)
        load = {w.worker_id: w.load for w in workers}
        if k > 0:
            ids = {w.worker_id for w in workers}
            if len(self._prefilling) != k or not set(self._prefilling) <= ids:
                self._prefilling = tuple(w.worker_id for w in sorted(workers, key=lambda w: (w.load, w.worker_id))[:k])
            pairs = [self._correct(self._estimate_pair(request, p, d, snapshot, keys)) for p in prefills
                     for d in decodes if p.worker_id in self._prefilling and d.worker_id not in self._prefilling]
            if pairs:
                feasible = [e for e in pairs if self._feasible(e)]
                chosen = min(feasible or pairs, key=lambda e: _order(e, load))
                self._chosen = chosen
                self.prefixes.record(keys, chosen.prefill)  # type: ignore[arg-type]
                note = "" if feasible else "; best effort: no pair within the TPOT SLO or with free KV blocks"
                return self._with_precision(Decision("disaggregated", chosen.prefill, chosen.decode,
                                                     f"hybrid {why}; {chosen.describe()}{note}"), chosen, request)
            why += "; no prefilling/decoding pair is available, so local"
        else:
            self._prefilling = ()
        estimates = [self._correct(self._estimate_local(request, d, keys)) for d in decodes]
        chosen = min(estimates, key=lambda e: (not self._feasible(e), *_order(e, load)))
        self._chosen = chosen
        self.prefixes.record(keys, chosen.decode)
        return Decision("local", None, chosen.decode, f"hybrid {why}; {chosen.describe()}")

    def _drain_s(self, before: int, after: int, now: float, workers: Sequence[WorkerSnapshot]) -> float:
        """How long the requests of configuration `before` take to finish: the prompts in flight
        on the busiest worker at the served prefill rate, then their mean output x the predicted
        TPOT of `before` (or of `after`, when `before` has none)."""
        backlog = max(self._pair_profile().prefill_seconds(w.num_inflight_tokens) for w in workers)
        load = self.split.window.estimate(now)
        if load is None:
            return backlog
        for k in (before, after):
            if k < len(self.split.last) and math.isfinite(self.split.last[k].tpot_s):
                return backlog + load.output_tokens * self.split.last[k].tpot_s
        return backlog

    def _compete(self, pair: Estimate | None, local: Estimate | None) -> tuple[Estimate | None, str]:
        if pair is None or local is None:
            if pair is not None:
                return pair, "no feasible local run"
            return local, ("no feasible pair" if local is not None else "")
        if not self.local_prefill:
            return pair, "local prefill off (--no-local-prefill)"
        slo = self.slo_ttft
        if slo is not None and (pair.ttft_s <= slo) != (local.ttft_s <= slo):
            return (pair, "only the pair meets the TTFT SLO") if pair.ttft_s <= slo else \
                (local, "only local meets the TTFT SLO")
        if local.ttft_s < (1 - self.local_margin) * pair.ttft_s:
            return local, f"local beats every pair by > {self.local_margin:.0%}"
        return pair, "lowest predicted TTFT"

    def _feasible(self, e: Estimate) -> bool:
        return e.room and (self.slo_tpot is None or e.tpot_s <= self.slo_tpot)

    def _estimate_pair(self, request: RequestInfo, p: WorkerSnapshot, d: WorkerSnapshot, snapshot: ClusterSnapshot,
              keys: list[int]) -> Estimate:
        cached = self.prefixes.matched_blocks(keys, p.worker_id) * self.prefixes.block_size
        profile = self._pair_profile()  # sets the factor it carries
        return estimate_pair(profile, request, p, d, snapshot, cached_tokens=cached,
                             prefill_factor=self._pair_profile_cache[0])

    def _estimate_local(self, request: RequestInfo, d: WorkerSnapshot, keys: list[int]) -> Estimate:
        cached = self.prefixes.matched_blocks(keys, d.worker_id) * self.prefixes.block_size
        return estimate_local(self.profile, request, d, cached_tokens=cached)

    # ---------------------------------------------------------------- local-only paths

    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        """Colocated, resumed and short requests: the lowest local TTFT, TPOT-feasible first."""
        keys = self.prefixes.keys(request.prompt_token_ids)
        load = {w.worker_id: w.load for w in candidates}
        estimates = [self._correct(self._estimate_local(request, w, keys)) for w in candidates]
        best = min(estimates, key=lambda e: (not self._feasible(e), *_order(e, load)))
        if purpose in ("local", "colocated"):
            self._chosen = best
        return next(w for w in candidates if w.worker_id == best.decode)


def _maybe(f, e: Estimate | None) -> Estimate | None:
    return None if e is None else f(e)


def _hybrid(prefills: Sequence[WorkerSnapshot], decodes: Sequence[WorkerSnapshot]) -> bool:
    """Every candidate is a mixed worker that both prefills for others and decodes for them."""
    workers = {w.worker_id: w for w in (*prefills, *decodes)}
    return (len(workers) >= 2 and all(w.role == "mixed" for w in workers.values())
            and {w.worker_id for w in prefills} == {w.worker_id for w in decodes})


def _order(e: Estimate, load: Mapping[str, int]) -> tuple[float, int, int, str, str]:
    return (e.ttft_s, load.get(e.prefill or "", 0), load[e.decode], e.prefill or "", e.decode)
